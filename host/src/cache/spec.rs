//! [`CacheSpec`]: what a model needs from the caches, in numbers the cache can size pools from,
//! [`SsmStateDtype`], the storage type of the SSM recurrent state (`cache.ssm_state_dtype`), and
//! [`KvCacheDtype`], that of the paged KV cache (`cache.kv_dtype`).
//!
//! The spec is plain data reported by the executor (the model); the cache reads it to turn a
//! byte budget into block and slot counts and never learns anything else about the model.
//! Element sizes are per cache, because the three caches need not share a dtype (a bf16 model
//! may keep its SSM state in f32).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer};

/// What a model needs from the caches, so the cache manager can size pools from a byte budget
/// without knowing anything else about the model.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    /// Number of attention layers (each has paged K and V).
    pub attn_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Number of recurrent layers, whatever their kind (Mamba2, Gated DeltaNet); 0 for plain
    /// transformers.
    pub ssm_layers: usize,
    /// Elements of conv state per recurrent layer per slot.
    pub conv_state_elems: usize,
    /// Elements of recurrent state per recurrent layer per slot (Mamba2: heads × head_dim ×
    /// state; Gated DeltaNet: value heads × key dim × value dim).
    pub ssm_state_elems: usize,
    /// Bytes per cached K or V element (4 for the f32 CPU backend).
    pub kv_elem_bytes: usize,
    /// Bytes per conv-state element.
    pub conv_elem_bytes: usize,
    /// Bytes per recurrent-state element. [`crate::cache::CacheLayout::plan`] replaces it with
    /// the configured `cache.ssm_state_dtype`.
    pub ssm_elem_bytes: usize,
}

impl CacheSpec {
    /// Bytes of K+V for one block of `block_size` tokens over all attention layers.
    pub fn kv_block_bytes(&self, block_size: usize) -> usize {
        2 * self.attn_layers * block_size * self.kv_heads * self.head_dim * self.kv_elem_bytes
    }

    /// Bytes of one SSM-state slot over all SSM layers (conv + recurrent state).
    pub fn ssm_slot_bytes(&self) -> usize {
        self.ssm_layers
            * (self.conv_state_elems * self.conv_elem_bytes
                + self.ssm_state_elems * self.ssm_elem_bytes)
    }

    /// This spec with the recurrent state stored as `dtype`.
    pub fn with_ssm_state_dtype(&self, dtype: SsmStateDtype) -> Self {
        Self {
            ssm_elem_bytes: dtype.elem_bytes(),
            ..self.clone()
        }
    }

    /// This spec with the paged K and V stored as `dtype`.
    pub fn with_kv_dtype(&self, dtype: KvCacheDtype) -> Self {
        Self {
            kv_elem_bytes: dtype.elem_bytes().unwrap_or(self.kv_elem_bytes),
            ..self.clone()
        }
    }

    pub fn is_hybrid(&self) -> bool {
        self.ssm_layers > 0
    }

    /// No attention layer: KV blocks hold no data (pure Mamba2).
    pub fn is_attention_free(&self) -> bool {
        self.kv_block_bytes(1) == 0
    }
}

/// Storage type of the SSM recurrent state (`cache.ssm_state_dtype`). It sizes the SSM slots in
/// [`crate::cache::CacheLayout::plan`]. The CPU backend computes and stores the state in f32
/// whatever this says: there it only changes how many slots the budget is split into.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SsmStateDtype {
    #[default]
    Float32,
    Bfloat16,
}

impl SsmStateDtype {
    pub const ALLOWED: &'static str = "\"float32\" or \"bfloat16\"";

    pub fn elem_bytes(self) -> usize {
        match self {
            Self::Float32 => 4,
            Self::Bfloat16 => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Float32 => "float32",
            Self::Bfloat16 => "bfloat16",
        }
    }
}

impl fmt::Display for SsmStateDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SsmStateDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "float32" => Ok(Self::Float32),
            "bfloat16" => Ok(Self::Bfloat16),
            other => Err(format!(
                "cache.ssm_state_dtype = \"{other}\": must be {}",
                Self::ALLOWED
            )),
        }
    }
}

impl<'de> Deserialize<'de> for SsmStateDtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Storage type of the paged KV cache (`cache.kv_dtype`). `Auto` stores K and V as the
/// backend computes them (bf16 on a serving GPU, f32 on the CPU and in a GPU's oracle mode);
/// `Fp8E4M3` stores them as FP8 e4m3 codes with one scale per layer for K and one for V (the
/// checkpoint's `k_scale` / `v_scale`, else 1.0, as vLLM does), halving a bf16 cache. The CPU
/// keeps its f32 storage and rounds every written value through e4m3 (the oracle the GPU's
/// FP8 cache is checked against); there the setting sizes blocks as one byte an element, as
/// `cache.ssm_state_dtype` sizes slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    Fp8E4M3,
}

impl KvCacheDtype {
    pub const ALLOWED: &'static str = "\"auto\" or \"fp8_e4m3\" (also \"fp8\")";

    /// Bytes per element, or `None` for the backend's own dtype.
    pub fn elem_bytes(self) -> Option<usize> {
        match self {
            Self::Auto => None,
            Self::Fp8E4M3 => Some(1),
        }
    }

    pub fn is_fp8(self) -> bool {
        self == Self::Fp8E4M3
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp8E4M3 => "fp8_e4m3",
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4M3),
            "fp8_e5m2" => Err(format!(
                "cache.kv_dtype = \"{s}\": FP8 e5m2 caches are not supported (e4m3 is: \"fp8_e4m3\")"
            )),
            other => Err(format!(
                "cache.kv_dtype = \"{other}\": must be {}",
                Self::ALLOWED
            )),
        }
    }
}

impl<'de> Deserialize<'de> for KvCacheDtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec() -> CacheSpec {
        CacheSpec {
            attn_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            ssm_layers: 3,
            conv_state_elems: 8,
            ssm_state_elems: 24,
            kv_elem_bytes: 2,
            conv_elem_bytes: 2,
            ssm_elem_bytes: 4,
        }
    }

    #[test]
    fn sizes_use_each_caches_element_size() {
        let s = spec();
        // 2 (K,V) * 2 layers * 16 tokens * 2 heads * 4 dims * 2 bytes.
        assert_eq!(s.kv_block_bytes(16), 1024);
        // 3 layers * (8 * 2 + 24 * 4).
        assert_eq!(s.ssm_slot_bytes(), 336);
        let bf16 = s.with_ssm_state_dtype(SsmStateDtype::Bfloat16);
        assert_eq!(bf16.ssm_slot_bytes(), 3 * (8 * 2 + 24 * 2));
        assert_eq!(bf16.kv_block_bytes(16), 1024);
        assert_eq!(s.with_kv_dtype(KvCacheDtype::Auto).kv_block_bytes(16), 1024);
        let fp8 = s.with_kv_dtype(KvCacheDtype::Fp8E4M3);
        assert_eq!(
            fp8.kv_block_bytes(16),
            512,
            "one byte an element: half of bf16"
        );
        assert_eq!(fp8.ssm_slot_bytes(), 336);
        assert!(!s.is_attention_free());
        let mamba = CacheSpec {
            attn_layers: 0,
            ..s
        };
        assert!(mamba.is_attention_free() && mamba.is_hybrid());
    }

    #[test]
    fn dtype_parses_the_allowed_names_only() {
        assert_eq!("float32".parse(), Ok(SsmStateDtype::Float32));
        assert_eq!("bfloat16".parse(), Ok(SsmStateDtype::Bfloat16));
        assert_eq!(SsmStateDtype::default(), SsmStateDtype::Float32);
        let e = "float16".parse::<SsmStateDtype>().unwrap_err();
        assert_eq!(
            e,
            "cache.ssm_state_dtype = \"float16\": must be \"float32\" or \"bfloat16\""
        );
    }

    #[test]
    fn kv_dtype_parses_vllm_names_and_refuses_e5m2_by_name() {
        assert_eq!("auto".parse(), Ok(KvCacheDtype::Auto));
        assert_eq!("fp8".parse(), Ok(KvCacheDtype::Fp8E4M3));
        assert_eq!("fp8_e4m3".parse(), Ok(KvCacheDtype::Fp8E4M3));
        assert_eq!(KvCacheDtype::default(), KvCacheDtype::Auto);
        let e = "fp8_e5m2".parse::<KvCacheDtype>().unwrap_err();
        assert!(e.contains("e5m2 caches are not supported"), "{e}");
        let e = "int8".parse::<KvCacheDtype>().unwrap_err();
        assert_eq!(
            e,
            "cache.kv_dtype = \"int8\": must be \"auto\" or \"fp8_e4m3\" (also \"fp8\")"
        );
    }
}
