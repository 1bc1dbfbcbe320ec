//! Backends: where tensors live and how kernels run.
//!
//! A backend owns tensor storage and implements every kernel the architectures need. The CPU
//! backend is the f32 reference (always built, used by CI and as the oracle for accelerated
//! backends). Its contract is three traits, one per audience (as candle keeps what ops need
//! apart from what allocation needs):
//! - [`Backend`]: tensor storage (upload, download, zeros, copies, shapes and dtypes) and what
//!   a backend is (its name, its activation dtype, whether its device is lost). Everything
//!   that holds tensors calls it: model loaders, caches, the model runner, checks.
//! - [`LayerOps`]: the layer operations a forward pass runs over the step object, fused ones
//!   included (linear layers, norms, attention, the SSM scan and Mamba2 mixer, the gated delta
//!   rule, MoE). The model code (`crate::model`) is written once against it.
//! - [`StepBackend`]: what the model runner calls to build a step, upload it (eagerly, packed
//!   ahead or padded to a graph bucket), capture and replay graphs, time it on the device and
//!   read its samples back.
//!
//! **No method has a default body.** Every implementor, wrappers included, writes each one
//! out, so the compiler names any method a new backend or wrapper leaves out: a fused
//! operation never silently becomes its unfused parts (a wrapper that forwarded 50 of 55
//! methods once ran the unfused forms under CUDA). A backend without a fused form calls its
//! parts from [`composed`] by name; one without graphs or a device clock says so in its own
//! table. A test holds the traits to this and [`counting::Counting`] to forwarding each
//! method to the same method of the backend it wraps.
//!
//! The contract is shaped for a device that is not the host:
//! - **Tensors carry a dtype** ([`DType`]). Weights arrive as [`HostTensor`]s in their
//!   checkpoint dtype, straight from the memory map; the backend decides what it keeps (the CPU
//!   widens to f32, a GPU keeps bf16).
//! - **One upload per step.** The batch arrives once as a [`StepPlan`] through
//!   [`StepBackend::upload_step`]; kernels read the backend's step object, never host slices.
//! - **Temporaries come from a per-step arena**; [`StepBackend::arena_stats`] reports its
//!   growth, which stops after the first steps.
//! - **The step ends on the backend**: [`StepBackend::sample`] applies penalties, takes the
//!   per-row top-K candidates, log-sum-exp and argmax, and performs the step's one
//!   device-to-host copy.
//! - **MoE routing and expert compute** are one backend operation over stacked expert weights.
//! - **SSM state pools are slot-major** (`[slots, layers, …]`): all of a step's restores and
//!   zeros are one call ([`LayerOps::ssm_slot_ops`]).
//! - Every operation returns a [`Result`] with a typed [`BackendError`].
//!
//! Backends know tensors and kernels, not requests: this module imports nothing from the
//! model, the caches, the engine or the server.

pub mod composed;
pub mod counting;
pub mod cpu;
pub mod cuda;
mod forward;
pub mod fp8;
pub mod sample;
pub mod step;

pub use sample::{SampleOut, SampleRows};
pub use step::{PlanError, SeqChunk, SlotOp, SnapshotTarget, StepPlan};

/// Element types of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// FP8 e4m3 codes of a quantized weight (its scales travel beside it: [`fp8`]).
    F8E4M3,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }
}

/// A step shape that a backend captures as a device graph and replays for every step that
/// fits it, padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GraphBucket {
    /// Decode-only steps of at most `seqs` one-token chunks.
    Decode { seqs: usize },
    /// Steps with prefill chunks (or one-token chunks with slot ops, which a decode bucket
    /// does not take): at most `tokens` tokens, in at most `decodes` one-token chunks and
    /// `prompts` longer ones.
    Mixed {
        tokens: usize,
        decodes: usize,
        prompts: usize,
    },
}

impl GraphBucket {
    /// Whether a step of `tokens` tokens in `decodes` one-token chunks and `prompts` longer
    /// ones is within the bucket's counts (its upload may still refuse it: snapshots, SSD
    /// chunks). A mixed bucket's padding decodes need a padding token row: a step with fewer
    /// decodes than the bucket must have fewer tokens too.
    pub fn holds(&self, tokens: usize, decodes: usize, prompts: usize) -> bool {
        match *self {
            GraphBucket::Decode { seqs } => prompts == 0 && decodes <= seqs,
            GraphBucket::Mixed {
                tokens: t,
                decodes: d,
                prompts: p,
            } => tokens + usize::from(decodes < d) <= t && decodes <= d && prompts <= p,
        }
    }
}

/// A tensor in host memory, in its own dtype: little-endian bytes, row-major.
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl<'a> HostTensor<'a> {
    /// An f32 tensor over `values`.
    pub fn f32(values: &'a [f32], shape: &'a [usize]) -> Self {
        Self {
            dtype: DType::F32,
            shape,
            bytes: f32_bytes(values),
        }
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let b = self.bytes;
        match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            // Codes without their scales: only the tests look at these.
            DType::F8E4M3 => b.iter().map(|&c| fp8::e4m3_to_f32(c)).collect(),
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let n: usize = self.shape.iter().product();
        if n * self.dtype.size() != self.bytes.len() {
            return Err(BackendError::Invalid(format!(
                "{} bytes of {:?} do not fill shape {:?}",
                self.bytes.len(),
                self.dtype,
                self.shape
            )));
        }
        Ok(())
    }
}

/// The bytes of an f32 slice (little-endian hosts only, which every supported target is).
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is exact.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// The made-up weight value of element `i` of a tensor seeded `seed`: uniform in
/// `[-std·√3, std·√3)` (standard deviation `std`) from a splitmix64 hash. The CUDA kernel
/// `fill_random` computes the same f32 operations.
pub fn dummy_value(seed: u64, i: u64, std: f32) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i)
        .wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
    (2.0 * u - 1.0) * std * 1.732_050_8
}

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

/// Checks that the column widths of a [`LayerOps::split_cols`] cover a row of `cols` exactly.
pub(crate) fn check_split(widths: &[usize], cols: usize) -> Result<()> {
    if widths.iter().sum::<usize>() != cols {
        return Err(BackendError::Invalid(format!(
            "split widths {widths:?} do not sum to {cols} columns"
        )));
    }
    Ok(())
}

/// One Mamba2 scan's operands of [`LayerOps::ssm_scan`]: `x [n, heads·head_dim]`, `b`/`c` `[n,
/// groups·state_size]`, `dt [n, heads]` (raw: the bias and softplus are applied by the scan),
/// and per head `a_log`, the skip `d` and `dt_bias`. A backend may hold the per-token inputs as
/// views of another kind `X` (column ranges of one wider tensor, say).
pub struct SsmOperands<'a, T, X = &'a T> {
    pub x: X,
    pub b: X,
    pub c: X,
    pub dt: X,
    pub a_log: &'a T,
    pub d: &'a T,
    pub dt_bias: &'a T,
}

/// One Gated DeltaNet layer's operands of [`LayerOps::gated_delta_rule`]: `q`/`k` `[n,
/// k_heads·k_dim]`, `v [n, v_heads·v_dim]`, the raw `a`/`b` `[n, v_heads]`, and per value head
/// `a_log` and `dt_bias`.
pub struct GdnOperands<'a, T> {
    pub q: &'a T,
    pub k: &'a T,
    pub v: &'a T,
    pub a: &'a T,
    pub b: &'a T,
    pub a_log: &'a T,
    pub dt_bias: &'a T,
}

/// How a Mamba2 mixer's scan output `y` meets its gate `z` before `out_proj`. Norms are RMS
/// norms over each `d_inner / groups`-wide group of channels, times the weight `[d_inner]`.
pub enum SsmOutNorm<T> {
    /// `norm(y · silu(z))`: Mamba2, NemotronH, Bamba, Granite; Falcon-H1 with
    /// `mamba_norm_before_gate = false`.
    GateThenNorm(T),
    /// `norm(y) · silu(z)`, the norm per group: Falcon-H1 with `mamba_rms_norm` and
    /// `mamba_norm_before_gate`.
    NormThenGate(T),
    /// `y · silu(z)`, no norm: Falcon-H1 with `mamba_rms_norm = false`.
    GateOnly,
}

/// One Mamba2 mixer's weights between its two projections, for [`LayerOps::mamba2_mix`]:
/// conv weights `[conv_dim, 1, kernel]` and bias `[conv_dim]`, `A_log`, `D` and `dt_bias`
/// `[heads]`, the output norm.
pub struct Mamba2Mix<'a, T> {
    pub conv_w: &'a T,
    pub conv_b: Option<&'a T>,
    pub a_log: &'a T,
    pub d: &'a T,
    pub dt_bias: &'a T,
    pub norm: &'a SsmOutNorm<T>,
    pub shape: SsmShape,
    pub eps: f32,
}

impl<T> Mamba2Mix<'_, T> {
    /// Channels of the conv: `x | B | C`.
    pub fn conv_dim(&self) -> usize {
        self.shape.d_inner() + 2 * self.shape.groups * self.shape.state_size
    }
}

/// Shape of one Gated DeltaNet mixer as the delta-rule kernel needs it: `k_heads` query/key
/// heads of width `k_dim`, `v_heads` value heads of width `v_dim` (each query/key head serves
/// `v_heads / k_heads` consecutive value heads), and the chunk length of the prompt form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub chunk_size: usize,
}

impl GdnShape {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Channels of the short convolution over `q | k | v`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 elements of one layer's delta-rule state `[v_heads, k_dim, v_dim]`.
    pub fn state_elems(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

/// How a MoE router turns its logits into expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeScoring {
    /// `sigmoid(logit)` per expert (NemotronH; DeepSeek-V3 routing).
    Sigmoid,
    /// `softmax(logits)` over all experts (Granite 4.0, Qwen MoE). With `norm_topk_prob` the
    /// picked weights are the softmax over the picked logits alone.
    Softmax,
}

/// How a MoE layer picks experts: scores from the router logits ([`MoeScoring`]), plus a
/// correction bias for the choice only, grouped top-k (group score = sum of its two best
/// choices), top-k experts among the allowed groups, optional renormalisation, then a scaling
/// factor. Ties go to the lower index.
pub struct MoeRouting<T> {
    pub scoring: MoeScoring,
    pub correction_bias: T,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
}

/// Expert weights stacked over experts: `up [E, I, H]`, `down [E, H, I]`, optional `gate
/// [E, I, H]` (`down(act(gate x) · up x)` when present, `down(act(up x))` otherwise).
pub struct StackedExperts<T> {
    pub up: T,
    pub down: T,
    pub gate: Option<T>,
    pub act: Activation,
}

/// Paged K and V of one attention layer: `[num_blocks, block_size, kv_heads, head_dim]` each.
pub struct KvLayer<T> {
    pub k: T,
    pub v: T,
    /// Set when the cache holds FP8 e4m3 codes (`cache.kv_dtype = "fp8_e4m3"`): the scales a
    /// written value is divided by before rounding, and a code multiplied by when read. A
    /// backend without FP8 storage (the CPU) keeps the dequantized values.
    pub fp8: Option<KvScales>,
}

impl<T> KvLayer<T> {
    /// A cache that stores K and V as they are computed.
    pub fn plain(k: T, v: T) -> Self {
        Self { k, v, fp8: None }
    }
}

/// The per-layer scales of an FP8 KV cache: a cached K element is `code · k`, a V element
/// `code · v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    pub k: f32,
    pub v: f32,
}

impl Default for KvScales {
    /// 1.0 for both, as vLLM uses for a checkpoint without scales.
    fn default() -> Self {
        Self { k: 1.0, v: 1.0 }
    }
}

/// Recurrent state of every slot, slot-major over layers: conv `[slots, layers, conv_dim,
/// kernel − 1]` and recurrent `[slots, layers, …]` (Mamba2: `[heads, head_dim, state_size]`;
/// Gated DeltaNet: `[v_heads, k_dim, v_dim]`). One slot's state of all layers is contiguous,
/// so a restore or zero of a slot is one copy; the pool does not know which kind of layer
/// it holds.
pub struct SsmPools<T> {
    pub conv: T,
    pub ssm: T,
    pub slots: usize,
    pub layers: usize,
}

/// Growth of a backend's per-step arena (temporaries); it stops once the largest step shapes
/// have been seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Times a temporary needed memory the arena did not have.
    pub grown: u64,
    /// Bytes the arena holds.
    pub bytes: u64,
}

/// Errors a backend reports (shape mismatches are programming errors upstream, but they must
/// surface as errors, not panics, on the serving path).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    #[error("tensor shape {got:?} does not match {expected:?} ({what})")]
    Shape {
        what: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("device error: {0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// Device-side timing of one step, from events on the backend's stream.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceStepTime {
    /// From the step's first device operation to its read-back.
    pub busy_s: f64,
    /// From the previous timed step's read-back to this step's first operation, and, in a
    /// step whose tail waited for masks computed on the host ([`StepBackend::hold_tail`]),
    /// from its forward pass's end to those masks' arrival: time the device waited for the
    /// host.
    pub idle_before_s: f64,
    /// Of `idle_before_s`, the wait for the held tail's masks.
    pub mask_wait_s: f64,
}

/// Tensor storage: what everything that holds tensors calls (model loaders, caches, the
/// model runner, checks). Tensors are row-major; a "matrix" is `[rows, cols]`.
pub trait Backend: Send + Sync + 'static {
    type Tensor: Send + Sync;

    fn name(&self) -> &'static str;

    /// The dtype of activations, weights and KV caches on this backend (the CPU computes in
    /// f32; a GPU serves in bf16, or f32 in its oracle mode).
    fn act_dtype(&self) -> DType;

    /// Whether the backend's device had an error it cannot recover from (the replica must stop).
    fn is_lost(&self) -> bool;

    /// Whether the SSM recurrent-state pool may be stored as bf16 (`cache.ssm_state_dtype =
    /// "bfloat16"`). A backend that cannot keeps it in f32, and the setting then only sizes the
    /// slots (the CPU backend).
    fn bf16_ssm_state(&self) -> bool;

    /// Copies a host tensor in (weights: straight from the checkpoint's memory map).
    fn upload(&self, host: HostTensor<'_>) -> Result<Self::Tensor>;

    /// Copies a quantized weight in (an FP8 checkpoint's codes and scales). A backend without
    /// FP8 math keeps its exact dequantization (the CPU: the oracle); a GPU keeps the codes.
    fn upload_fp8(&self, w: fp8::Fp8Weight<'_>) -> Result<Self::Tensor>;

    /// Quantizes a weight (`[rows, cols]` or `[experts, rows, cols]`, of the backend's dtype) to
    /// FP8 e4m3 with one scale per row, `max|row| / 448` (online quantization). A backend
    /// without FP8 math returns the dequantized values, which are what one with it computes
    /// with.
    fn quantize_fp8(&self, w: &Self::Tensor) -> Result<Self::Tensor>;

    /// Copies a tensor out, widened to f32 (a device-to-host transfer; not on the step path
    /// except for prompt-logprob rows).
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;

    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    fn dtype(&self, t: &Self::Tensor) -> DType;

    /// A persistent zeroed tensor (caches), allocated at start, not from the step arena.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Self::Tensor>;

    /// `dst = src`, on the device (same shape and dtype): a captured graph's output copied
    /// into a buffer that graphs share.
    fn copy_into(&self, src: &Self::Tensor, dst: &mut Self::Tensor) -> Result<()>;

    /// Fills `t` with made-up weights (`model.load_format = "dummy"`): element `i` is
    /// [`dummy_value`]`(seed, i, std)`, or `mean` everywhere when `std` is 0. Every backend
    /// produces the same values, rounded to the tensor's dtype.
    fn fill_dummy(&self, t: &mut Self::Tensor, seed: u64, std: f32, mean: f32) -> Result<()>;
}

/// The layer operations: what `model/` calls in a forward pass, reading the step object.
pub trait LayerOps: Backend {
    /// The backend's copy of a [`StepPlan`] (device buffers on an accelerator).
    type Step: Send;

    /// Told at load: the SSD chunk size of the model's Mamba2 layers. A device backend cuts its
    /// scan chunks when the step is uploaded, before any layer runs; the CPU ignores it.
    fn set_ssm_chunk_size(&self, chunk: usize);

    // ---- dense math -------------------------------------------------------------------------
    /// A zeroed step temporary shaped like `x`.
    fn zeros_like(&self, x: &Self::Tensor) -> Result<Self::Tensor>;

    /// Rows of `table` picked by the step's token ids: `[tokens, cols]`.
    fn embedding(&self, table: &Self::Tensor, step: &Self::Step) -> Result<Self::Tensor>;

    /// `x[n, k] · w[m, k]ᵀ (+ bias[m])` → `[n, m]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;

    /// `[x · w_sᵀ (+ b_s)]` for weights that share the input (a layer's q/k/v projections, or
    /// gate and up): equal to one [`LayerOps::linear`] each. A device may run them as one
    /// launch (one pass over `x`, one kernel instead of several).
    fn linear_shared(
        &self,
        x: &Self::Tensor,
        weights: &[(&Self::Tensor, Option<&Self::Tensor>)],
    ) -> Result<Vec<Self::Tensor>>;

    /// A gated MLP's hidden activations: `act(x · gateᵀ (+ b)) * (x · upᵀ (+ b))`. Equal to
    /// [`LayerOps::linear_shared`] then [`LayerOps::gated_activation`]
    /// ([`composed::gated_linear`]); a device may compute the product in the projections'
    /// epilogue (one launch, one output).
    fn gated_linear(
        &self,
        x: &Self::Tensor,
        gate: (&Self::Tensor, Option<&Self::Tensor>),
        up: (&Self::Tensor, Option<&Self::Tensor>),
        act: Activation,
    ) -> Result<Self::Tensor>;

    /// `act(x · wᵀ (+ b))`: [`LayerOps::linear`] then [`LayerOps::activate`]
    /// ([`composed::linear_activated`]); a device may apply the activation in the projection's
    /// epilogue.
    fn linear_activated(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        act: Activation,
    ) -> Result<Self::Tensor>;

    /// `x += y` (same shape).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    fn scale_assign(&self, x: &mut Self::Tensor, s: f32) -> Result<()>;

    /// RMS norm over the last dim, times `w`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;

    /// `residual += delta`, then `rms_norm(residual, w)`: a sublayer's residual add fused
    /// into the next norm (one pass on a device; [`composed::add_rms_norm`] runs the two).
    fn add_rms_norm(
        &self,
        residual: &mut Self::Tensor,
        delta: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// `rms_norm_grouped(x * silu(gate)) * w`, normalising each `group`-wide slice on its own.
    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        w: &Self::Tensor,
        group: usize,
        eps: f32,
    ) -> Result<Self::Tensor>;

    fn activate(&self, x: &mut Self::Tensor, act: Activation) -> Result<()>;

    /// `act(gate) * up`.
    fn gated_activation(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        act: Activation,
    ) -> Result<Self::Tensor>;

    /// Consecutive column ranges of the given widths (which must sum to cols). A backend that
    /// can address strided columns returns views; the CPU reference copies.
    fn split_cols<const N: usize>(
        &self,
        x: &Self::Tensor,
        widths: [usize; N],
    ) -> Result<[Self::Tensor; N]>;

    /// The rows of `x` listed in the step's `logit_rows`.
    fn gather_logit_rows(&self, x: &Self::Tensor, step: &Self::Step) -> Result<Self::Tensor>;

    // ---- attention --------------------------------------------------------------------------
    /// Rotates the leading `rope.rotary_dim` dims of every head of `x[n, heads * head_dim]`
    /// at the step's positions (non-interleaved halves, as Hugging Face's `rotate_half`).
    fn apply_rope(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &Self::Step,
    ) -> Result<()>;

    /// Writes this step's K/V into their paged rows (the step's slot mapping), then computes
    /// causal attention of every query over its sequence's cached + new keys. Returns
    /// `[n, heads * head_dim]`.
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut KvLayer<Self::Tensor>,
        shape: AttnShape,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    /// [`LayerOps::paged_attention`] with RoPE applied to `q` and to `k` on its way into the
    /// cache. A device fuses both rotations into the KV write (one launch);
    /// [`composed::rope_paged_attention`] rotates `q` and `k` first.
    #[allow(clippy::too_many_arguments)]
    fn rope_paged_attention(
        &self,
        q: Self::Tensor,
        k: Self::Tensor,
        v: &Self::Tensor,
        cache: &mut KvLayer<Self::Tensor>,
        shape: AttnShape,
        rope: &Rope,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    // ---- state-space layers -----------------------------------------------------------------
    /// Applies the step's SSM slot restores and zeros to every layer at once.
    fn ssm_slot_ops(&self, pools: &mut SsmPools<Self::Tensor>, step: &Self::Step) -> Result<()>;

    /// Depthwise causal conv1d over `x[n, channels]` with weights `[channels, kernel]`,
    /// continuing from each sequence's conv state of SSM layer `layer` (then updating it),
    /// followed by SiLU. Writes the conv state at each snapshot target into its slot.
    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    /// The Mamba2 selective scan of `x` ([`SsmOperands`]: `x[n, heads*head_dim]`, `b`/`c` `[n,
    /// groups*state]`, `dt[n, heads]` raw, bias and softplus applied here). Continues from and
    /// updates each sequence's recurrent state of SSM layer `layer`; prompts use the chunked
    /// (SSD) form, single tokens the recurrent step; snapshot targets receive the state at their
    /// offsets. Adds the `D` skip. Returns `y[n, heads*head_dim]`.
    fn ssm_scan(
        &self,
        x: &SsmOperands<'_, Self::Tensor>,
        shape: SsmShape,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    /// The middle of a Mamba2 mixer: from `in_proj`'s output `zxbcdt [n, d_inner + conv_dim +
    /// heads]` (the gate `z`, then `x | B | C`, then the raw `dt`) to `out_proj`'s input `[n,
    /// d_inner]`: [`LayerOps::causal_conv1d`] on `x | B | C`, [`LayerOps::ssm_scan`] on the
    /// result and `dt`, then the output norm with `z` ([`SsmOutNorm`]).
    /// [`composed::mamba2_mix`] runs those operations on copied column ranges; a device reads
    /// the ranges in place.
    fn mamba2_mix(
        &self,
        zxbcdt: &Self::Tensor,
        m: &Mamba2Mix<'_, Self::Tensor>,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    // ---- gated models (Qwen3-Next, Qwen3.5) -------------------------------------------------
    /// RMS norm of every `head_dim`-wide slice of each row of `x`, times `w[head_dim]` (the
    /// same weight for every head): per-head q/k norms and the Gated DeltaNet output norm.
    fn head_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        head_dim: usize,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// `x *= sigmoid(gate)`, where `gate` has `x`'s shape or one column (one gate per row,
    /// broadcast over the row): the output gate of gated attention and the shared-expert gate.
    fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()>;

    /// The gated delta rule of a Gated DeltaNet layer ([`GdnOperands`]). `q`/`k` `[n,
    /// k_heads*k_dim]` (already convolved; L2-normalised here, `q` also scaled by
    /// `k_dim^-1/2`), `v` `[n, v_heads*v_dim]`, `a`/`b` `[n, v_heads]` raw (decay `g =
    /// −exp(a_log)·softplus(a + dt_bias)` and `β = sigmoid(b)` are taken here). Per value head,
    /// with state `S [k_dim, v_dim]`: `S ← exp(g)·S; S += k ⊗ β(v − Sᵀk); o = Sᵀq`. Continues
    /// from and updates each sequence's state of recurrent layer `layer` (`pools.ssm`); prompts
    /// use the chunked form, single tokens the recurrent step; snapshot targets receive the
    /// state at their offsets. Returns `o [n, v_heads*v_dim]`.
    fn gated_delta_rule(
        &self,
        x: &GdnOperands<'_, Self::Tensor>,
        shape: GdnShape,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor>;

    // ---- mixture of experts -----------------------------------------------------------------
    /// Routes every row of `x[n, hidden]` from `router_logits[n, experts]` and adds the
    /// weighted outputs of its experts to `out[n, hidden]` (experts in ascending id order),
    /// all on the backend.
    fn moe(
        &self,
        x: &Self::Tensor,
        router_logits: &Self::Tensor,
        routing: &MoeRouting<Self::Tensor>,
        experts: &StackedExperts<Self::Tensor>,
        out: &mut Self::Tensor,
    ) -> Result<()>;
}

/// The step: what the model runner calls to build, upload, replay and read back a step.
pub trait StepBackend: LayerOps {
    /// An empty step object for steps of at most `max_tokens` tokens; the step arena is
    /// sized for that bucket (a step beyond it still runs, and grows the arena).
    fn new_step(&self, max_tokens: usize) -> Result<Self::Step>;

    /// The step's one host-to-device upload.
    fn upload_step(&self, plan: &StepPlan, step: &mut Self::Step) -> Result<()>;

    fn arena_stats(&self) -> ArenaStats;

    /// Whether the sampling tail applies the plan's token masks (`SampleRows::masks`): an
    /// engine on a backend that does not refuses constrained requests.
    fn applies_token_masks(&self) -> bool;

    // ---- packing ahead ----------------------------------------------------------------------
    /// Whether [`StepBackend::pack_step`], [`StepBackend::repack_tokens`] and
    /// [`StepBackend::send_step`] split a step's upload: packing is host work only, so the next
    /// step can be packed while the device computes this one.
    fn packs_ahead(&self) -> bool;

    /// Packs `plan` on the host for [`StepBackend::send_step`]: in the eager layout (`bucket`
    /// `None`) or padded to a graph bucket (`Ok(false)`, nothing packed, when it does not
    /// fit, as [`StepBackend::upload_graph_step`] says). Enqueues no device work.
    fn pack_step(
        &self,
        plan: &StepPlan,
        step: &mut Self::Step,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
    ) -> Result<bool>;

    /// Writes `plan`'s tokens over those of the step [`StepBackend::pack_step`] packed from it
    /// (placeholders then): the same plan otherwise.
    fn repack_tokens(&self, plan: &StepPlan, step: &mut Self::Step) -> Result<()>;

    /// The packed step's upload (its first device work): as [`StepBackend::upload_step`] after
    /// packing.
    fn send_step(&self, step: &mut Self::Step) -> Result<()>;

    /// Writes `plan`'s token masks (`SampleRows::masks`) over those of the step uploaded from it
    /// (its forward pass may be computing) and sends them, ordered after the work enqueued so
    /// far and before the sampling tail that follows: the masks of constrained rows computed
    /// while the device runs the forward pass. The same plan otherwise, with as many mask
    /// words.
    fn send_masks(&self, plan: &StepPlan, step: &mut Self::Step) -> Result<()>;

    /// Marks the step whose forward pass was just enqueued as one whose sampling tail waits
    /// for [`StepBackend::send_masks`]: the device clock counts the device's wait for those
    /// masks as idle time, not as the step's busy time.
    fn hold_tail(&self) -> Result<()>;

    // ---- device graphs (steps replayed without per-kernel launches) -------------------------
    /// The step shapes this backend replays as captured graphs, for steps of at most
    /// `max_batch` sequences and `max_tokens` tokens (empty: no graphs; the CPU).
    fn graph_buckets(&self, max_batch: usize, max_tokens: usize) -> Vec<GraphBucket>;

    /// Uploads `plan` padded to `bucket` in the fixed layout of a graph step (`max_blocks`
    /// block-table words per chunk at most). `Ok(false)`, with nothing uploaded, when the
    /// plan does not fit the bucket (run it eagerly, or try a larger bucket). A mixed
    /// bucket's slot ops are uploaded with the step and run eagerly before the replay
    /// ([`LayerOps::ssm_slot_ops`]); a decode bucket takes no slot ops.
    fn upload_graph_step(
        &self,
        plan: &StepPlan,
        step: &mut Self::Step,
        bucket: GraphBucket,
        max_blocks: usize,
    ) -> Result<bool>;

    /// Records everything `run` enqueues (on this backend's stream) as a graph, without
    /// executing it, and returns the graph's id. `run` must enqueue the same work whatever
    /// the step's data (no host read-back, no allocation that the graph would outlive).
    fn capture_graph(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<usize>;

    /// Replays graph `id` (its step object holds the current step's metadata).
    fn replay_graph(&self, id: usize) -> Result<()>;

    // ---- the device clock -------------------------------------------------------------------
    /// Starts timing a step on the device: called before the step's first device work is
    /// enqueued. The step's read-back (in [`StepBackend::sample`]) marks its end.
    fn step_clock_start(&self) -> Result<()>;

    /// After a timed step's results are on the host: how long the device worked on it and how
    /// long it sat idle between the previous timed step's end and this step's start (zero for
    /// the first). `None` where the backend has no device clock (the CPU).
    fn step_clock_end(&self) -> Result<Option<DeviceStepTime>>;

    // ---- end of the step --------------------------------------------------------------------
    /// The sampling tail over the step's `sample_rows` of `logits` (`[logit rows, vocab]`):
    /// penalties (applied in place), per-row top-K candidates ordered best first with ties to
    /// the lower id, log-sum-exp where wanted. Its result in `out` is the step's one
    /// device-to-host copy.
    fn sample(
        &self,
        logits: &mut Self::Tensor,
        step: &Self::Step,
        out: &mut SampleOut,
    ) -> Result<()>;

    /// [`StepBackend::sample`] in two halves: this one enqueues the tail and its read-back and
    /// may return before the results are on the host; [`StepBackend::sample_finish`] waits for
    /// them and fills `out`. Between the two the host can do work that does not read `out`
    /// while the device computes. Where the device is the host (the CPU) this runs the whole
    /// tail and the finish has nothing left to do.
    fn sample_start(
        &self,
        logits: &mut Self::Tensor,
        step: &Self::Step,
        out: &mut SampleOut,
    ) -> Result<()>;

    /// Completes the step [`StepBackend::sample_start`] started: `out` holds its candidates.
    fn sample_finish(&self, out: &mut SampleOut) -> Result<()>;

    /// Whether [`StepBackend::sample_finish`] would return without waiting for the device (also
    /// when nothing is pending, or when the device failed: the finish then says how).
    fn sample_ready(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::GraphBucket;

    #[test]
    fn a_bucket_holds_the_steps_within_its_counts() {
        let d = GraphBucket::Decode { seqs: 8 };
        assert!(d.holds(8, 8, 0));
        assert!(!d.holds(9, 9, 0));
        assert!(!d.holds(40, 7, 1), "a prompt chunk is not a decode step");
        let m = GraphBucket::Mixed {
            tokens: 128,
            decodes: 4,
            prompts: 2,
        };
        assert!(
            m.holds(128, 4, 2),
            "full: no padding decode, no padding row needed"
        );
        assert!(
            m.holds(127, 3, 1),
            "a padding decode on the one padding row"
        );
        assert!(!m.holds(128, 3, 1), "a padding decode and no padding row");
        assert!(!m.holds(100, 5, 1));
        assert!(!m.holds(100, 4, 3));
        assert!(
            m.holds(3, 3, 0),
            "one-token chunks with slot ops take a mixed bucket"
        );
    }

    /// The methods of each backend trait, from this file's source: `(trait, method, body)`,
    /// where `body` says whether the declaration carries a default body. Doc comments are
    /// skipped; a signature ends at its line ending in `;` (no default) or `{` / `{}`.
    fn trait_methods(src: &str) -> Vec<(String, String, bool)> {
        let mut out = Vec::new();
        let mut current: Option<String> = None;
        let mut pending: Option<String> = None;
        for line in src.lines() {
            let t = line.trim();
            if t.starts_with("//") {
                continue;
            }
            if let Some(rest) = line.strip_prefix("pub trait ") {
                current = rest.split([':', ' ']).next().map(str::to_string);
                continue;
            }
            let Some(tr) = current.as_ref() else {
                continue;
            };
            if line == "}" {
                current = None;
                continue;
            }
            if let Some(rest) = t.strip_prefix("fn ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                pending = Some(name);
            }
            if let Some(name) = pending.as_ref() {
                let body = t.ends_with('{') || t.ends_with("{}");
                if body || t.ends_with(';') {
                    out.push((tr.clone(), name.clone(), body));
                    pending = None;
                }
            }
        }
        out
    }

    /// What keeps a wrapper from missing a method: no method of [`super::Backend`],
    /// [`super::LayerOps`] or [`super::StepBackend`] has a default body, so every implementor
    /// writes each one out (the compiler names any left out), and [`super::counting::Counting`]
    /// forwards each to the same method of the backend it wraps (not to its parts: a fused
    /// operation counted as its pieces would run unfused under it). Counting's methods come
    /// from `forward!` lists; what the macro writes for a listed name is checked by
    /// `forward::tests::a_listed_method_calls_its_target_with_its_arguments`.
    #[test]
    fn no_trait_method_has_a_default_and_counting_forwards_every_one() {
        let methods = trait_methods(include_str!("mod.rs"));
        for (tr, probe) in [
            ("Backend", "upload"),
            ("LayerOps", "mamba2_mix"),
            ("StepBackend", "sample_ready"),
        ] {
            assert!(
                methods.iter().any(|(t, m, _)| t == tr && m == probe),
                "{tr}::{probe} not found: the source scan is broken"
            );
        }
        let defaults: Vec<String> = methods
            .iter()
            .filter(|(_, _, body)| *body)
            .map(|(t, m, _)| format!("{t}::{m}"))
            .collect();
        assert_eq!(
            defaults,
            Vec::<String>::new(),
            "trait methods with a default body"
        );

        let counting = include_str!("counting.rs");
        for (tr, m, _) in &methods {
            let forwards = counting_forwards(counting, m);
            assert_eq!(
                forwards.len(),
                1,
                "Counting implements {tr}::{m} once, forwarding it (found {forwards:?})"
            );
            assert_eq!(
                forwards[0], "self.inner",
                "Counting's {tr}::{m} does not forward to the inner {m}"
            );
        }
    }

    /// Where `counting.rs` implements method `m`: for each implementation, the receiver it
    /// forwards `m` to under the same name (`"self.inner"`), or what it does instead. A
    /// `forward! { recv… => a, b -> c, … }` list implements each name it lists, forwarding to
    /// `recv.a` (or to `recv.c`: another method, so not `"self.inner"`); a written-out `fn m`
    /// forwards when its body calls `self.inner.m(`.
    fn counting_forwards(src: &str, m: &str) -> Vec<String> {
        let mut found = Vec::new();
        for (i, _) in src.match_indices("forward! {") {
            let block = &src[i + "forward! {".len()..];
            let block = &block[..block.find('}').unwrap_or(block.len())];
            let Some((head, list)) = block.split_once("=>") else {
                continue;
            };
            let recv = head.split(',').next().unwrap_or("").trim();
            for item in list.split(',') {
                let words: Vec<&str> = item.split_whitespace().collect();
                match words.as_slice() {
                    [name] if *name == m => found.push(recv.to_string()),
                    [name, "->", to] if *name == m => found.push(format!("{recv}.{to}")),
                    _ => {}
                }
            }
        }
        for (i, _) in src.match_indices(&format!("\n    fn {m}")) {
            let after = &src[i + 8 + m.len()..];
            if !(after.starts_with('(') || after.starts_with('<')) {
                continue;
            }
            let end = after.find("\n    }\n").unwrap_or(after.len());
            let body: String = after[..end].split_whitespace().collect();
            found.push(if body.contains(&format!("self.inner.{m}(")) {
                "self.inner".to_string()
            } else {
                format!("a body of its own: {body}")
            });
        }
        found
    }
}
