//! `Request`: the engine-side state of one generation request.
//!
//! Token bookkeeping: `tokens` is the prompt followed by every generated token. The first
//! `computed` tokens have their K/V in the cache (and, on hybrids, are folded into the live SSM
//! slot). While `computed < prompt_len` the request is prefilling. After a recompute
//! preemption the generated tokens become part of the prompt (`prompt_len = tokens.len()`) and
//! are hashed like prompt tokens, so the re-admitted request can hit its own cached blocks.
//! `orig_prompt_len` never changes and is what usage reports.

use super::api::{EventSender, GenerateRequest, SamplingParams, TokenLogprob};
use crate::cache::{BlockHash, MissReason};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// In the queue, holding no cache state.
    Waiting,
    /// Holding blocks and scheduled every step it fits.
    Running,
    /// Holding blocks but not scheduled: no block was free for its next tokens.
    Paused,
    /// Done (its last event is out) but still held by a step of the pipeline, computed ahead
    /// of the stop: never scheduled again, removed with its cache state once no step holds it.
    Finished,
}

#[derive(Debug)]
pub struct Request {
    pub id: u64,
    /// Slot in the scheduler's table; also the sequence id in the cache manager.
    pub slot: u32,
    pub phase: Phase,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub orig_prompt_len: usize,
    pub computed: usize,
    /// Tokens being sampled by launched steps not yet applied (0 or 1): the next token's
    /// position is `tokens.len()`, its value is not known yet.
    pub in_flight: usize,
    /// Steps in the engine's pipeline (scheduled or launched, not yet applied or dropped)
    /// that hold this request: it leaves the scheduler only once none does.
    pub holds: u32,
    /// The output block that this request's next scheduled decode completes ends on a token
    /// still being sampled: its hash (and its rolling snapshot's) is taken when it arrives.
    pub hash_pending: bool,
    /// Chained hashes of the full blocks of `tokens[..prompt_len]`, then of each output block
    /// from the step that computes it (with prefix caching on).
    pub hashes: Vec<BlockHash>,
    /// Cached KV blocks found at the latest admission (where this prompt leaves the cache).
    pub kv_match: usize,
    /// Prompt tokens skipped thanks to the prefix cache at the first admission.
    pub cached_tokens: usize,
    /// The most prompt tokens the cache could have served (whole blocks, leaving two).
    pub cacheable_tokens: usize,
    /// Why `cached_tokens` fell short of `cacheable_tokens`, from the first admission.
    pub cache_miss: Option<MissReason>,
    /// Prompt offsets where the client asked for an SSM snapshot (rounded down to blocks).
    pub checkpoints: Vec<u32>,
    pub admitted_once: bool,
    /// Lower is admitted first under the priority policy.
    pub priority: i32,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub seed: u64,
    pub preemptions: u32,
    /// Prompt logprobs by position while they are being computed (`Some` only when asked for
    /// and not yet sent).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    /// Top alternatives per prompt logprob.
    pub prompt_top: usize,
    /// Tokens masked out while fewer than `params.min_tokens` are generated: the stop tokens
    /// and, unless `ignore_eos`, the model's EOS (set by the engine, which knows the EOS).
    pub min_ban: Vec<u32>,
    /// The response's matcher in the engine's constraint plugin, if it has a grammar.
    pub constraint: Option<ActiveConstraint>,
    /// Whether this request may speculate (the engine's `[speculative]` permitting).
    pub speculative: bool,
    /// The drafts of the verify chunk in flight (positions `tokens.len() ..`), empty when the
    /// request's last chunk carried none.
    pub drafts: Vec<u32>,
    /// Verify steps in a row that accepted no draft, and the decodes left to run without
    /// drafts before the next try (twice as many after each miss, at most
    /// [`super::speculative::MAX_BACKOFF`]): text the drafter cannot predict stops paying for
    /// verify steps.
    pub spec_misses: u32,
    pub spec_backoff: u32,
    /// Some of its positions were computed by a step the MTP pass did not follow (a step
    /// scheduled ahead while speculation was off): the head's K/V has holes, and it drafts no
    /// more until it is computed again from its first token.
    pub mtp_stale: bool,
    pub events: EventSender,
}

/// Output tokens a new request reserves room for (4 KiB of token ids).
const RESERVED_OUTPUT: usize = 1024;

impl Request {
    pub fn new(req: GenerateRequest, slot: u32, events: EventSender) -> Self {
        let seed = req.params.seed.unwrap_or_else(|| derive_seed(req.id));
        let prompt_len = req.prompt.len();
        let prompt_logprobs = req.prompt_logprobs.map(|_| vec![None; prompt_len]);
        let prompt_top = req.prompt_logprobs.unwrap_or(0) as usize;
        // Room for the output up front (bounded: `max_tokens` may be the whole context), so
        // appending a decoded token does not reallocate and copy the sequence every doubling.
        let mut tokens = req.prompt;
        tokens.reserve((req.max_tokens as usize).min(RESERVED_OUTPUT));
        Self {
            id: req.id,
            slot,
            phase: Phase::Waiting,
            tokens,
            prompt_len,
            orig_prompt_len: prompt_len,
            computed: 0,
            in_flight: 0,
            holds: 0,
            hash_pending: false,
            hashes: Vec::new(),
            kv_match: 0,
            cached_tokens: 0,
            cacheable_tokens: 0,
            cache_miss: None,
            checkpoints: req.checkpoints,
            admitted_once: false,
            priority: req.priority,
            params: req.params,
            max_tokens: req.max_tokens as usize,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            seed,
            preemptions: 0,
            prompt_logprobs,
            prompt_top,
            min_ban: Vec::new(),
            constraint: None,
            speculative: req.speculative,
            drafts: Vec::new(),
            spec_misses: 0,
            spec_backoff: 0,
            mtp_stale: false,
            events,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.orig_prompt_len
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.orig_prompt_len..]
    }

    /// Tokens the row sampled next must not take: the stop tokens while fewer than
    /// `min_tokens` are generated (counting those being sampled), else none.
    pub fn banned_now(&self) -> &[u32] {
        if self.generated() + self.in_flight < self.params.min_tokens as usize {
            &self.min_ban
        } else {
            &[]
        }
    }

    /// Tokens row `j` of a verify chunk must not take (it stands for the `j`-th token after
    /// the known ones): the stop tokens while fewer than `min_tokens` would be generated.
    pub fn banned_at(&self, j: usize) -> &[u32] {
        if self.generated() + j < self.params.min_tokens as usize {
            &self.min_ban
        } else {
            &[]
        }
    }

    /// Known tokens and those being sampled.
    pub fn total_len(&self) -> usize {
        self.tokens.len() + self.in_flight
    }

    pub fn is_prefill(&self) -> bool {
        self.computed < self.prompt_len
    }
}

/// A request's default sampling seed (reproducible per request id).
pub fn derive_seed(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A constrained response's matcher and how many of its output tokens it has consumed (a
/// `Cell`: plans are built from a shared view of the requests).
#[derive(Debug)]
pub struct ActiveConstraint {
    pub matcher: u32,
    pub fed: std::cell::Cell<usize>,
}
