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

/// The model's vocabulary as a constraint plugin receives it (ABI 0.2.0).
#[derive(Debug, Clone, Copy, Default)]
pub struct VocabularyView<'a> {
    /// Token `i`'s bytes are `bytes[ends[i - 1]..ends[i]]` (from 0 for token 0).
    pub bytes: &'a [u8],
    pub ends: &'a [u32],
    /// 1 where token `i` is a special (control) token.
    pub special: &'a [u8],
    pub eos: u32,
}

impl<'a> VocabularyView<'a> {
    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Whether the columns agree: one `special` flag per token, offsets in order and inside
    /// `bytes`, `eos` a token.
    pub fn is_consistent(&self) -> bool {
        self.special.len() == self.ends.len()
            && self.ends.windows(2).all(|w| w[0] <= w[1])
            && self
                .ends
                .last()
                .is_none_or(|&e| e as usize == self.bytes.len())
            && (self.eos as usize) < self.ends.len()
    }

    /// Token `i`'s bytes (empty for an id outside the vocabulary).
    pub fn token(&self, i: usize) -> &'a [u8] {
        let Some(&end) = self.ends.get(i) else {
            return &[];
        };
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.bytes.get(start as usize..end as usize).unwrap_or(&[])
    }
}

/// What a parser plugin is asked to parse one response for (ABI 0.2.0).
#[derive(Debug, Clone, Copy, Default)]
pub struct ParseRequestView<'a> {
    /// Tool-call format (`hermes`, `qwen3_coder`, ...); empty without tools.
    pub tool_format: &'a str,
    /// Reasoning format (`qwen3`, `deepseek_r1`); empty for none.
    pub reasoning_format: &'a str,
    /// The prompt already opened the reasoning section.
    pub reasoning_open: bool,
    /// The request's `tools`, OpenAI's JSON; empty for none.
    pub tools: &'a str,
}

/// Kinds of [`Parsed::kinds`] on the wire.
pub mod parsed_kind {
    pub const CONTENT: u8 = 0;
    pub const REASONING: u8 = 1;
    pub const CALL_BEGIN: u8 = 2;
    pub const CALL_ARGUMENTS: u8 = 3;
    pub const FAILURE: u8 = 4;
}

/// What a parser made of some text: pieces in order, as columns (ABI 0.2.0 `parsed`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub kinds: alloc::vec::Vec<u8>,
    /// The tool call's index in the response for kinds 2 and 3, else 0.
    pub calls: alloc::vec::Vec<u32>,
    pub texts: alloc::vec::Vec<alloc::string::String>,
}

impl Parsed {
    fn push(&mut self, kind: u8, call: u32, text: &str) {
        // Adjacent text of one kind (and call) is one piece.
        if matches!(
            kind,
            parsed_kind::CONTENT | parsed_kind::REASONING | parsed_kind::CALL_ARGUMENTS
        ) && self.kinds.last() == Some(&kind)
            && self.calls.last() == Some(&call)
        {
            if let Some(last) = self.texts.last_mut() {
                last.push_str(text);
            }
            return;
        }
        self.kinds.push(kind);
        self.calls.push(call);
        self.texts.push(text.into());
    }

    pub fn content(&mut self, text: &str) {
        if !text.is_empty() {
            self.push(parsed_kind::CONTENT, 0, text);
        }
    }

    pub fn reasoning(&mut self, text: &str) {
        if !text.is_empty() {
            self.push(parsed_kind::REASONING, 0, text);
        }
    }

    pub fn call_begin(&mut self, call: u32, name: &str) {
        self.push(parsed_kind::CALL_BEGIN, call, name);
    }

    pub fn call_arguments(&mut self, call: u32, json: &str) {
        if !json.is_empty() {
            self.push(parsed_kind::CALL_ARGUMENTS, call, json);
        }
    }

    pub fn failure(&mut self, why: &str) {
        self.push(parsed_kind::FAILURE, 0, why);
    }

    /// Appends `later` (pieces merge where they continue).
    pub fn extend(&mut self, later: Parsed) {
        for ((k, c), t) in later.kinds.into_iter().zip(later.calls).zip(later.texts) {
            self.push(k, c, &t);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Whether the columns agree in length and every kind is known.
    pub fn is_consistent(&self) -> bool {
        self.kinds.len() == self.calls.len()
            && self.kinds.len() == self.texts.len()
            && self.kinds.iter().all(|&k| k <= parsed_kind::FAILURE)
    }
}
