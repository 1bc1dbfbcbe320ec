//! Backends: where tensors live and how kernels run.
//!
//! The model code (`crate::model`) is written once against the [`Backend`] trait; a backend
//! owns tensor storage and implements every kernel the architectures need. The CPU backend is
//! the f32 reference (always built, used by CI and as the oracle for accelerated backends).
//! Backends know tensors and kernels, not requests: sequence structure arrives as the plain
//! [`SeqChunk`] slices the engine built.

pub mod cpu;
pub mod sample;

use crate::model::SeqChunk;

/// Element-wise activations used by the supported architectures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `relu(x)²` (NemotronH MLPs and experts).
    Relu2,
    Gelu,
}

impl Activation {
    /// Parses a Hugging Face `hidden_act` string.
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "relu2" => Some(Self::Relu2),
            "gelu" | "gelu_pytorch_tanh" | "gelu_new" => Some(Self::Gelu),
            _ => None,
        }
    }
}

/// Rotary embedding tables: `inv_freq` per rotary pair and the rotated width.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    /// Leading dims of each head that are rotated (`2 * inv_freq.len()`); the rest pass through.
    pub rotary_dim: usize,
    /// Multiplier on cos/sin (1 for default and llama3 scaling).
    pub attention_scaling: f32,
}

/// Shape of one attention layer as the attention kernel needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Shape and constants of one Mamba2 mixer as the scan kernel needs them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SsmShape {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state_size: usize,
    pub chunk_size: usize,
    pub dt_min: f32,
    pub dt_max: f32,
}

impl SsmShape {
    pub fn d_inner(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn state_elems(&self) -> usize {
        self.heads * self.head_dim * self.state_size
    }
}

/// Paged K and V of one attention layer: `[num_blocks, block_size, kv_heads, head_dim]` each.
pub struct KvLayer<T> {
    pub k: T,
    pub v: T,
}

/// SSM state of one Mamba2 layer for every slot: conv `[slots, conv_dim, kernel - 1]` and
/// recurrent `[slots, heads, head_dim, state_size]`.
pub struct SsmLayer<T> {
    pub conv: T,
    pub ssm: T,
}

/// Errors a backend reports (shape mismatches are programming errors upstream, but they must
/// surface as errors, not panics, on the serving path).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("tensor shape {got:?} does not match {expected:?} ({what})")]
    Shape {
        what: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// The kernel seam. Tensors are row-major; a "matrix" is `[rows, cols]`.
pub trait Backend: Send + Sync + 'static {
    type Tensor: Send + Sync;

    fn name(&self) -> &'static str;

    // ---- storage ------------------------------------------------------------------------
    fn from_host(&self, data: Vec<f32>, shape: &[usize]) -> Result<Self::Tensor>;
    fn to_host(&self, t: &Self::Tensor) -> Vec<f32>;
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    fn zeros(&self, shape: &[usize]) -> Self::Tensor;

    // ---- dense math ---------------------------------------------------------------------
    /// Rows of `table` picked by `ids`: `[ids.len(), cols]`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x[n, k] · w[m, k]ᵀ (+ bias[m])` → `[n, m]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// `x += y` (same shape).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    fn scale_assign(&self, x: &mut Self::Tensor, s: f32);
    /// RMS norm over the last dim, times `w`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `rms_norm_grouped(x * silu(gate)) * w`, normalising each `group`-wide slice on its own.
    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        w: &Self::Tensor,
        group: usize,
        eps: f32,
    ) -> Result<Self::Tensor>;
    fn activate(&self, x: &mut Self::Tensor, act: Activation);
    /// `act(gate) * up`.
    fn gated_activation(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        act: Activation,
    ) -> Result<Self::Tensor>;
    /// Splits columns into consecutive pieces of the given widths (which must sum to cols).
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32]) -> Result<Self::Tensor>;
    /// `dst[rows[i]] += weights[i] * src[i]`.
    fn scatter_add_rows(
        &self,
        dst: &mut Self::Tensor,
        src: &Self::Tensor,
        rows: &[u32],
        weights: &[f32],
    ) -> Result<()>;

    // ---- attention ----------------------------------------------------------------------
    /// Rotates the leading `rope.rotary_dim` dims of every head of `x[n, heads * head_dim]`
    /// (non-interleaved halves, as Hugging Face's `rotate_half`).
    fn apply_rope(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()>;
    /// Writes this step's K/V into their paged slots, then computes causal attention of every
    /// query over its sequence's cached + new keys. Returns `[n, heads * head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut KvLayer<Self::Tensor>,
        block_size: usize,
        shape: AttnShape,
        seqs: &[SeqChunk],
    ) -> Result<Self::Tensor>;

    // ---- state-space layers -------------------------------------------------------------
    /// Depthwise causal conv1d over `x[n, channels]` with weights `[channels, kernel]`,
    /// continuing from each sequence's conv state (then updating it), followed by SiLU.
    /// Writes the conv state at each snapshot point into the snapshot slot.
    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        state: &mut Self::Tensor,
        seqs: &[SeqChunk],
    ) -> Result<Self::Tensor>;
    /// The Mamba2 selective scan. `x[n, heads*head_dim]`, `b`/`c` `[n, groups*state]`,
    /// `dt[n, heads]` (raw: bias and softplus applied here). Continues from and updates each
    /// sequence's recurrent state; prompts use the chunked (SSD) form, single tokens the
    /// recurrent step. Adds the `D` skip. Returns `y[n, heads*head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn ssm_scan(
        &self,
        x: &Self::Tensor,
        b: &Self::Tensor,
        c: &Self::Tensor,
        dt: &Self::Tensor,
        a_log: &Self::Tensor,
        d: &Self::Tensor,
        dt_bias: &Self::Tensor,
        shape: SsmShape,
        state: &mut Self::Tensor,
        seqs: &[SeqChunk],
    ) -> Result<Self::Tensor>;
    /// Copies slot `src` to slot `dst` in a per-slot state tensor (first dim = slots).
    fn copy_slot(&self, t: &mut Self::Tensor, src: u32, dst: u32) -> Result<()>;
    fn zero_slot(&self, t: &mut Self::Tensor, slot: u32) -> Result<()>;
}
