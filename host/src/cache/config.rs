//! The `[cache]` configuration section and how a memory budget becomes pool sizes.
//!
//! One byte budget is split between paged KV blocks and SSM-state slots (one live slot per
//! running request plus durable snapshot slots). Sizes follow from the model's [`CacheSpec`];
//! an impossible budget is an error that names the keys to change. Nothing here allocates.
//!
//! Attention-free models (pure Mamba2) have KV blocks that hold no data, yet the block pool
//! still needs logical blocks: block tables of running sequences and the prefix index that
//! SSM snapshots hang off. Their count is bounded by what can be indexed usefully (see
//! [`CacheLayout::plan`]), not by dividing the budget by a zero block size.

use std::fmt;

use serde::{Deserialize, Deserializer};

use super::spec::{CacheSpec, KvCacheDtype, SsmStateDtype};

/// Share of the budget left after live SSM slots that goes to durable snapshots when
/// `ssm_share` is not set.
pub const AUTO_SNAPSHOT_SHARE: f64 = 0.2;

/// Attention-free models: tokens of sequence each SSM slot (live or durable) gets logical
/// blocks for. A live slot's request, or the prefix chain a durable snapshot hangs off, longer
/// than this still fits as long as the others are shorter: the pool is shared.
pub const ATTENTION_FREE_TOKENS_PER_SLOT: usize = 32 * 1024;

/// Attention-free models: host bytes one logical block may cost (its metadata and free-list
/// entry, plus prefix-index and LRU entries while cached), charged against the budget so the
/// pool's bookkeeping never outgrows it.
pub const BLOCK_BOOKKEEPING_BYTES: u64 = 256;

/// `[cache]` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Bytes for KV blocks and SSM slots together: an integer or a string like "8GiB";
    /// `None` ("auto" in TOML) is resolved when the model is loaded (see
    /// [`CacheLayout::budget_for_tokens`]): on a GPU from `gpu_memory_utilization`, on the CPU
    /// enough for one sequence of the longest context, at least [`CPU_MIN_AUTO_BUDGET`].
    #[serde(deserialize_with = "auto_or_size")]
    pub memory_budget: Option<ByteSize>,
    /// Tokens per KV block (and the granularity of prefix matching and SSM snapshots).
    pub block_size: usize,
    /// Reuse cached prompt blocks (and SSM snapshots) across requests.
    pub prefix_caching: bool,
    /// Fraction of `memory_budget` for SSM slots (live + durable snapshots), hybrid models
    /// only. Unset: live slots for `engine.max_running` requests, then
    /// [`AUTO_SNAPSHOT_SHARE`] of the rest for snapshots.
    pub ssm_share: Option<f64>,
    /// Storage type of the SSM recurrent state: "float32" (default) or "bfloat16". It sizes
    /// the SSM slots. The CPU backend computes and stores the state in f32 whatever this says,
    /// so on the CPU it only changes how the budget is split.
    pub ssm_state_dtype: SsmStateDtype,
    /// Storage type of the paged KV cache: "auto" (what the backend computes in) or
    /// "fp8_e4m3" (FP8 codes with a per-layer scale for K and for V; half a bf16 cache's
    /// bytes). It sizes the KV blocks; see [`KvCacheDtype`].
    pub kv_dtype: KvCacheDtype,
    /// On a GPU: the budget is this fraction of the device memory left free once the weights
    /// are loaded (replacing `memory_budget`); the rest stays for activations. Ignored on the CPU.
    pub memory_fraction: Option<f64>,
    /// On a GPU with `memory_budget = "auto"` (vLLM's `--gpu-memory-utilization`): the share of
    /// the device's whole memory this process may hold; the cache gets what the weights (and
    /// whatever else already holds device memory) leave of it. In (0, 1].
    pub gpu_memory_utilization: f64,
    /// Hybrid models: also snapshot a prompt's SSM state every this many tokens (a multiple
    /// of `block_size`; 0 turns it off), so a later prompt sharing any long prefix of it
    /// resumes at most this many tokens before the divergence. Without it a prefix is
    /// resumable only where an earlier prompt ended or had been served from cache, so the
    /// first two requests of a new shared prefix both compute it in full.
    pub ssm_snapshot_interval: usize,
}

/// The values of `configs/default.toml` (a test checks they agree).
impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            memory_budget: None,
            block_size: 16,
            prefix_caching: true,
            ssm_share: None,
            ssm_state_dtype: SsmStateDtype::Float32,
            kv_dtype: KvCacheDtype::Auto,
            memory_fraction: None,
            gpu_memory_utilization: 0.9,
            ssm_snapshot_interval: 512,
        }
    }
}

/// The smallest budget `memory_budget = "auto"` gives on the CPU.
pub const CPU_MIN_AUTO_BUDGET: ByteSize = ByteSize(256 << 20);

/// A size as TOML writes it: an integer or a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawSize {
    Int(u64),
    Str(String),
}

/// `memory_budget`: "auto" (`None`) or a size.
fn auto_or_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ByteSize>, D::Error> {
    match RawSize::deserialize(d)? {
        RawSize::Str(s) if s.trim() == "auto" => Ok(None),
        RawSize::Int(n) => Ok(Some(ByteSize(n))),
        RawSize::Str(s) => ByteSize::parse(&s)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("{e}, or \"auto\""))),
    }
}

/// A byte count, deserialized from an integer or a string with a unit (B, KB, MB, GB, TB,
/// KiB, MiB, GiB, TiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let num: f64 = num
            .parse()
            .map_err(|_| format!("`{s}` is not a size (expected e.g. 8GiB, 512MiB, 1000000)"))?;
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            u => {
                return Err(format!(
                    "unknown size unit `{u}` (use B, KB, MB, GB, KiB, MiB, GiB)"
                ));
            }
        };
        Ok(Self((num * mult as f64) as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if b >= (1u64 << 30) as f64 {
            write!(f, "{:.2}GiB", b / (1u64 << 30) as f64)
        } else if b >= (1u64 << 20) as f64 {
            write!(f, "{:.2}MiB", b / (1u64 << 20) as f64)
        } else {
            write!(f, "{}B", self.0)
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match RawSize::deserialize(d)? {
            RawSize::Int(n) => Ok(ByteSize(n)),
            RawSize::Str(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CacheConfigError {
    #[error("cache.block_size = {0}: must be between 2 and 4096")]
    BlockSize(usize),
    #[error("cache.ssm_share = {0}: must be in [0, 1)")]
    Share(f64),
    #[error(
        "cache.memory_budget = \"auto\" was not resolved to a size before the cache was planned"
    )]
    Unresolved,
    #[error(
        "cache.memory_budget = {budget} cannot hold the {live} live SSM slots (one per \
         engine.max_running request, {slot} each, {need} in total): raise cache.memory_budget, \
         raise cache.ssm_share, or lower engine.max_running"
    )]
    LiveSlots {
        budget: ByteSize,
        live: usize,
        slot: ByteSize,
        need: ByteSize,
    },
    #[error(
        "cache.memory_budget = {budget} leaves {blocks} KV blocks of {block} each (at least 2 \
         are needed): raise cache.memory_budget, lower cache.ssm_share or engine.max_running, \
         or lower cache.block_size"
    )]
    TooFewBlocks {
        budget: ByteSize,
        blocks: usize,
        block: ByteSize,
    },
}

/// Pool sizes derived from the budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLayout {
    pub block_size: usize,
    pub num_blocks: usize,
    pub live_slots: usize,
    pub durable_slots: usize,
    pub kv_bytes: u64,
    pub ssm_bytes: u64,
}

impl CacheLayout {
    pub fn ssm_slots(&self) -> usize {
        self.live_slots + self.durable_slots
    }

    /// Splits `cfg.memory_budget` for a model with `spec`, serving up to `max_running`
    /// requests at once. SSM slots are sized with `cfg.ssm_state_dtype`, KV blocks with
    /// `cfg.kv_dtype`.
    ///
    /// KV blocks get what the SSM slots leave. On an attention-free model a block holds no
    /// data, so the count is the smaller of
    /// - `ssm_slots() * ceil(ATTENTION_FREE_TOKENS_PER_SLOT / block_size)`: every live slot's
    ///   request and every snapshot's prefix chain fully indexed, and
    /// - what is left of the budget over [`BLOCK_BOOKKEEPING_BYTES`]: the pool's host memory
    ///   stays within the budget.
    pub fn plan(
        cfg: &CacheConfig,
        spec: &CacheSpec,
        max_running: usize,
    ) -> Result<Self, CacheConfigError> {
        let bs = cfg.block_size;
        if !(2..=4096).contains(&bs) {
            return Err(CacheConfigError::BlockSize(bs));
        }
        if let Some(r) = cfg.ssm_share
            && !(0.0..1.0).contains(&r)
        {
            return Err(CacheConfigError::Share(r));
        }
        let spec = spec
            .with_ssm_state_dtype(cfg.ssm_state_dtype)
            .with_kv_dtype(cfg.kv_dtype);
        let memory_budget = cfg.memory_budget.ok_or(CacheConfigError::Unresolved)?;
        let budget = memory_budget.0;
        let (live_slots, durable_slots, ssm_bytes) = if spec.is_hybrid() {
            let slot = spec.ssm_slot_bytes().max(1) as u64;
            let live_need = slot * max_running as u64;
            let ssm_budget = match cfg.ssm_share {
                Some(r) => (budget as f64 * r) as u64,
                None => {
                    live_need
                        + (budget.saturating_sub(live_need) as f64 * AUTO_SNAPSHOT_SHARE) as u64
                }
            };
            if ssm_budget < live_need {
                return Err(CacheConfigError::LiveSlots {
                    budget: memory_budget,
                    live: max_running,
                    slot: ByteSize(slot),
                    need: ByteSize(live_need),
                });
            }
            let durable = if cfg.prefix_caching {
                (ssm_budget - live_need) / slot
            } else {
                0
            };
            (max_running, durable as usize, live_need + durable * slot)
        } else {
            (0, 0, 0)
        };
        let kv_budget = budget.saturating_sub(ssm_bytes);
        let kv_block = spec.kv_block_bytes(bs) as u64;
        let (num_blocks, charged) = if spec.is_attention_free() {
            let per_slot = ATTENTION_FREE_TOKENS_PER_SLOT.div_ceil(bs) as u64;
            let useful = (live_slots + durable_slots) as u64 * per_slot;
            let bookkeeping = kv_budget / BLOCK_BOOKKEEPING_BYTES;
            (useful.min(bookkeeping), BLOCK_BOOKKEEPING_BYTES)
        } else {
            (kv_budget / kv_block, kv_block)
        };
        let num_blocks = num_blocks.min(u32::MAX as u64 - 1) as usize;
        if num_blocks < 2 {
            return Err(CacheConfigError::TooFewBlocks {
                budget: memory_budget,
                blocks: num_blocks,
                block: ByteSize(charged),
            });
        }
        Ok(Self {
            block_size: bs,
            num_blocks,
            live_slots,
            durable_slots,
            kv_bytes: num_blocks as u64 * kv_block,
            ssm_bytes,
        })
    }

    /// Tokens of KV the pool holds: the longest sequence it can ever hold alone.
    pub fn token_capacity(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }

    /// The smallest budget whose plan (with `cfg`'s other keys) holds `tokens` tokens of KV,
    /// to the byte: the plan is monotonic in the budget, so a binary search over it finds the
    /// exact edge without repeating its split rules here. `None` when no budget below 1 PiB
    /// does.
    pub fn budget_for_tokens(
        cfg: &CacheConfig,
        spec: &CacheSpec,
        max_running: usize,
        tokens: usize,
    ) -> Option<ByteSize> {
        let holds = |bytes: u64| {
            let c = CacheConfig {
                memory_budget: Some(ByteSize(bytes)),
                ..cfg.clone()
            };
            Self::plan(&c, spec, max_running).is_ok_and(|l| l.token_capacity() >= tokens)
        };
        let (mut lo, mut hi) = (0u64, 1u64 << 50);
        if !holds(hi) {
            return None;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if holds(mid) { hi = mid } else { lo = mid }
        }
        Some(ByteSize(hi))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(ssm_layers: usize) -> CacheSpec {
        CacheSpec {
            attn_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            ssm_layers,
            conv_state_elems: 8,
            ssm_state_elems: 24,
            kv_elem_bytes: 4,
            conv_elem_bytes: 4,
            ssm_elem_bytes: 4,
        }
    }

    /// A 3-layer Mamba2 with the mixer of mamba2-130m (d_model 768, expand 2, 24 heads of 64,
    /// state 128, 1 group, conv kernel 4): no attention, 2.4 MB per f32 slot.
    fn mamba2_3_layers() -> CacheSpec {
        CacheSpec {
            attn_layers: 0,
            kv_heads: 0,
            head_dim: 0,
            ssm_layers: 3,
            conv_state_elems: (1536 + 2 * 128) * 3,
            ssm_state_elems: 24 * 64 * 128,
            kv_elem_bytes: 4,
            conv_elem_bytes: 4,
            ssm_elem_bytes: 4,
        }
    }

    #[test]
    fn byte_sizes_parse() {
        assert_eq!(ByteSize::parse("8GiB"), Ok(ByteSize(8 << 30)));
        assert_eq!(ByteSize::parse("512 MiB"), Ok(ByteSize(512 << 20)));
        assert_eq!(ByteSize::parse("1.5GB"), Ok(ByteSize(1_500_000_000)));
        assert_eq!(ByteSize::parse("1000"), Ok(ByteSize(1000)));
        assert!(ByteSize::parse("8 parsecs").is_err());
        assert!(ByteSize::parse("lots").is_err());
    }

    #[test]
    fn toml_section_rejects_unknown_keys() {
        let ok: CacheConfig =
            toml::from_str("memory_budget = \"2MiB\"\nblock_size = 32\nssm_share = 0.5").unwrap();
        assert_eq!(ok.memory_budget, Some(ByteSize(2 << 20)));
        let auto: CacheConfig = toml::from_str("memory_budget = \"auto\"").unwrap();
        assert_eq!(auto.memory_budget, None);
        assert!(toml::from_str::<CacheConfig>("memory_budget = \"lots\"").is_err());
        assert_eq!(ok.block_size, 32);
        assert!(ok.prefix_caching);
        let int: CacheConfig = toml::from_str("memory_budget = 4096").unwrap();
        assert_eq!(int.memory_budget, Some(ByteSize(4096)));
        let err = toml::from_str::<CacheConfig>("block_sise = 16").unwrap_err();
        assert!(err.to_string().contains("block_sise"), "{err}");
    }

    #[test]
    fn ssm_state_dtype_key_is_validated() {
        assert_eq!(
            CacheConfig::default().ssm_state_dtype,
            SsmStateDtype::Float32
        );
        let bf: CacheConfig = toml::from_str("ssm_state_dtype = \"bfloat16\"").unwrap();
        assert_eq!(bf.ssm_state_dtype, SsmStateDtype::Bfloat16);
        let err = toml::from_str::<CacheConfig>("ssm_state_dtype = \"float16\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "cache.ssm_state_dtype = \"float16\": must be \"float32\" or \"bfloat16\""
            ),
            "{err}"
        );
        assert!(toml::from_str::<CacheConfig>("ssm_state_dtype = 16").is_err());
    }

    #[test]
    fn ssm_slots_are_sized_with_the_ssm_state_dtype() {
        // Slot: 3 layers * (8 conv * 4 bytes + 24 state * 2 bytes) = 240 B; KV unchanged.
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(100_000)),
            ssm_share: Some(0.25),
            ssm_state_dtype: SsmStateDtype::Bfloat16,
            ..Default::default()
        };
        let l = CacheLayout::plan(&cfg, &spec(3), 4).unwrap();
        assert_eq!(l.durable_slots, (25_000 - 4 * 240) / 240);
        assert_eq!(l.ssm_bytes, (4 + l.durable_slots as u64) * 240);
        assert_eq!(l.num_blocks as u64, (100_000 - l.ssm_bytes) / 2048);
    }

    #[test]
    fn fp8_kv_sizes_blocks_at_one_byte_an_element() {
        let bf16 = CacheConfig {
            memory_budget: Some(ByteSize(100_000)),
            ssm_share: Some(0.25),
            ..Default::default()
        };
        let fp8 = CacheConfig {
            kv_dtype: "fp8_e4m3".parse().unwrap(),
            ..bf16.clone()
        };
        let a = CacheLayout::plan(&bf16, &spec(3), 4).unwrap();
        let b = CacheLayout::plan(&fp8, &spec(3), 4).unwrap();
        assert_eq!(a.ssm_bytes, b.ssm_bytes, "the SSM split does not move");
        assert_eq!(a.num_blocks as u64, (100_000 - a.ssm_bytes) / 2048);
        // 2 (K, V) · 2 layers · 16 tokens · 2 heads · 4 dims · 1 byte (f32: 4 bytes).
        assert_eq!(b.num_blocks as u64, (100_000 - b.ssm_bytes) / 512);
        let t: CacheConfig = toml::from_str("kv_dtype = \"fp8\"").unwrap();
        assert_eq!(t.kv_dtype, KvCacheDtype::Fp8E4M3);
        let err = toml::from_str::<CacheConfig>("kv_dtype = \"fp8_e5m2\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("e5m2 caches are not supported"), "{err}");
    }

    #[test]
    fn attention_free_pool_is_bounded_by_what_slots_can_index() {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(256 << 20)),
            ..Default::default()
        };
        let spec = mamba2_3_layers();
        let slot = 3 * (5376 + 196_608) * 4;
        assert_eq!(spec.ssm_slot_bytes(), slot);
        let l = CacheLayout::plan(&cfg, &spec, 64).unwrap();
        let rest = (256u64 << 20) - 64 * slot as u64;
        assert_eq!(
            l.durable_slots as u64,
            (rest as f64 * 0.2) as u64 / slot as u64
        );
        assert_eq!(l.durable_slots, 9);
        // (64 live + 9 durable) slots * 32768 tokens / 16 per block. Dividing the leftover by
        // a 1-byte block (the old rule) gave one block per byte: 91_497_472 blocks.
        assert_eq!(l.num_blocks, 73 * 2048);
        assert_eq!((256 << 20) - l.ssm_bytes, 91_497_472);
        assert_eq!(l.kv_bytes, 0);
        assert!(l.ssm_bytes <= 256 << 20);
    }

    #[test]
    fn attention_free_pool_bookkeeping_stays_within_the_budget() {
        // Tiny slots: thousands of snapshots would index more blocks than the budget can keep
        // the bookkeeping of, so the leftover budget over 256 bytes per block decides.
        let tiny = CacheSpec {
            attn_layers: 0,
            ..spec(2)
        };
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(256 << 20)),
            ..Default::default()
        };
        let l = CacheLayout::plan(&cfg, &tiny, 64).unwrap();
        assert!(l.ssm_slots() * 2048 > l.num_blocks);
        assert_eq!(
            l.num_blocks as u64,
            ((256u64 << 20) - l.ssm_bytes) / BLOCK_BOOKKEEPING_BYTES
        );
        // The old rule: 214_735_360 blocks (~14 GB of block metadata).
        assert_eq!(l.num_blocks, 838_810);
    }

    #[test]
    fn transformer_budget_is_all_kv() {
        // One block: 2 (K,V) * 2 layers * 16 tokens * 2 heads * 4 dims * 4 bytes = 2048 B.
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(10 * 2048 + 100)),
            ..Default::default()
        };
        let l = CacheLayout::plan(&cfg, &spec(0), 8).unwrap();
        assert_eq!(l.num_blocks, 10);
        assert_eq!(l.ssm_slots(), 0);
    }

    #[test]
    fn hybrid_explicit_share_splits_budget() {
        // Slot: 3 layers * 32 elems * 4 bytes = 384 B.
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(100_000)),
            ssm_share: Some(0.25),
            ..Default::default()
        };
        let l = CacheLayout::plan(&cfg, &spec(3), 4).unwrap();
        assert_eq!(l.live_slots, 4);
        assert_eq!(l.durable_slots, (25_000 - 4 * 384) / 384);
        assert_eq!(l.num_blocks as u64, (100_000 - l.ssm_bytes) / 2048);
        assert!(l.kv_bytes + l.ssm_bytes <= 100_000);
    }

    #[test]
    fn hybrid_auto_share_gives_snapshots_a_fifth_of_the_rest() {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(100_000)),
            ..Default::default()
        };
        let l = CacheLayout::plan(&cfg, &spec(3), 4).unwrap();
        let rest = 100_000 - 4 * 384;
        assert_eq!(l.durable_slots as u64, (rest as f64 * 0.2) as u64 / 384);
        let off = CacheConfig {
            prefix_caching: false,
            ..cfg
        };
        assert_eq!(
            CacheLayout::plan(&off, &spec(3), 4).unwrap().durable_slots,
            0
        );
    }

    #[test]
    fn impossible_budgets_say_what_to_change() {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(3000)),
            ..Default::default()
        };
        let e = CacheLayout::plan(&cfg, &spec(0), 1).unwrap_err();
        assert!(e.to_string().contains("raise cache.memory_budget"), "{e}");
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(100_000)),
            ssm_share: Some(0.01),
            ..Default::default()
        };
        let e = CacheLayout::plan(&cfg, &spec(3), 64).unwrap_err();
        assert!(
            matches!(e, CacheConfigError::LiveSlots { live: 64, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("engine.max_running"));
        let bad = CacheConfig {
            block_size: 1,
            ..Default::default()
        };
        assert_eq!(
            CacheLayout::plan(&bad, &spec(0), 1),
            Err(CacheConfigError::BlockSize(1))
        );
    }
}
