//! The cache manager: one facade over the KV block pool, the prefix index and the SSM-state
//! pool of one engine replica (DESIGN.md §4).
//!
//! The scheduler talks to it in plain data (sequence slots, token counts, prefix hashes) and
//! never sees block ids or free lists; the model runner reads block tables and slot ids from
//! it. What it guarantees:
//! - matched blocks are pinned before new ones are allocated, and an admission either fully
//!   succeeds or changes nothing;
//! - a sequence skips only whole blocks, leaves at least 2 prompt tokens to compute, and on a
//!   hybrid model skips only to a boundary that has both cached KV and an SSM snapshot (a
//!   missing snapshot at restore time is an error, never a zero state);
//! - prompt and output blocks enter the index (same chained hashes), and snapshots attach to
//!   blocks, only after the step that computed them succeeded ([`CacheManager::commit_step`]);
//!   a failed step is rolled back with [`CacheManager::abort_step`];
//! - a decoding hybrid sequence keeps one *rolling* snapshot: a durable slot refreshed (by a
//!   snapshot target planned into the step, like any other) each time it completes a block;
//!   when the sequence is released the slot becomes the durable snapshot of that block, so a
//!   follow-up turn restores at most one block before where this one ended. A rolling slot is
//!   taken from the durable budget; when none can be had the snapshot is skipped and counted;
//! - every admission can say why it was served less than its cacheable prefix
//!   ([`CacheManager::miss_reason`], [`MissReason`]);
//! - when the durable SSM slots are full, snapshots no prompt has restored from go before
//!   proven ones ([`SsmPool::victim`]), so shared prefixes keep their state under a stream of
//!   one-off snapshots;
//! - evicting a block drops its snapshot; `reset_prefix_cache` drops every cached entry while
//!   running sequences keep their blocks.
//!
//! It knows nothing of models, backends, HTTP or requests beyond their slot numbers.

pub mod block_pool;
pub mod config;
pub mod events;
pub mod hash;
pub mod miss;
pub mod spec;
pub mod ssm_pool;
mod stats;

pub use block_pool::{BlockPool, NO_PARENT, PoolError};
pub use config::{ByteSize, CacheConfig, CacheConfigError, CacheLayout};
pub use events::{KvEvent, StoredBlock};
pub use hash::{BlockHash, HashSeed};
pub use miss::{MissMemory, MissReason};
pub use spec::{CacheSpec, KvCacheDtype, SsmStateDtype};
pub use ssm_pool::SsmPool;
pub use stats::CacheCounters;

use crate::policy::Evictor;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CacheError {
    #[error("not enough free KV blocks")]
    NoSpace,
    #[error("the prefix match is stale: {found} of its {matched} blocks are cached now")]
    StaleMatch { matched: usize, found: usize },
    #[error("no SSM snapshot at the restore boundary (block {0})")]
    RestoreMissing(u32),
    #[error("no free live SSM slot")]
    NoLiveSlot,
    #[error("sequence slot {0} is not admitted")]
    UnknownSeq(u32),
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// How much of a prompt the cache can serve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading prompt blocks whose KV is cached.
    pub kv_blocks: usize,
    /// Leading blocks whose computation is skipped (≤ `kv_blocks`).
    pub skip_blocks: usize,
}

/// "After `after` tokens of this chunk, copy the live SSM state (all layers) into `slot`."
/// `after` is in `1 ..= len`. Planned by [`CacheManager::plan_snapshots`], carried to the model
/// in its batch inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsmSnapshot {
    pub after: usize,
    pub slot: u32,
}

/// The SSM-state operation a new sequence needs before its first chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SsmInit {
    /// Not a hybrid model.
    None,
    Zero {
        live: u32,
    },
    Restore {
        from: u32,
        live: u32,
    },
}

#[derive(Debug, Default)]
struct SeqCache {
    /// Block table.
    blocks: Vec<u32>,
    /// Matched blocks pinned to keep the chain alive while this sequence recomputes them.
    keepalive: Vec<u32>,
    live_slot: u32,
    /// Leading blocks (prompt, then output) already offered to the index.
    committed: usize,
    /// The rolling snapshot slot of a decoding hybrid sequence.
    rolling: Option<Rolling>,
    /// Draft slots lent to this speculating hybrid sequence (see [`CacheManager::draft_slots`]).
    drafts: Vec<u32>,
}

/// A sequence's rolling snapshot: one durable slot, overwritten at each block boundary the
/// sequence completes while decoding.
#[derive(Debug, Clone, Copy)]
struct Rolling {
    slot: u32,
    /// The block whose end state the slot holds (set once the step that wrote it succeeded).
    holds: Option<BlockHash>,
    /// The block whose end state this step writes.
    writing: Option<BlockHash>,
}

#[derive(Debug, Clone, Copy)]
struct PendingSnapshot {
    seq: u32,
    hash: BlockHash,
    slot: u32,
    /// The step that writes it (two steps can be pending: one computing, the next scheduled).
    step: u64,
}

pub struct CacheManager {
    pool: BlockPool,
    ssm: SsmPool,
    hybrid: bool,
    prefix_caching: bool,
    block_size: usize,
    step: u64,
    seqs: Vec<Option<SeqCache>>,
    pending: Vec<PendingSnapshot>,
    removed_scratch: Vec<(u32, BlockHash)>,
    /// Blocks indexed this step with their parent's short hash, and their tokens
    /// (`block_size` per block, in the same order).
    stored: Vec<(BlockHash, Option<u64>)>,
    stored_tokens: Vec<u32>,
    snapshot_only: Vec<BlockHash>,
    removed: Vec<u64>,
    snapshot_removed: Vec<u64>,
    events: Vec<KvEvent>,
    /// Sequences whose rolling slot a pending step writes, with that step.
    rolling_pending: Vec<(u32, u64)>,
    memory: MissMemory,
    /// Hybrids: prompt snapshots every this many blocks as well (0: off).
    snapshot_every: usize,
    /// The latest reclaim that found nothing to give up: what it read and its newcomer
    /// class (see [`Self::reclaim_snapshot`]).
    no_victim: Option<(VictimInputs, u8)>,
    /// Blocks whose snapshots waiting requests will resume from (sorted; see
    /// [`Self::set_wanted`]).
    wanted: Vec<u32>,
    pub counters: CacheCounters,
}

/// Everything [`SsmPool::victim`]'s answer depends on besides the blocks' last access steps
/// (which only order the candidates): the step (restores of this step are kept), the
/// snapshots and their proven marks, and the users of their blocks (indexed blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct VictimInputs {
    step: u64,
    snapshot_changes: u64,
    indexed_ref_changes: u64,
}

impl CacheManager {
    pub fn new(
        layout: &CacheLayout,
        prefix_caching: bool,
        hybrid: bool,
        evictor: Option<Box<dyn Evictor>>,
    ) -> Self {
        Self {
            pool: BlockPool::new(layout.num_blocks as u32, evictor),
            ssm: SsmPool::new(layout.live_slots as u32, layout.durable_slots as u32),
            hybrid,
            prefix_caching,
            block_size: layout.block_size,
            step: 0,
            seqs: Vec::new(),
            pending: Vec::new(),
            removed_scratch: Vec::new(),
            stored: Vec::new(),
            stored_tokens: Vec::new(),
            snapshot_only: Vec::new(),
            removed: Vec::new(),
            snapshot_removed: Vec::new(),
            events: Vec::new(),
            rolling_pending: Vec::new(),
            memory: MissMemory::new(4 * layout.num_blocks.max(16)),
            snapshot_every: 0,
            no_victim: None,
            wanted: Vec::new(),
            counters: CacheCounters::default(),
        }
    }

    /// Also plans a prompt snapshot at every `blocks`-th block boundary (`cache.
    /// ssm_snapshot_interval` in blocks; 0 leaves only the fixed points and checkpoints).
    pub fn with_snapshot_interval(mut self, blocks: usize) -> Self {
        self.snapshot_every = blocks;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn is_hybrid(&self) -> bool {
        self.hybrid
    }
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }
    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }
    /// Blocks an allocation can obtain (free plus evictable cached).
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    pub fn ssm(&self) -> &SsmPool {
        &self.ssm
    }

    pub fn begin_step(&mut self, step: u64) {
        self.step = step;
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Is this hash already in the index?
    pub fn is_cached(&self, hash: BlockHash) -> bool {
        self.pool.lookup(hash).is_some()
    }

    /// The usable cached prefix of a prompt with these full-block `hashes`.
    pub fn match_prefix(&self, hashes: &[BlockHash], prompt_len: usize) -> PrefixMatch {
        if !self.prefix_caching {
            return PrefixMatch::default();
        }
        let kv = self.pool.match_len(hashes);
        let bs = self.block_size;
        let mut skip = kv;
        while skip > 0 {
            let leaves_two = prompt_len >= skip * bs + 2;
            let restorable = !self.hybrid || self.snapshot_at(hashes[skip - 1]).is_some();
            if leaves_two && restorable {
                break;
            }
            skip -= 1;
        }
        PrefixMatch {
            kv_blocks: kv,
            skip_blocks: skip,
        }
    }

    /// Whether taking a snapshot now means giving one up: a hybrid caching prefixes with every
    /// durable slot taken.
    pub fn snapshot_slots_full(&self) -> bool {
        self.hybrid && self.prefix_caching && self.ssm.durable_used() >= self.ssm.durable_total()
    }

    /// The block whose snapshot a prompt would resume from if admitted now (`None`: nothing
    /// to skip, or not a hybrid).
    pub fn resume_block(&self, hashes: &[BlockHash], prompt_len: usize) -> Option<u32> {
        if !self.hybrid {
            return None;
        }
        let m = self.match_prefix(hashes, prompt_len);
        let last = m.skip_blocks.checked_sub(1)?;
        self.pool.lookup(hashes[last])
    }

    /// The blocks whose snapshots waiting requests will resume from: until the next call,
    /// those snapshots are given up for a new one only as one a running request uses would be
    /// (a request that arrived on a cached prefix keeps it while it waits for admission). The
    /// scheduler sets them at each step while the slots are full.
    pub fn set_wanted(&mut self, mut blocks: Vec<u32>) {
        blocks.sort_unstable();
        blocks.dedup();
        if blocks != self.wanted {
            self.wanted = blocks;
            self.no_victim = None;
        }
    }

    /// The largest number of leading blocks of a `prompt_len`-token prompt the cache could
    /// ever serve (a skip leaves at least two prompt tokens to compute).
    pub fn cacheable_blocks(&self, prompt_len: usize) -> usize {
        prompt_len.saturating_sub(2) / self.block_size
    }

    /// Why `m` serves fewer blocks than the prompt's cacheable prefix (`None`: it serves them
    /// all). `prompt_logprobs`: the request asked for them, so nothing was skipped. Reasons are
    /// checked in the order of [`MissReason`]'s variants; the first that applies is reported.
    pub fn miss_reason(
        &self,
        hashes: &[BlockHash],
        prompt_len: usize,
        m: PrefixMatch,
        prompt_logprobs: bool,
    ) -> Option<MissReason> {
        let cacheable = self.cacheable_blocks(prompt_len).min(hashes.len());
        if !self.prefix_caching {
            return Some(MissReason::CachingOff);
        }
        if prompt_logprobs {
            return Some(MissReason::PromptLogprobs);
        }
        if cacheable == 0 {
            return Some(MissReason::PromptTooShort);
        }
        if m.skip_blocks >= cacheable {
            return None;
        }
        if m.kv_blocks > m.skip_blocks {
            // KV reaches further than the skip: no boundary past the skip has a snapshot. Any
            // of them given up or skipped for want of a slot is what pressure cost (a turn's
            // prompt-end snapshot reclaimed while its answer's blocks, which never had one,
            // stay cached is the common case).
            let past_skip = &hashes[m.skip_blocks..m.kv_blocks.min(cacheable)];
            let no_slots = self.ssm.durable_total() == 0;
            let lost = past_skip.iter().any(|&h| self.memory.lost_snapshot(h));
            return Some(if no_slots || lost {
                MissReason::SnapshotBudgetFull
            } else {
                MissReason::NoSnapshot
            });
        }
        if self.memory.was_evicted(hashes[m.kv_blocks]) {
            return Some(MissReason::Evicted);
        }
        // The next block was never cached. With nothing of the prompt cached that is a cold
        // prompt: a miss. After a served prefix it is where the prompt says something new (a
        // follow-up's new message, a divergence from a shared prefix): the cache served all
        // it ever held of this prompt, which is no miss.
        (m.kv_blocks == 0).then_some(MissReason::NoKvMatch)
    }

    /// Counts one admission's prefix-cache lookup in tokens, as vLLM does: the whole prompt was
    /// queried, `cached_tokens` of it were served from the cache.
    pub fn count_prefix_query(&mut self, prompt_tokens: usize, cached_tokens: usize) {
        self.counters.prefix_queries += prompt_tokens as u64;
        self.counters.prefix_hits += cached_tokens as u64;
    }

    /// Counts one admission's outcome in [`CacheCounters::misses`].
    pub fn count_miss(&mut self, reason: Option<MissReason>) {
        if let Some(r) = reason {
            self.counters.misses[r.index()] += 1;
        }
    }

    fn snapshot_at(&self, hash: BlockHash) -> Option<u32> {
        self.pool.lookup(hash).and_then(|b| self.ssm.snapshot_of(b))
    }

    fn matched_blocks(&self, hashes: &[BlockHash], n: usize) -> Vec<u32> {
        hashes[..n]
            .iter()
            .filter_map(|&h| self.pool.lookup(h))
            .collect()
    }

    /// Gives sequence slot `seq` its blocks: the matched prefix (pinned first), then fresh
    /// blocks covering `cover_tokens`, and a live SSM slot. All or nothing: with too few
    /// free blocks (counting the matched ones it would take out of the evictable set) it
    /// changes nothing and answers [`CacheError::NoSpace`], the request to wait.
    pub fn admit(
        &mut self,
        seq: u32,
        hashes: &[BlockHash],
        m: PrefixMatch,
        cover_tokens: usize,
    ) -> Result<SsmInit, CacheError> {
        let matched = self.matched_blocks(hashes, m.kv_blocks);
        if matched.len() != m.kv_blocks || m.skip_blocks > m.kv_blocks {
            return Err(CacheError::StaleMatch {
                matched: m.kv_blocks,
                found: matched.len(),
            });
        }
        let new = self.blocks_for(cover_tokens).saturating_sub(m.skip_blocks);
        if self.pool.available() - self.pool.count_unused(&matched) < new {
            return Err(CacheError::NoSpace);
        }
        let init = if self.hybrid {
            let restore = match m.skip_blocks {
                0 => None,
                k => Some(
                    self.ssm
                        .snapshot_of(matched[k - 1])
                        .ok_or(CacheError::RestoreMissing(matched[k - 1]))?,
                ),
            };
            let live = self.ssm.alloc_live().ok_or(CacheError::NoLiveSlot)?;
            match restore {
                Some(from) => {
                    self.ssm.note_restore(matched[m.skip_blocks - 1], self.step);
                    SsmInit::Restore { from, live }
                }
                None => SsmInit::Zero { live },
            }
        } else {
            SsmInit::None
        };
        for &b in &matched {
            self.pool.pin(b, self.step)?;
        }
        let mut blocks = matched;
        let keepalive = blocks.split_off(m.skip_blocks);
        self.pool.allocate(new, self.step, &mut blocks)?;
        self.after_pool_change(true);
        let live_slot = match init {
            SsmInit::Zero { live } | SsmInit::Restore { live, .. } => live,
            SsmInit::None => 0,
        };
        let sc = SeqCache {
            blocks,
            keepalive,
            live_slot,
            committed: m.skip_blocks,
            rolling: None,
            drafts: Vec::new(),
        };
        if self.seqs.len() <= seq as usize {
            self.seqs.resize_with(seq as usize + 1, || None);
        }
        self.seqs[seq as usize] = Some(sc);
        if matches!(init, SsmInit::Restore { .. }) {
            self.counters.ssm_restores += 1;
        }
        Ok(init)
    }

    /// New blocks sequence `seq` needs to hold `tokens` tokens.
    pub fn blocks_to_grow(&self, seq: u32, tokens: usize) -> usize {
        let have = self.seq(seq).map_or(0, |s| s.blocks.len());
        self.blocks_for(tokens).saturating_sub(have)
    }

    /// Extends sequence `seq` to hold `tokens` tokens.
    pub fn grow(&mut self, seq: u32, tokens: usize) -> Result<(), CacheError> {
        let need = self.blocks_to_grow(seq, tokens);
        if need == 0 {
            return Ok(());
        }
        if need > self.pool.available() {
            return Err(CacheError::NoSpace);
        }
        let step = self.step;
        let s = self
            .seqs
            .get_mut(seq as usize)
            .and_then(Option::as_mut)
            .ok_or(CacheError::UnknownSeq(seq))?;
        self.pool.allocate(need, step, &mut s.blocks)?;
        self.after_pool_change(true);
        Ok(())
    }

    /// Releases every block and slot of sequence `seq` (finish, cancel, preemption).
    pub fn release(&mut self, seq: u32) -> Result<(), CacheError> {
        let s = self
            .seqs
            .get_mut(seq as usize)
            .and_then(Option::take)
            .ok_or(CacheError::UnknownSeq(seq))?;
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].seq == seq {
                let p = self.pending.swap_remove(i);
                self.ssm.unreserve(p.slot);
            } else {
                i += 1;
            }
        }
        self.rolling_pending.retain(|&(q, _)| q != seq);
        self.pool.release(&s.blocks, self.step)?;
        self.pool.release(&s.keepalive, self.step)?;
        if self.hybrid {
            self.ssm.free_live(s.live_slot);
            self.ssm.free_drafts(&s.drafts);
        }
        if let Some(r) = s.rolling {
            self.keep_rolling(r);
        }
        Ok(())
    }

    /// A released sequence's rolling slot becomes the durable snapshot of the block it holds,
    /// when that block is still indexed and has no snapshot yet; otherwise the slot is freed.
    fn keep_rolling(&mut self, r: Rolling) {
        let block = r.holds.and_then(|h| self.pool.lookup(h).map(|b| (b, h)));
        match block {
            Some((b, h)) if self.ssm.attach(b, r.slot) => {
                self.pool.note_snapshot(b, true, self.step);
                self.memory.snapshot_taken(h);
                self.counters.rolling_kept += 1;
                self.snapshot_only.push(h);
            }
            // `attach` freed the slot: the block already had a snapshot.
            Some(_) => {}
            None => self.ssm.unreserve(r.slot),
        }
    }

    /// Sets `n` live slots aside as draft slots (before any admission); returns how many.
    pub fn set_draft_slots(&mut self, n: usize) -> usize {
        if !self.hybrid {
            return 0;
        }
        self.ssm.carve_drafts(n as u32) as usize
    }

    /// `k` draft slots of hybrid sequence `seq`, lent on first use and kept until it is
    /// released: slot `j` receives the recurrent state after `j + 1` tokens of its verify
    /// chunk. `None` when none can be lent now (the sequence then decodes without drafts);
    /// `Some(&[])` on a model without recurrent layers.
    pub fn draft_slots(&mut self, seq: u32, k: usize) -> Option<&[u32]> {
        let hybrid = self.hybrid;
        let s = self.seqs.get_mut(seq as usize).and_then(Option::as_mut)?;
        if !hybrid {
            return Some(&[]);
        }
        if s.drafts.len() < k {
            let need = k - s.drafts.len();
            if !self.ssm.alloc_drafts(need, &mut s.drafts) {
                return None;
            }
        }
        Some(&s.drafts[..k])
    }

    /// Rolls hybrid sequence `seq` back to the state after `j + 1` tokens of the verify chunk
    /// just applied, without copying a state: draft slot `j` (which that step wrote) becomes the
    /// live slot, and the old live slot (past the last accepted token) takes its place among the
    /// draft slots, to be written again by the next verify step. True, changing nothing, on a
    /// model without recurrent layers (nothing to roll back); false, changing nothing, when
    /// `seq` is unknown or has no draft slot `j`.
    pub fn adopt_draft(&mut self, seq: u32, j: usize) -> bool {
        let hybrid = self.hybrid;
        let Some(s) = self.seqs.get_mut(seq as usize).and_then(Option::as_mut) else {
            return false;
        };
        if !hybrid {
            return true;
        }
        let Some(d) = s.drafts.get_mut(j) else {
            return false;
        };
        std::mem::swap(d, &mut s.live_slot);
        true
    }

    /// Draft slot `j` of sequence `seq`, if it has one.
    pub fn draft_slot(&self, seq: u32, j: usize) -> Option<u32> {
        self.seq(seq).and_then(|s| s.drafts.get(j).copied())
    }

    /// Releases the blocks of sequence `seq` past those holding its first `tokens` tokens
    /// (rejected draft positions). Blocks already offered to the index are kept.
    pub fn shrink(&mut self, seq: u32, tokens: usize) -> Result<(), CacheError> {
        let keep = self.blocks_for(tokens);
        let step = self.step;
        let s = self
            .seqs
            .get_mut(seq as usize)
            .and_then(Option::as_mut)
            .ok_or(CacheError::UnknownSeq(seq))?;
        let keep = keep.max(s.committed);
        if s.blocks.len() <= keep {
            return Ok(());
        }
        let tail = s.blocks.split_off(keep);
        self.pool.release(&tail, step)?;
        self.after_pool_change(false);
        Ok(())
    }

    fn seq(&self, seq: u32) -> Option<&SeqCache> {
        self.seqs.get(seq as usize).and_then(Option::as_ref)
    }

    pub fn block_table(&self, seq: u32) -> &[u32] {
        self.seq(seq).map_or(&[], |s| &s.blocks)
    }

    pub fn live_slot(&self, seq: u32) -> u32 {
        self.seq(seq).map_or(0, |s| s.live_slot)
    }

    /// Plans SSM snapshots inside the chunk `ctx .. ctx + len` of a hybrid prompt: at the end
    /// of the cached prefix (`kv_blocks`), at the last block boundary of the prompt, at the
    /// one before it, at every `snapshot_every`-th block boundary, and at the block boundary
    /// at or before each client `checkpoints` offset (prompt tokens), wherever no snapshot
    /// exists yet. When every durable slot is taken, the
    /// snapshot [`SsmPool::victim`] picks gives its slot up; when none can, the
    /// snapshot is skipped and counted (serving goes on without it). `out` is in chunk order.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_snapshots(
        &mut self,
        seq: u32,
        hashes: &[BlockHash],
        prompt_len: usize,
        kv_blocks: usize,
        checkpoints: &[u32],
        ctx: usize,
        len: usize,
        out: &mut Vec<SsmSnapshot>,
    ) {
        if !self.hybrid || !self.prefix_caching || self.ssm.durable_total() == 0 {
            return;
        }
        let bs = self.block_size;
        let last = prompt_len / bs;
        let fixed = [kv_blocks, last.saturating_sub(1), last];
        let every = self.snapshot_every;
        let first_in_chunk = (ctx / bs) + 1;
        let periodic = (first_in_chunk..=last.min((ctx + len) / bs))
            .filter(move |b| every > 0 && b % every == 0);
        let asked = checkpoints.iter().map(|&o| o as usize / bs);
        let points = fixed
            .into_iter()
            .chain(periodic)
            .map(|b| (b, false))
            .chain(asked.map(|b| (b, true)));
        for (blocks, checkpoint) in points {
            let p = blocks * bs;
            if blocks == 0 || p <= ctx || p > ctx + len || blocks > hashes.len() {
                continue;
            }
            let hash = hashes[blocks - 1];
            if self.snapshot_at(hash).is_some() || self.pending.iter().any(|q| q.hash == hash) {
                continue;
            }
            // A boundary that other running sequences share (the end of a matched prefix)
            // may take the slot of a snapshot one running sequence uses; any other only the
            // slot of one nobody uses (see `SsmPool::victim`).
            let shared = self
                .pool
                .lookup(hash)
                .is_some_and(|b| self.pool.refs(b) >= 2);
            let newcomer = if shared { 1 } else { 0 };
            let reserved = match self.ssm.reserve() {
                Some(slot) => Some(slot),
                None if self.reclaim_snapshot(newcomer) => self.ssm.reserve(),
                None => None,
            };
            let Some(slot) = reserved else {
                self.counters.snapshots_skipped += 1;
                self.counters.checkpoints_skipped += u64::from(checkpoint);
                self.memory.snapshot_lost(hash);
                continue;
            };
            self.counters.snapshot_copies += 1;
            self.counters.checkpoint_copies += u64::from(checkpoint);
            self.pending.push(PendingSnapshot {
                seq,
                hash,
                slot,
                step: self.step,
            });
            out.push(SsmSnapshot {
                after: p - ctx,
                slot,
            });
        }
        out.sort_unstable_by_key(|t| t.after);
    }

    /// After a successful step: offers the blocks that sequence `seq` completed (its first
    /// `computed` tokens, of `tokens`, are now in the cache) to the index.
    pub fn commit_seq(&mut self, seq: u32, hashes: &[BlockHash], tokens: &[u32], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let full = (computed / bs).min(hashes.len()).min(tokens.len() / bs);
        let step = self.step;
        let Some(s) = self.seqs.get_mut(seq as usize).and_then(Option::as_mut) else {
            return;
        };
        while s.committed < full {
            let j = s.committed;
            let parent = match j {
                0 => NO_PARENT,
                _ => match self.pool.lookup_likely(hashes[j - 1], s.blocks[j - 1]) {
                    Some(p) => p,
                    None => break,
                },
            };
            if self.pool.register(s.blocks[j], hashes[j], parent, step) {
                let parent = j.checked_sub(1).map(|p| hashes[p].short());
                self.stored.push((hashes[j], parent));
                self.stored_tokens
                    .extend_from_slice(&tokens[j * bs..(j + 1) * bs]);
                self.memory.indexed(hashes[j]);
            }
            s.committed += 1;
        }
    }

    /// Gives up one durable snapshot (its block's KV stays cached) for a new one of class
    /// `newcomer`, in [`SsmPool::victim`]'s order: unproven snapshots of unused blocks first
    /// (least recently accessed first), then of blocks one running sequence uses, then of
    /// shared ones, then proven ones; never one of a higher class than the newcomer's. A
    /// snapshot restored in this step is kept (its copy runs in the step). False when nothing
    /// can be given up.
    ///
    /// When every slot is taken by snapshots no newcomer may displace (a decoding batch whose
    /// rolling snapshots find only snapshots of blocks in use), each block a sequence completes
    /// asks again; the search reads every snapshot, so a failed one is remembered with what it
    /// read and not repeated until one of those changes (the same answer, found once a step).
    fn reclaim_snapshot(&mut self, newcomer: u8) -> bool {
        let inputs = VictimInputs {
            step: self.step,
            snapshot_changes: self.ssm.changes(),
            indexed_ref_changes: self.pool.indexed_ref_changes(),
        };
        // No candidate of class ≤ `failed` means none of a class ≤ `newcomer` either.
        if self
            .no_victim
            .is_some_and(|(seen, failed)| seen == inputs && newcomer <= failed)
        {
            return false;
        }
        self.counters.reclaim_searches += 1;
        let (pool, wanted) = (&self.pool, &self.wanted);
        // A snapshot a waiting request will resume from counts as one a running request uses.
        let info = |b| {
            let waiting = u32::from(wanted.binary_search(&b).is_ok());
            (pool.refs(b) + waiting, pool.last_access(b))
        };
        let Some(b) = self.ssm.victim(self.step, newcomer, info) else {
            self.no_victim = Some((inputs, newcomer));
            return false;
        };
        self.ssm.drop_block(b);
        self.pool.note_snapshot(b, false, self.step);
        if let Some(h) = self.pool.hash_of(b) {
            self.snapshot_removed.push(h.short());
            self.memory.snapshot_lost(h);
        }
        self.counters.snapshots_dropped += 1;
        true
    }

    /// After a successful step (once every sequence was committed): attaches the snapshots
    /// taken during the step to their blocks. Commits every pending step; with a second step
    /// scheduled while one computes, see [`Self::commit_step_of`].
    pub fn commit_step(&mut self) {
        self.commit_step_of(u64::MAX);
    }

    /// [`Self::commit_step`] for step `step` alone (and any earlier one still pending): the
    /// snapshots and rolling slots of a step scheduled after it stay pending.
    pub fn commit_step_of(&mut self, step: u64) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].step > step {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            match self.pool.lookup(p.hash) {
                Some(b) if self.ssm.attach(b, p.slot) => {
                    self.pool.note_snapshot(b, true, self.step);
                    self.memory.snapshot_taken(p.hash);
                    self.counters.snapshots_taken += 1;
                    if !self.stored.iter().any(|&(h, _)| h == p.hash) {
                        self.snapshot_only.push(p.hash);
                    }
                }
                Some(_) => {}
                None => self.ssm.unreserve(p.slot),
            }
        }
        let mut i = 0;
        while i < self.rolling_pending.len() {
            let (seq, at) = self.rolling_pending[i];
            if at > step {
                i += 1;
                continue;
            }
            self.rolling_pending.swap_remove(i);
            if let Some(r) = self.rolling_mut(seq) {
                r.holds = r.writing.take();
            }
        }
        self.finish_events();
    }

    /// After a failed step: frees the snapshot reservations (nothing was indexed); rolling
    /// slots written by the step hold nothing usable. Aborts every pending step; see
    /// [`Self::abort_step_of`].
    pub fn abort_step(&mut self) {
        self.abort_step_of(0);
    }

    /// [`Self::abort_step`] for the steps from `step` on (a failed step and the one scheduled
    /// after it, which will not run as planned); earlier pending steps stay pending.
    pub fn abort_step_of(&mut self, step: u64) {
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].step < step {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            self.ssm.unreserve(p.slot);
        }
        let mut i = 0;
        while i < self.rolling_pending.len() {
            let (seq, at) = self.rolling_pending[i];
            if at < step {
                i += 1;
                continue;
            }
            self.rolling_pending.swap_remove(i);
            if let Some(r) = self.rolling_mut(seq) {
                r.holds = None;
                r.writing = None;
            }
        }
        self.finish_events();
    }

    fn rolling_mut(&mut self, seq: u32) -> Option<&mut Rolling> {
        self.seqs
            .get_mut(seq as usize)
            .and_then(Option::as_mut)
            .and_then(|s| s.rolling.as_mut())
    }

    /// Plans the rolling snapshot of decoding sequence `seq` whose chunk (`len` tokens from
    /// `ctx`) completes block `hash` after `after` tokens. The sequence's rolling slot is
    /// reused; a sequence without one reserves a durable slot (giving up the least recently
    /// used unused snapshot when none is free), and when none can be had the snapshot is
    /// skipped and counted. Nothing is planned where the block already has a snapshot.
    ///
    /// `hash` is `None` when the block's last token is still being sampled by the step before
    /// (a step scheduled while that one computes): the slot is planned all the same and
    /// [`Self::set_rolling_hash`] names the block once the token is known, before this step
    /// commits. A sequence whose rolling slot an earlier pending step writes is skipped.
    pub fn plan_rolling_snapshot(
        &mut self,
        seq: u32,
        hash: Option<BlockHash>,
        after: usize,
        out: &mut Vec<SsmSnapshot>,
    ) {
        if !self.hybrid || !self.prefix_caching || self.ssm.durable_total() == 0 {
            return;
        }
        if hash.is_some_and(|h| self.snapshot_at(h).is_some()) || self.seq(seq).is_none() {
            return;
        }
        if self.rolling_pending.iter().any(|&(q, _)| q == seq) {
            self.counters.rolling_skipped += 1;
            if let Some(h) = hash {
                self.memory.snapshot_lost(h);
            }
            return;
        }
        let slot = match self.seq(seq).and_then(|s| s.rolling) {
            Some(r) => r.slot,
            None => {
                let newcomer = 0;
                let reserved = match self.ssm.reserve() {
                    Some(slot) => Some(slot),
                    None if self.reclaim_snapshot(newcomer) => self.ssm.reserve(),
                    None => None,
                };
                let Some(slot) = reserved else {
                    self.counters.rolling_skipped += 1;
                    if let Some(h) = hash {
                        self.memory.snapshot_lost(h);
                    }
                    return;
                };
                slot
            }
        };
        if let Some(s) = self.seqs.get_mut(seq as usize).and_then(Option::as_mut) {
            // The slot is overwritten this step: until it succeeds it holds nothing usable.
            s.rolling = Some(Rolling {
                slot,
                holds: None,
                writing: hash,
            });
        }
        self.rolling_pending.push((seq, self.step));
        self.counters.rolling_copies += 1;
        out.push(SsmSnapshot { after, slot });
    }

    /// Names the block whose end state a pending rolling snapshot of `seq` writes (planned
    /// with no hash by [`Self::plan_rolling_snapshot`]).
    pub fn set_rolling_hash(&mut self, seq: u32, hash: BlockHash) {
        if !self.rolling_pending.iter().any(|&(q, _)| q == seq) {
            return;
        }
        if let Some(r) = self.rolling_mut(seq)
            && r.writing.is_none()
        {
            r.writing = Some(hash);
        }
    }

    fn finish_events(&mut self) {
        if !self.removed.is_empty() {
            self.events.push(KvEvent::Removed {
                hashes: std::mem::take(&mut self.removed),
            });
        }
        if !self.snapshot_removed.is_empty() {
            let hashes = std::mem::take(&mut self.snapshot_removed);
            self.events.push(KvEvent::SnapshotRemoved { hashes });
        }
        if !self.stored.is_empty() {
            let (pool, ssm) = (&self.pool, &self.ssm);
            let blocks = self
                .stored
                .drain(..)
                .map(|(h, parent)| StoredBlock {
                    hash: h.short(),
                    parent,
                    snapshot: pool.lookup(h).and_then(|b| ssm.snapshot_of(b)).is_some(),
                })
                .collect();
            // The next step stores about as many: start its buffer at this one's size.
            let next = Vec::with_capacity(self.stored_tokens.len());
            let tokens = std::mem::replace(&mut self.stored_tokens, next);
            self.events.push(KvEvent::Stored { blocks, tokens });
        }
        if !self.snapshot_only.is_empty() {
            let hashes = self.snapshot_only.drain(..).map(|h| h.short()).collect();
            self.events.push(KvEvent::SnapshotStored { hashes });
        }
    }

    /// Hands the block events since the last hand-over to the eviction policy. The pool also
    /// does so before it asks the policy for victims, so the policy's view is current whenever
    /// it decides; the engine calls this while the device computes a step, and when idle.
    pub fn flush_evictor_events(&mut self) {
        self.pool.flush_events();
    }

    /// Drops every cached block and snapshot; running sequences keep their blocks (which are
    /// no longer indexed). Unpublished events are superseded by `Cleared`.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.clear_index(self.step);
        self.after_pool_change(false);
        self.memory.clear();
        self.removed.clear();
        self.snapshot_removed.clear();
        self.stored.clear();
        self.stored_tokens.clear();
        self.snapshot_only.clear();
        self.events.clear();
        self.events.push(KvEvent::Cleared);
        for s in self.seqs.iter_mut().flatten() {
            s.committed = usize::MAX;
        }
        self.pool.flush_events();
    }

    /// Events of the steps committed since the last call, oldest first.
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// Drops what hangs off blocks the pool unhashed (`evicted` to make room, or cleared).
    fn after_pool_change(&mut self, evicted: bool) {
        self.pool.take_removed(&mut self.removed_scratch);
        for (b, h) in self.removed_scratch.drain(..) {
            // The evictor learns from the block's `Removed` event that its snapshot is gone.
            if self.ssm.drop_block(b) {
                self.counters.snapshots_dropped += 1;
            }
            if evicted {
                self.memory.evicted(h);
            }
            self.removed.push(h.short());
        }
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let durable = self.ssm.durable_used() as usize;
        let rolling = self
            .seqs
            .iter()
            .flatten()
            .filter(|s| s.rolling.is_some())
            .count();
        if durable != self.ssm.snapshots() + self.pending.len() + rolling {
            return Err(format!(
                "durable slots used {durable} != snapshots {} + pending {} + rolling {rolling}",
                self.ssm.snapshots(),
                self.pending.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "manager_tests.rs"]
mod tests;
