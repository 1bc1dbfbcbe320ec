//! The three policy seams: routing, cache eviction and sampling.
//!
//! Each policy kind is one small trait. The built-in native implementations and the
//! WebAssembly plugin adapters both implement these traits, so the engine and the router call a
//! policy without knowing what is behind it. Policies *decide*; the host validates every answer
//! and falls back to the native default when an answer is missing or invalid
//! ([`Decision::UseDefault`]).
//!
//! All bulk data is passed as columns of primitives (one slice per field), mirroring the WIT
//! ABI in `plugin-sdk/wit/`, so an adapter can hand the slices to a plugin without reshaping.

pub mod lanes;
pub mod native;

pub use lanes::ConstraintLanes;

/// A policy's answer: a concrete choice, or "let the host's built-in default decide".
#[derive(Debug, Clone, PartialEq)]
pub enum Decision<T> {
    Use(T),
    UseDefault,
}

// ---------------------------------------------------------------------------------------------
// Router
// ---------------------------------------------------------------------------------------------

/// Per-replica state, one entry per replica in every column.
#[derive(Debug, Clone, Default)]
pub struct ReplicaColumns {
    pub waiting: Vec<u32>,
    pub running: Vec<u32>,
    pub free_blocks: Vec<u32>,
    pub total_blocks: Vec<u32>,
    /// Fraction of KV blocks in use, 0..=1.
    pub kv_usage: Vec<f32>,
    /// Leading prompt blocks this replica holds in its KV prefix cache.
    pub prefix_hit_blocks: Vec<u32>,
    /// Deepest prompt block at which this replica holds an SSM snapshot usable together with
    /// its KV prefix (0 for non-hybrid models or no snapshot).
    pub ssm_hit_blocks: Vec<u32>,
}

impl ReplicaColumns {
    pub fn len(&self) -> usize {
        self.waiting.len()
    }
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// The request being placed.
#[derive(Debug, Clone, Default)]
pub struct RouteRequest {
    pub prompt_tokens: u32,
    /// Full prompt blocks (the unit of `prefix_hit_blocks`).
    pub prompt_blocks: u32,
    pub tenant: String,
}

pub trait Router: Send {
    /// Picks a replica index in `0..replicas.len()`.
    fn route(&mut self, request: &RouteRequest, replicas: &ReplicaColumns) -> Decision<u32>;
}

// ---------------------------------------------------------------------------------------------
// Evictor
// ---------------------------------------------------------------------------------------------

/// What happened to cached blocks since the last call, as columns. The evictor keeps its own
/// view of the cache from these events instead of receiving the whole table each time.
#[derive(Debug, Clone, Default)]
pub struct CacheEvents {
    /// Event kind per entry, see [`EventKind`] (as u8 on the wire).
    pub kinds: Vec<u8>,
    pub blocks: Vec<u32>,
    /// Parent block for `Stored` (u32::MAX for a root block); unused otherwise.
    pub parents: Vec<u32>,
    /// Engine step at which the event happened.
    pub steps: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EventKind {
    /// A full block became cached under a prefix hash (child of `parent`).
    Stored = 0,
    /// A cached block was matched by a new request (a prefix-cache hit): it is pinned.
    Hit = 1,
    /// A cached block's last user released it: it is now evictable.
    Released = 2,
    /// A cached block left the cache (evicted or cleared).
    Removed = 3,
    /// An SSM snapshot now exists at this block's boundary.
    SnapshotStored = 4,
    /// The snapshot at this block's boundary was dropped.
    SnapshotRemoved = 5,
}

impl CacheEvents {
    pub fn push(&mut self, kind: EventKind, block: u32, parent: u32, step: u64) {
        self.kinds.push(kind as u8);
        self.blocks.push(block);
        self.parents.push(parent);
        self.steps.push(step);
    }
    pub fn clear(&mut self) {
        self.kinds.clear();
        self.blocks.clear();
        self.parents.clear();
        self.steps.clear();
    }
    pub fn len(&self) -> usize {
        self.kinds.len()
    }
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }
}

pub trait Evictor: Send {
    /// Incremental events, delivered in order before any `choose_victims` call that follows.
    fn on_events(&mut self, events: &CacheEvents);
    /// Chooses `count` evictable blocks, in eviction order. The host checks every victim
    /// (evictable, no cached child left behind) and falls back to the native order otherwise.
    fn choose_victims(&mut self, count: u32, step: u64) -> Decision<Vec<u32>>;
}

// ---------------------------------------------------------------------------------------------
// Sampler
// ---------------------------------------------------------------------------------------------

/// One step's sampling problem as columns: per-request parameters and the top-K candidates the
/// host computed (after penalties), K per request fixed by `k`.
#[derive(Debug, Clone, Default)]
pub struct SamplerBatch {
    /// Candidates per request.
    pub k: u32,
    /// 0 means greedy.
    pub temperature: Vec<f32>,
    /// 0 means disabled.
    pub top_k: Vec<u32>,
    /// 1 means disabled.
    pub top_p: Vec<f32>,
    /// 0 means disabled.
    pub min_p: Vec<f32>,
    /// Per-request seed and the number of tokens sampled so far (so draws are reproducible).
    pub seed: Vec<u64>,
    pub counter: Vec<u64>,
    /// `n × k` candidate token ids, best first.
    pub cand_tokens: Vec<u32>,
    /// `n × k` candidate logits (after penalties, before temperature), best first.
    pub cand_logits: Vec<f32>,
}

impl SamplerBatch {
    pub fn len(&self) -> usize {
        self.temperature.len()
    }
    pub fn is_empty(&self) -> bool {
        self.temperature.is_empty()
    }
}

pub trait Sampler: Send {
    /// Chooses one token per request (each must be one of that request's candidates).
    fn sample(&mut self, batch: &SamplerBatch) -> Decision<Vec<u32>>;
}

/// Why a constraint could not answer for one response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The grammar is wrong or beyond the limits: the client's fault (a 400).
    #[error("{0}")]
    Grammar(String),
    /// The tokens broke the grammar, or the plugin failed: the response ends with this.
    #[error("{0}")]
    Failed(String),
}

/// The constraints of one engine (ABI `constraining`): a matcher per constrained response,
/// advanced by the tokens sampled for it, answering the allowed-token mask of its next
/// position (`ceil(vocab / 32)` words, bit `t % 32` of word `t / 32` for token `t`).
pub trait Constrainer: Send {
    /// Compiles `grammar` (`json-schema`, `regex`, `choice`, `lark`) into a matcher.
    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError>;

    /// Advances `matcher` by `tokens` and writes its next mask into `mask`.
    fn next(&mut self, matcher: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String>;

    /// [`Self::next`] for each job, its answer in `job.result`; the matchers are distinct. One
    /// after another here; [`ConstraintLanes`] spreads them over its lanes' threads.
    fn next_batch(&mut self, jobs: &mut [MaskJob<'_>]) {
        for job in jobs {
            job.result = self.next(job.matcher, job.tokens, job.mask);
        }
    }

    /// Takes back the last `count` tokens.
    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String>;

    fn close(&mut self, matcher: u32);

    /// Starts compiling `grammar` for the response `tag`: compiled on the calling thread here
    /// ([`Opening::Done`]); [`ConstraintLanes`] compiles on a thread of its own and answers
    /// through [`Self::take_opened`], or says it is busy.
    fn start_open(&mut self, tag: u64, kind: &str, grammar: &str) -> Opening {
        let _ = tag;
        Opening::Done(self.open(kind, grammar))
    }

    /// Appends the compilations started by [`Self::start_open`] that have ended since the
    /// last call, with their tags. None here (this one compiles at once).
    fn take_opened(&mut self, done: &mut Vec<(u64, Result<u32, ConstraintError>)>) {
        let _ = done;
    }

    /// Compilations started and not yet taken.
    fn opening(&self) -> usize {
        0
    }
}

/// What [`Constrainer::start_open`] did with a grammar.
#[derive(Debug)]
pub enum Opening {
    /// Compiled on the calling thread: the matcher, or why not.
    Done(Result<u32, ConstraintError>),
    /// Compiling elsewhere; the answer comes from [`Constrainer::take_opened`].
    Started,
    /// No compiler is free now: ask again later.
    Busy,
}

/// One mask of a step's batch ([`Constrainer::next_batch`]).
pub struct MaskJob<'a> {
    pub matcher: u32,
    /// The tokens the matcher has not consumed yet.
    pub tokens: &'a [u32],
    pub mask: &'a mut [u32],
    pub result: Result<(), String>,
}

/// The output parsers of one replica's output pass (ABI `parsing`).
pub trait OutputParser: Send {
    /// Tool-call formats, then reasoning formats.
    fn formats(&mut self) -> (Vec<String>, Vec<String>);

    fn open(&mut self, request: &ParseRequest) -> Result<u32, String>;

    fn feed(&mut self, parser: u32, text: &str) -> chimera_policy_core::Parsed;

    fn finish(&mut self, parser: u32) -> chimera_policy_core::Parsed;

    /// A Lark grammar forcing tool calls (see the WIT `call-grammar`).
    fn call_grammar(
        &mut self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<String, String>;
}

/// What one response is parsed for (owned; see `chimera_policy_core::ParseRequestView`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParseRequest {
    pub tool_format: String,
    pub reasoning_format: String,
    pub reasoning_open: bool,
    pub tools: String,
}

impl ParseRequest {
    pub fn view(&self) -> chimera_policy_core::ParseRequestView<'_> {
        chimera_policy_core::ParseRequestView {
            tool_format: &self.tool_format,
            reasoning_format: &self.reasoning_format,
            reasoning_open: self.reasoning_open,
            tools: &self.tools,
        }
    }
}
