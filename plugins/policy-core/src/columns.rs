//! Borrowed column views of each policy call's input, mirroring the WIT records field by field.
//!
//! The host builds these from its own column structs, the guest glue builds them from the
//! lists it received; the algorithms only ever see views. A view never owns data and never
//! assumes its columns agree in length: `is_consistent` says whether they do, and callers
//! treat an inconsistent view as "no answer".

/// Event kinds on the wire (`u8`), the same numbering as the host's `policy::EventKind`.
pub mod event_kind {
    pub const STORED: u8 = 0;
    pub const HIT: u8 = 1;
    pub const RELEASED: u8 = 2;
    pub const REMOVED: u8 = 3;
    pub const SNAPSHOT_STORED: u8 = 4;
    pub const SNAPSHOT_REMOVED: u8 = 5;
}

/// Parent id of a root block in `Stored` events.
pub const NO_PARENT: u32 = u32::MAX;

/// The request being routed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteRequestView<'a> {
    pub prompt_tokens: u32,
    /// Full prompt blocks: the unit of `prefix_hit_blocks`.
    pub prompt_blocks: u32,
    pub tenant: &'a str,
}

/// Per-replica load and cache state, one entry per replica in every column.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplicaView<'a> {
    pub waiting: &'a [u32],
    pub running: &'a [u32],
    pub free_blocks: &'a [u32],
    pub total_blocks: &'a [u32],
    /// Fraction of KV blocks in use, 0..=1.
    pub kv_usage: &'a [f32],
    pub prefix_hit_blocks: &'a [u32],
    pub ssm_hit_blocks: &'a [u32],
}

impl ReplicaView<'_> {
    /// Number of replicas (the length of `waiting`).
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Whether every column has one entry per replica.
    pub fn is_consistent(&self) -> bool {
        let n = self.len();
        self.running.len() == n
            && self.free_blocks.len() == n
            && self.total_blocks.len() == n
            && self.kv_usage.len() == n
            && self.prefix_hit_blocks.len() == n
            && self.ssm_hit_blocks.len() == n
    }
}

/// Cache events since the last call, in order.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventsView<'a> {
    pub kinds: &'a [u8],
    pub blocks: &'a [u32],
    /// Parent block for `Stored` ([`NO_PARENT`] for a root block).
    pub parents: &'a [u32],
    pub steps: &'a [u64],
}

impl EventsView<'_> {
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    pub fn is_consistent(&self) -> bool {
        let n = self.len();
        self.blocks.len() == n && self.parents.len() == n && self.steps.len() == n
    }
}

/// One step's sampling problem: per-request parameters and `k` candidates per request.
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplerBatchView<'a> {
    pub k: u32,
    pub temperature: &'a [f32],
    pub top_k: &'a [u32],
    pub top_p: &'a [f32],
    pub min_p: &'a [f32],
    pub seed: &'a [u64],
    pub counter: &'a [u64],
    /// `n × k` candidate token ids, best first.
    pub cand_tokens: &'a [u32],
    /// `n × k` candidate logits after penalties, before temperature, best first.
    pub cand_logits: &'a [f32],
}

impl SamplerBatchView<'_> {
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.temperature.len()
    }

    pub fn is_empty(&self) -> bool {
        self.temperature.is_empty()
    }

    /// Whether the columns agree: one parameter per request, `k ≥ 1` candidates per request.
    pub fn is_consistent(&self) -> bool {
        let n = self.len();
        let Some(cands) = n.checked_mul(self.k as usize) else {
            return false;
        };
        (n == 0 || self.k >= 1)
            && self.top_k.len() == n
            && self.top_p.len() == n
            && self.min_p.len() == n
            && self.seed.len() == n
            && self.counter.len() == n
            && self.cand_tokens.len() == cands
            && self.cand_logits.len() == cands
    }

    /// Candidate tokens of request `i` (empty when out of range).
    pub fn tokens_of(&self, i: usize) -> &[u32] {
        let k = self.k as usize;
        self.cand_tokens.get(i * k..(i + 1) * k).unwrap_or(&[])
    }

    /// Candidate logits of request `i` (empty when out of range).
    pub fn logits_of(&self, i: usize) -> &[f32] {
        let k = self.k as usize;
        self.cand_logits.get(i * k..(i + 1) * k).unwrap_or(&[])
    }
}
