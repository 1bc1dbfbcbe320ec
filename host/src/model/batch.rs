//! What the engine and the model agree on besides the step plan (which lives with the
//! backend, [`crate::backend::StepPlan`]): snapshot points chosen by the cache manager and the
//! cache sizes a model needs.

/// "After `after` tokens of this chunk, copy the live SSM state (all layers) into `slot`."
/// `after` is in `1 ..= len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsmSnapshot {
    pub after: usize,
    pub slot: u32,
}

/// What a model needs from the caches, so the cache manager can size pools from a byte budget
/// without knowing anything else about the model.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    /// Number of attention layers (each has paged K and V).
    pub attn_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Number of SSM (Mamba2) layers; 0 for plain transformers.
    pub ssm_layers: usize,
    /// f32 elements of conv state per SSM layer per slot.
    pub conv_state_elems: usize,
    /// f32 elements of recurrent state per SSM layer per slot.
    pub ssm_state_elems: usize,
    /// Bytes per cached element (4 for the f32 CPU backend).
    pub dtype_bytes: usize,
}

impl CacheSpec {
    /// Bytes of K+V for one block of `block_size` tokens over all attention layers.
    pub fn kv_block_bytes(&self, block_size: usize) -> usize {
        2 * self.attn_layers * block_size * self.kv_heads * self.head_dim * self.dtype_bytes
    }

    /// Bytes of one SSM-state slot over all SSM layers (conv + recurrent state).
    pub fn ssm_slot_bytes(&self) -> usize {
        self.ssm_layers * (self.conv_state_elems + self.ssm_state_elems) * self.dtype_bytes
    }

    pub fn is_hybrid(&self) -> bool {
        self.ssm_layers > 0
    }
}
