//! The CUDA backend: the same contract as the CPU reference, on an NVIDIA GPU.
//!
//! - **Two numeric modes.** [`DType::BF16`] (serving: bf16 weights, activations and KV, f32
//!   accumulation) and [`DType::F32`] (the oracle mode: the same kernels instantiated for
//!   f32, SGEMM without TF32), so end-to-end parity with the CPU can be held tight.
//! - **Kernels** come from the `chimera-kernels` crate, compiled by NVRTC for the device at
//!   start (cached on disk) and launched through their entry tables ([`device::Device`]).
//!   GEMMs go through cuBLASLt with cached plans ([`gemm::Gemm`]).
//! - **Memory.** Weights and caches are persistent allocations taken at start; step
//!   temporaries come from a recycling arena ([`memory::Arena`]); the step's metadata is one
//!   buffer uploaded with one copy ([`step::CudaStep`]); the sampling tail's candidates come
//!   back with one copy into pinned memory, which is the step's one synchronisation.
//! - **One stream per backend.** Each engine replica gets its own backend
//!   ([`CudaBackend::replica`]): its own stream, arena and cuBLASLt workspace over the same
//!   device and kernels. Weights are shared through the model.
//! - **Errors.** Every driver error becomes a [`BackendError`]; an error the context cannot
//!   survive (an illegal address) takes the device out of service: later calls fail at once.
//!
//! Hybrid models run too: the Mamba2 conv and SSD scan with snapshots written straight into
//! their slots (reading `in_proj`'s output in place, [`mamba`]), batched slot restores and
//! zeros (kernels of `chimera_kernels::ssm`, planned when the step is uploaded), and MoE with
//! routing and grouped expert GEMMs on the device (no read-back; [`moe`]).
//!
//! This file holds the backend's state, its launch helpers and its three trait impls. The
//! impls are tables: each method is one call into an inherent `impl CudaBackend` block in the
//! file that owns its concern — storage and step temporaries `tensor`; projections
//! `linear`; element-wise and row operations `dense`; `norm`s; `attention`; the SSM
//! state pools `ssm`; the Mamba2 mixer `mamba`; `moe`; the Gated DeltaNet operations
//! not yet on CUDA `gated`; the step's `upload` (its layouts in `step`); CUDA
//! `graph`s; the device `clock`; the `sample` tail and its read-back.

mod attention;
mod clock;
mod dense;
pub mod device;
mod fp8;
mod gated;
pub mod gemm;
mod graph;
mod linear;
mod mamba;
pub mod memory;
mod moe;
mod norm;
mod sample;
mod ssm;
pub mod step;
mod tensor;
mod upload;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chimera_kernels::KernelCache;
use chimera_kernels::attention::PrefillKernel;
use cudarc::driver::{CudaStream, result, sys};

use self::clock::StepClock;
use self::device::{Arg, Device};
pub use self::fp8::FP8_GEMV_AUTO;
use self::graph::Graph;
use self::memory::{Arena, DevAlloc, MemStats, Pinned, sync};
use self::sample::PendingRead;
pub use self::step::CudaStep;
pub use self::tensor::CudaTensor;
use super::forward::forward;
use super::{
    Activation, Backend, BackendError, DType, GraphBucket, LayerOps, Result, StepBackend, StepPlan,
};

/// Which numeric mode and device a backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    pub device: usize,
    /// `F32` (oracle) or `BF16` (serving).
    pub dtype: DType,
}

struct Inner {
    device: Arc<Device>,
    stream: Arc<CudaStream>,
    dtype: DType,
    arena: Arc<Arena>,
    stats: Arc<MemStats>,
    gemm: gemm::Gemm,
    /// Rotary tables on the device, keyed by their inverse frequencies' bits.
    ropes: Mutex<HashMap<Vec<u32>, DevAlloc>>,
    /// Pinned memory the sampling tail's results come back into.
    readback: Mutex<Option<Pinned>>,
    /// The read-back `sample_start` enqueued and `sample_finish` has not yet waited for.
    pending_read: Mutex<Option<PendingRead>>,
    /// Captured graphs, by id.
    graphs: Mutex<Vec<Graph>>,
    /// bf16 linear layers of one or two rows use the one-pass GEMV (`gemv.cu`) instead of
    /// cuBLASLt (switchable so the bench can time both in one run).
    small_m_gemv: AtomicBool,
    /// FP8 weights at more than two rows (bf16 mode) use cuBLASLt's FP8 GEMM with per-token
    /// activation scales where it has an algorithm for the shape (switchable so the bench can
    /// time both paths).
    fp8_gemm: AtomicBool,
    /// Which of `chimera_kernels::fp8::GEMV_N1_BF16` one-row bf16 FP8 projections use (the
    /// bench times them; 0, the default, otherwise).
    fp8_gemv_variant: std::sync::atomic::AtomicUsize,
    /// Events timing steps on the device (created on first use).
    clock: Mutex<Option<StepClock>>,
}

/// The CUDA backend of one replica (see the module docs). Clones share everything.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

const BLOCK: u32 = 256;

impl CudaBackend {
    /// Opens `opts.device`, compiles or loads the kernels and creates the stream.
    pub fn new(opts: CudaOptions) -> Result<Self> {
        if !matches!(opts.dtype, DType::F32 | DType::BF16) {
            return Err(BackendError::Invalid(format!(
                "the CUDA backend runs in float32 or bfloat16, not {:?}",
                opts.dtype
            )));
        }
        let device = Device::open(opts.device, &KernelCache::from_env())?;
        Self::on(device, opts.dtype)
    }

    fn on(device: Arc<Device>, dtype: DType) -> Result<Self> {
        device.bind()?;
        let stream = device
            .ctx
            .new_stream()
            .map_err(|e| device.fail("creating a stream", e))?;
        let stats = Arc::new(MemStats::default());
        let gemm = gemm::Gemm::new(&device, &stats)?;
        Ok(Self {
            inner: Arc::new(Inner {
                arena: Arc::new(Arena::new(device.clone(), stats.clone())),
                device,
                stream,
                dtype,
                stats,
                gemm,
                ropes: Mutex::new(HashMap::new()),
                readback: Mutex::new(None),
                pending_read: Mutex::new(None),
                fp8_gemm: AtomicBool::new(true),
                fp8_gemv_variant: std::sync::atomic::AtomicUsize::new(fp8::FP8_GEMV_AUTO),
                graphs: Mutex::new(Vec::new()),
                small_m_gemv: AtomicBool::new(true),
                clock: Mutex::new(None),
            }),
        })
    }

    /// A backend for another replica on the same device: its own stream, arena and GEMM
    /// workspace; the kernels are shared.
    pub fn replica(&self) -> Result<Self> {
        Self::on(self.inner.device.clone(), self.inner.dtype)
    }

    /// A backend on the same device (kernels shared) in another numeric mode.
    pub fn with_dtype(&self, dtype: DType) -> Result<Self> {
        Self::on(self.inner.device.clone(), dtype)
    }

    /// Whether bf16 linear layers of one or two rows run the one-pass GEMV (the default) or
    /// cuBLASLt. Results agree to rounding either way.
    pub fn set_small_m_gemv(&self, on: bool) {
        self.inner.small_m_gemv.store(on, Ordering::Relaxed);
    }

    /// Mamba2 prompts of at most `tokens` tokens, when a step has no longer one, take the
    /// recurrent step token by token instead of the chunked SSD (0: never), on every replica of
    /// the device. Results agree to rounding either way.
    pub fn set_ssm_recurrent_tokens(&self, tokens: u32) {
        self.dev()
            .ssm_recurrent_tokens
            .store(tokens, Ordering::Relaxed);
    }

    /// Programmatic dependent launch on or off for the kernels launched (or captured) from now
    /// on (on by default; `CHIMERA_PDL=0` turns it off at start).
    pub fn set_pdl(&self, on: bool) {
        self.dev().set_pdl(on);
    }

    /// The d = 128 bf16 prefill attention kernel for the launches (or captures) from now on:
    /// Hopper's wgmma kernel by default on compute capability 9.0 (`CHIMERA_WGMMA=0` keeps
    /// `mma.sync`); a kernel the device has not built falls back to `mma.sync`. Returns the
    /// kernel now in use.
    pub fn set_prefill_kernel(&self, k: PrefillKernel) -> PrefillKernel {
        self.dev().set_prefill_kernel(k)
    }

    /// The d = 128 bf16 prefill attention kernel in use.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        self.dev().prefill_kernel()
    }

    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The activation (and weight, and KV) dtype.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.inner.device.bind()?;
        result::mem_get_info().map_err(|e| self.inner.device.fail("reading free memory", e))
    }

    /// Streaming multiprocessors of the device.
    fn sm_count(&self) -> u32 {
        self.inner.device.sm_count
    }

    /// Driver allocations made by this backend so far (the step loop adds none once warm).
    pub fn driver_allocations(&self) -> u64 {
        self.inner.stats.allocations.load(Ordering::Relaxed)
    }

    /// Bytes this backend has taken from the driver so far (weights, caches, arena, buffers).
    pub fn allocated_bytes(&self) -> u64 {
        self.inner.stats.bytes.load(Ordering::Relaxed)
    }

    /// Device-to-device copy bandwidth in bytes per second (read + write counted), measured
    /// over copies of `bytes` bytes.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let dev = self.dev();
        dev.bind()?;
        let a = DevAlloc::new(dev, bytes, &self.inner.stats)?;
        let b = DevAlloc::new(dev, bytes, &self.inner.stats)?;
        self.memset_zero(a.ptr, bytes)?;
        let copy = || {
            // SAFETY: both buffers hold `bytes` bytes and do not overlap.
            unsafe { result::memcpy_dtod_async(b.ptr, a.ptr, bytes, self.stream()) }
                .map_err(|e| dev.fail("copying on the device", e))
        };
        copy()?;
        sync(dev, self.stream())?;
        let reps = 10;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            copy()?;
        }
        sync(dev, self.stream())?;
        Ok(2.0 * (bytes * reps) as f64 / t0.elapsed().as_secs_f64())
    }

    /// Whether the device is out of service after an unrecoverable error.
    pub fn is_broken(&self) -> bool {
        self.inner.device.sticky.load(Ordering::Relaxed)
    }

    /// Waits for all work enqueued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.device.bind()?;
        sync(&self.inner.device, self.stream())
    }

    fn stream(&self) -> sys::CUstream {
        self.inner.stream.cu_stream()
    }

    /// Device time of each operation (kernel or cuBLASLt call) that `run` launches, longest
    /// total first. For eager work only (an event pair brackets each launch); not inside a
    /// graph capture.
    pub fn profile_ops<E: From<BackendError>>(
        &self,
        run: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<device::OpTime>, E> {
        self.synchronize()?;
        self.dev().profile_start();
        let ran = run();
        let ops = self.dev().profile_take();
        ran?;
        Ok(ops?)
    }

    fn dev(&self) -> &Arc<Device> {
        &self.inner.device
    }

    /// Launches `<name>_f32` / `<name>_bf16` (by `dtype`) with a 1-D block of [`BLOCK`].
    fn launch(&self, name: &str, dtype: DType, grid: u32, args: &[Arg]) -> Result<()> {
        self.launch_geo(name, dtype, (grid, 1, 1), (BLOCK, 1, 1), 0, args)
    }

    fn launch_geo(
        &self,
        name: &str,
        dtype: DType,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let suffix = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            d @ (DType::F16 | DType::F8E4M3) => {
                return Err(BackendError::Invalid(format!("{d:?} tensors in {name}")));
            }
        };
        let k = self.dev().kernel(&format!("{name}_{suffix}"))?;
        self.dev().launch(self.stream(), k, grid, block, smem, args)
    }

    fn launch_exact(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let k = self.dev().kernel(entry)?;
        self.dev().launch(self.stream(), k, grid, block, smem, args)
    }

    /// Launches a planner's kernels in order, each symbolic argument given its value by `arg`.
    fn run_launches<A>(
        &self,
        launches: impl IntoIterator<Item = chimera_kernels::Launch<A>>,
        arg: impl Fn(&A) -> Result<Arg>,
    ) -> Result<()> {
        for l in launches {
            let args = l.args.iter().map(&arg).collect::<Result<Vec<Arg>>>()?;
            self.launch_exact(l.entry, l.grid, l.block, l.smem, &args)?;
        }
        Ok(())
    }

    fn check_dtype(&self, what: &str, t: &CudaTensor) -> Result<()> {
        if t.dtype != self.inner.dtype {
            return Err(BackendError::Invalid(format!(
                "{what}: tensor is {:?}, the backend runs {:?}",
                t.dtype, self.inner.dtype
            )));
        }
        Ok(())
    }

    fn step_ready(&self, step: &CudaStep) -> Result<()> {
        if !step.uploaded {
            return Err(BackendError::Invalid(
                "kernel called with a step that was not uploaded".into(),
            ));
        }
        Ok(())
    }
}

/// Blocks for a grid-stride loop over `n` elements.
/// Blocks for a grid-stride element-wise kernel over `n` elements: one thread an element,
/// but at most `GRID_STRIDE_BLOCKS_PER_SM` blocks an SM (a full SM's worth of threads). A
/// grid of a block per 256 elements spends more time scheduling blocks than moving bytes
/// once the kernel takes 16-byte pieces (a 5.5 M-element activation: 21 504 blocks, 30 µs;
/// the loop needs no more than the threads the GPU holds at once).
fn grid_for(n: u64, sm_count: u32) -> u32 {
    let cap = u64::from(sm_count.max(1)) * GRID_STRIDE_BLOCKS_PER_SM;
    n.div_ceil(u64::from(BLOCK)).clamp(1, cap.min(65_535)) as u32
}

const GRID_STRIDE_BLOCKS_PER_SM: u64 = 8;

fn shape_err(what: &str, got: &[usize], expected: Vec<usize>) -> BackendError {
    BackendError::Shape {
        what: what.into(),
        got: got.to_vec(),
        expected,
    }
}

// The trait impls: one call each into the file that owns the concern (see the module docs).

impl Backend for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn act_dtype(&self) -> DType {
        self.inner.dtype
    }
    fn bf16_ssm_state(&self) -> bool {
        true
    }
    fn shape<'a>(&self, t: &'a CudaTensor) -> &'a [usize] {
        &t.shape
    }
    fn dtype(&self, t: &CudaTensor) -> DType {
        t.dtype
    }
    forward! { self =>
        is_lost -> is_broken,
        upload -> upload_host,
        upload_fp8 -> upload_fp8_weight,
        quantize_fp8 -> quantize_on_device,
        download -> download_f32,
        zeros -> zeros_persistent,
        copy_into -> copy_on_device,
        fill_dummy -> fill_dummy_on_device,
    }
}

impl LayerOps for CudaBackend {
    type Step = CudaStep;

    forward! { self =>
        set_ssm_chunk_size -> store_ssm_chunk,
        zeros_like -> zeros_tmp,
        embedding -> embed_rows,
        linear -> project,
        linear_shared -> project_shared,
        gated_linear -> project_gated,
        linear_activated -> project_activated,
        add_assign -> add_in_place,
        scale_assign -> scale_in_place,
        rms_norm -> rms_norm_rows,
        add_rms_norm -> add_rms_norm_rows,
        gated_rms_norm -> gated_rms_norm_dense,
        activate -> activate_in_place,
        gated_activation -> act_mul,
        split_cols -> copy_col_ranges,
        gather_logit_rows -> gather_logits,
        apply_rope -> rope_in_place,
        paged_attention -> write_kv_and_attend,
        rope_paged_attention -> rope_write_kv_and_attend,
        ssm_slot_ops -> run_slot_ops,
        causal_conv1d -> conv_dense,
        ssm_scan -> scan_dense,
        mamba2_mix -> mamba2_mix_in_place,
        head_rms_norm -> head_rms_norm_rows,
        sigmoid_gate -> sigmoid_gate_rows,
        moe -> moe_on_device,
        gated_delta_rule -> delta_rule_layer,
    }
}

impl StepBackend for CudaBackend {
    /// The tail launches `sample_apply_masks` for steps with token masks.
    fn applies_token_masks(&self) -> bool {
        true
    }

    forward! { self =>
        new_step -> new_step_object,
        upload_step -> upload_eager,
        arena_stats -> arena_growth,
        send_step -> send,
        send_masks -> send_late_masks,
        hold_tail -> mark_tail_held,
        upload_graph_step -> upload_for_graph,
        capture_graph -> capture,
        replay_graph -> replay,
        step_clock_start -> clock_start,
        step_clock_end -> clock_end,
        sample -> sample_and_wait,
        sample_start -> enqueue_sample,
        sample_finish -> finish_sample,
        sample_ready -> sample_landed,
    }
    fn packs_ahead(&self) -> bool {
        true
    }
    fn pack_step(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
    ) -> Result<bool> {
        self.pack_for(plan, step, bucket, max_blocks, true)
    }
    fn repack_tokens(&self, plan: &StepPlan, step: &mut CudaStep) -> Result<()> {
        step.repack_tokens(plan)
    }
    fn graph_buckets(&self, max_batch: usize, max_tokens: usize) -> Vec<GraphBucket> {
        graph::buckets(max_batch, max_tokens)
    }
}

/// The bytes of a u32 slice (little-endian hosts only, as everywhere in the backends).
fn u32_bytes(v: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and any byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn act_code(a: Activation) -> u32 {
    match a {
        Activation::Silu => 0,
        Activation::Relu2 => 1,
        Activation::Gelu => 2,
    }
}

/// A whole-number tuning knob for kernel work from the environment variable `name`; 0 when unset
/// (the planner's choice; a value that is not a number is named in a warning and ignored).
fn tuning_knob(name: &str) -> u32 {
    crate::config::env_knob(name).unwrap_or(0)
}

/// Scratch buffer `i` of a planner's launches as an argument (`what` names the planner).
fn scratch_arg(scratch: &[CudaTensor], i: usize, what: &str) -> Result<Arg> {
    scratch
        .get(i)
        .map(|t| Arg::Ptr(t.ptr))
        .ok_or_else(|| BackendError::Invalid(format!("{what} scratch {i}")))
}
