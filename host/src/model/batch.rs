//! The contract between the engine and the model: what one step's forward pass receives.
//!
//! The engine (scheduler + cache manager + model runner) owns every cache and decides which
//! tokens run this step; the model only reads these plain inputs. Nothing here knows how
//! blocks were allocated or why a request is in the batch.

/// Inputs for one forward pass over a batch of sequence chunks (continuous batching: each
/// chunk is a prefill chunk or a single decode token; one code path for both).
#[derive(Debug, Clone, Default)]
pub struct BatchInputs {
    /// Token ids of every chunk, concatenated in `seqs` order.
    pub tokens: Vec<u32>,
    /// Absolute position of each token in its sequence (same length as `tokens`).
    pub positions: Vec<u32>,
    /// One entry per sequence in the batch.
    pub seqs: Vec<SeqChunk>,
}

/// One sequence's share of the step.
#[derive(Debug, Clone, Default)]
pub struct SeqChunk {
    /// Start of this chunk in [`BatchInputs::tokens`].
    pub offset: usize,
    /// Number of tokens computed this step (≥ 1).
    pub len: usize,
    /// Tokens of this sequence whose K/V are already in the paged cache (and whose effect is
    /// already folded into the live SSM slot) before this chunk.
    pub context_len: usize,
    /// Paged-KV block ids covering positions `0 .. context_len + len`, in order.
    pub block_table: Vec<u32>,
    /// The live SSM-state slot of this sequence (ignored by models without SSM layers).
    pub ssm_slot: u32,
    /// Copy the SSM state to durable slots at these points inside the chunk.
    pub snapshots: Vec<SsmSnapshot>,
    /// Whether the logits of the chunk's last token are wanted (false for non-final prefill
    /// chunks).
    pub want_logits: bool,
    /// Whether the logits of every token of the chunk are wanted (prompt logprobs); implies
    /// the last token's.
    pub all_logits: bool,
}

/// The snapshot point is the cache's type; the model only reads it.
pub use crate::cache::SsmSnapshot;

impl BatchInputs {
    /// Adds a chunk; positions continue from `context_len`.
    pub fn push(
        &mut self,
        tokens: &[u32],
        context_len: usize,
        block_table: Vec<u32>,
        ssm_slot: u32,
        want_logits: bool,
    ) -> &mut SeqChunk {
        let offset = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((context_len..context_len + tokens.len()).map(|p| p as u32));
        self.seqs.push(SeqChunk {
            offset,
            len: tokens.len(),
            context_len,
            block_table,
            ssm_slot,
            snapshots: Vec::new(),
            want_logits,
            all_logits: false,
        });
        let last = self.seqs.len() - 1;
        &mut self.seqs[last]
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}

/// The cache's sizing contract; each architecture reports one.
pub use crate::cache::CacheSpec;
