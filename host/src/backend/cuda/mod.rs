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
//! their slots (reading `in_proj`'s output in place, [`mamba`]), batched slot restores and zeros (kernels of `chimera_kernels::ssm`, planned
//! when the step is uploaded), and MoE with routing and grouped expert GEMMs on the device
//! (no read-back; [`moe`]).

pub mod device;
pub mod gemm;
mod mamba;
pub mod memory;
mod moe;
pub mod step;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chimera_kernels::KernelCache;
use chimera_kernels::attention::{AttnArg, AttnDims, PrefillKernel};
use chimera_kernels::sample::SampleArg;
use chimera_kernels::ssm;
use cudarc::driver::{CudaStream, result, sys};

use self::device::{Arg, Device};
use self::mamba::{Cols, GateNorm};
use self::memory::{Arena, DevAlloc, MemStats, Pinned, bad_tensor, dtoh, htod, sync};
pub use self::step::CudaStep;
use super::{
    Activation, ArenaStats, AttnShape, Backend, BackendError, DType, DeviceStepTime, GdnShape,
    GraphBucket, HostTensor, KvLayer, LayerOps, Mamba2Mix, MoeRouting, Result, Rope, SampleOut,
    SsmPools, SsmShape, StackedExperts, StepBackend, StepPlan,
};

/// Where a tensor's memory comes from.
enum Mem {
    /// A persistent allocation (weights, caches), kept alive by the tensor.
    Owned(#[allow(dead_code, reason = "owns the memory `ptr` points into")] Arc<DevAlloc>),
    /// A step temporary, returned to the arena on drop: to its row-width list, or (`None`)
    /// to the flat buffers.
    Arena {
        arena: Arc<Arena>,
        buf: Option<DevAlloc>,
        row_bytes: Option<usize>,
    },
}

/// A dense row-major tensor in device memory.
pub struct CudaTensor {
    ptr: u64,
    shape: Vec<usize>,
    dtype: DType,
    mem: Mem,
}

impl std::fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaTensor({:?} {:?} @ {:#x})",
            self.dtype, self.shape, self.ptr
        )
    }
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        if let Mem::Arena {
            arena,
            buf,
            row_bytes,
        } = &mut self.mem
            && let Some(b) = buf.take()
        {
            match row_bytes {
                Some(w) => arena.give(*w, b),
                None => arena.give_flat(b),
            }
        }
    }
}

impl CudaTensor {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    fn bytes(&self) -> usize {
        self.len() * self.dtype.size()
    }

    /// The same rows under `shape` (same element count and last dim, so the arena's row
    /// width is unchanged): a dense result given its input's leading dims back.
    fn reshaped(mut self, shape: &[usize]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.len());
        debug_assert_eq!(shape.last(), self.shape.last());
        self.shape = shape.to_vec();
        self
    }

    /// `(rows, cols)` treating every leading dim as rows.
    fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        (self.len().checked_div(cols).unwrap_or(0), cols)
    }
}

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
    /// Events timing steps on the device (created on first use).
    clock: Mutex<Option<StepClock>>,
}

use chimera_kernels::gemv::Mode as GemvMode;

/// Resident GEMV blocks an SM when the grid is capped (`CHIMERA_GEMV_BLOCKS_PER_SM`, a tuning
/// knob for kernel work; the blocks loop over row groups). 0, the default, launches a block per
/// row group.
fn gemv_blocks_per_sm() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("CHIMERA_GEMV_BLOCKS_PER_SM")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Events on the stream: the current step's start and end, the previous step's end (see
/// [`StepBackend::step_clock_start`]), and the end of a read-back outside a timed step.
struct StepClock {
    start: sys::CUevent,
    end: sys::CUevent,
    prev_end: sys::CUevent,
    done: sys::CUevent,
    /// A step is being timed: its start is recorded with its first device operation.
    timing: bool,
    /// Its start is recorded (just before the step's upload, see [`CudaBackend::mark_step_start`]).
    started: bool,
    /// Its end is recorded (by the read-back in `sample`).
    ended: bool,
    have_prev: bool,
}

// SAFETY: plain driver handles, used under the backend's mutex with the context current.
unsafe impl Send for StepClock {}

impl StepClock {
    fn new(dev: &Device) -> Result<Self> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = || result::event::create(flags).map_err(|e| dev.fail("creating an event", e));
        Ok(Self {
            start: event()?,
            end: event()?,
            prev_end: event()?,
            done: event()?,
            timing: false,
            started: false,
            ended: false,
            have_prev: false,
        })
    }
}

impl Drop for StepClock {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.start);
            let _ = result::event::destroy(self.end);
            let _ = result::event::destroy(self.prev_end);
            let _ = result::event::destroy(self.done);
        }
    }
}

/// A read-back in flight: `rows × k` candidates (and `rows` log-sum-exps) land in the pinned
/// read-back buffer once `done` has completed.
struct PendingRead {
    rows: usize,
    k: usize,
    done: sys::CUevent,
}

// SAFETY: a plain event handle of the backend's context (owned by its step clock).
unsafe impl Send for PendingRead {}

/// A captured and instantiated CUDA graph, destroyed with the backend.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are plain driver handles; the driver allows their use from any thread
// with the context current, and every use here goes through the backend's mutex.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created by this backend and destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// Decode batch sizes captured as graphs.
const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// Token buckets of the mixed graphs (steps with prefill chunks): every 32 tokens up to 512.
/// Past about 200 rows a step's GEMMs are compute-bound on an H200, so each padding row costs
/// its share (at most 31 rows here); larger steps run eagerly, their launches hidden behind
/// kernels that long.
const MIXED_TOKEN_STEP: usize = 32;
const MIXED_MAX_TOKENS: usize = 512;
/// Prompt chunks a mixed graph holds: two (most mixed steps carry one or two), or eight. Each
/// padding prompt is an attention tile and a grid row of the SSD chunk pass that return at
/// once, which short steps notice.
const MIXED_PROMPTS: [usize; 2] = [2, 8];

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

    /// `y_s = x · w_sᵀ (+ b_s)` for up to three weights sharing `x` in one GEMV launch, with
    /// the epilogue `mode` (an activation, or a gated MLP's product: then one output), when
    /// the shapes allow it (bf16, one or two rows, `k` a multiple of 8, every `m` a multiple of
    /// the variant's features per block, or of half of it for a gate and up of equal shape);
    /// `None` leaves the work to cuBLASLt.
    fn try_gemv(
        &self,
        x: &CudaTensor,
        segments: &[(&CudaTensor, Option<&CudaTensor>)],
        mode: GemvMode,
        act: Activation,
    ) -> Result<Option<Vec<CudaTensor>>> {
        let (n, k) = x.rows_cols();
        let Some((entry, per_block)) = chimera_kernels::gemv::variant(n) else {
            return Ok(None);
        };
        let gated = mode == GemvMode::Gated;
        let row_multiple = if gated { per_block / 2 } else { per_block } as usize;
        if x.dtype != DType::BF16
            || !self.inner.small_m_gemv.load(Ordering::Relaxed)
            || !k.is_multiple_of(8)
            || segments.is_empty()
            || segments.len() > 3
            || (gated
                && (segments.len() != 2 || segments[0].0.rows_cols() != segments[1].0.rows_cols()))
            || segments
                .iter()
                .any(|(w, _)| !w.rows_cols().0.is_multiple_of(row_multiple))
        {
            return Ok(None);
        }
        let mut outs = Vec::with_capacity(segments.len());
        // x, n, k, then (weight, bias, output, m) for three segments (unused ones null with
        // m = 0), then the epilogue's mode and activation.
        let mut args = [Arg::Ptr(0); 17];
        args[..3].copy_from_slice(&[Arg::Ptr(x.ptr), Arg::U32(n as u32), Arg::U32(k as u32)]);
        let mut rows = 0usize;
        for (i, (w, b)) in segments.iter().enumerate() {
            let m = w.rows_cols().0;
            // A gated launch writes act(gate) * up into the first output only.
            let out = if i == 0 || !gated {
                let out = self.tmp(&[n, m], DType::BF16)?;
                let ptr = out.ptr;
                outs.push(out);
                ptr
            } else {
                0
            };
            args[3 + 4 * i..7 + 4 * i].copy_from_slice(&[
                Arg::Ptr(w.ptr),
                Arg::Ptr(b.map_or(0, |b| b.ptr)),
                Arg::Ptr(out),
                Arg::U32(m as u32),
            ]);
            rows += m;
        }
        for i in segments.len()..3 {
            args[6 + 4 * i] = Arg::U32(0);
        }
        args[15] = Arg::U32(mode as u32);
        args[16] = Arg::U32(act_code(act));
        let groups = (rows / per_block as usize) as u32;
        let grid = match gemv_blocks_per_sm() {
            0 => groups,
            b => groups.min(b * self.sm_count()),
        };
        self.launch_exact(
            entry,
            (grid, 1, 1),
            (chimera_kernels::gemv::WARPS * 32, 1, 1),
            0,
            &args,
        )?;
        Ok(Some(outs))
    }

    /// Whether bf16 linear layers of `x` with these weights may go to the GEMV (shapes and
    /// dtypes agree; the GEMV itself checks the rest).
    fn gemv_inputs_fit(
        &self,
        x: &CudaTensor,
        weights: &[(&CudaTensor, Option<&CudaTensor>)],
    ) -> bool {
        let k = x.rows_cols().1;
        x.dtype == self.inner.dtype
            && weights.iter().all(|(w, b)| {
                w.rows_cols().1 == k
                    && w.dtype == x.dtype
                    && b.is_none_or(|b| b.len() == w.rows_cols().0 && b.dtype == x.dtype)
            })
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Option<PendingRead>> {
        self.inner
            .pending_read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Locks the step clock, creating its events on first use.
    fn clock(&self) -> Result<std::sync::MutexGuard<'_, Option<StepClock>>> {
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        if clock.is_none() {
            *clock = Some(StepClock::new(self.dev())?);
        }
        Ok(clock)
    }

    /// Records a timed step's start, once, just before its first device operation (the
    /// upload's copy): the host's packing of the step is device idle time, not busy time.
    fn mark_step_start(&self) -> Result<()> {
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clock.as_mut().filter(|c| c.timing && !c.started) {
            // SAFETY: an event of this context, recorded on its stream.
            unsafe { result::event::record(c.start, self.stream()) }
                .map_err(|e| self.dev().fail("recording an event", e))?;
            c.started = true;
        }
        Ok(())
    }

    /// Marks the end of a step's work (its read-back is enqueued): a timed step's end event,
    /// else the plain one. Returns the event to wait on.
    fn record_step_end(&self) -> Result<sys::CUevent> {
        self.mark_step_start()?;
        let mut clock = self.clock()?;
        let Some(c) = clock.as_mut() else {
            return Err(BackendError::Invalid("no step clock".into()));
        };
        let ev = if c.timing {
            c.ended = true;
            c.end
        } else {
            c.done
        };
        // SAFETY: an event of this context, recorded on its stream.
        unsafe { result::event::record(ev, self.stream()) }
            .map_err(|e| self.dev().fail("recording an event", e))?;
        Ok(ev)
    }

    /// Fills every free arena buffer with NaN (all-ones bytes, NaN in f32 and bf16), so a
    /// test sees any output element a kernel failed to write.
    pub fn poison_arena(&self) -> Result<()> {
        self.inner.device.bind()?;
        self.inner.arena.for_each_free(|ptr, bytes| {
            // SAFETY: a free arena buffer of `bytes` bytes that no pending work uses as an output
            // (all work that used it was enqueued earlier on this stream).
            unsafe { result::memset_d8_async(ptr, 0xFF, bytes, self.stream()) }
                .map_err(|e| self.dev().fail("poisoning the arena", e))
        })?;
        sync(self.dev(), self.stream())
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

    /// Uploads a decode-only step as a graph step of `plan`'s own batch with `splits` split-KV
    /// pieces a sequence (the benches compare split counts; serving picks
    /// [`step::GraphShape::splits_for`]). `Ok(false)` when the plan does not fit that shape.
    pub fn upload_decode_step_with_splits(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        splits: u32,
        max_blocks: usize,
    ) -> Result<bool> {
        self.upload_graph_shaped(plan, step, plan.seqs.len(), splits, max_blocks)
    }

    /// Packs and uploads a graph step of `bucket` rows with `splits` split-KV pieces a
    /// sequence; a timed step's clock starts at its upload copy.
    fn upload_graph_shaped(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: usize,
        splits: u32,
        max_blocks: usize,
    ) -> Result<bool> {
        self.dev().bind()?;
        let shape = step::GraphShape {
            bucket,
            splits,
            table_cap: bucket * max_blocks + 1,
        };
        self.upload_graph_shape(plan, step, shape)
    }

    /// Packs `plan` on the host in the layout of `bucket` (the eager one for `None`);
    /// `Ok(false)` when it does not fit the bucket. No device work.
    /// `ahead`: the device may still be computing with `step`'s buffers, which must not be
    /// replaced: `Ok(false)` where an eager step needs them larger. (A graph step's buffers
    /// never change once a graph holds them.)
    fn pack_for(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
        ahead: bool,
    ) -> Result<bool> {
        self.dev().bind()?;
        match bucket {
            None => {
                plan.validate()?;
                step.pack(self.dev(), &self.inner.stats, plan, !ahead)
            }
            Some(GraphBucket::Decode { seqs }) => {
                let shape = step::GraphShape {
                    bucket: seqs,
                    splits: step::GraphShape::splits_for(seqs),
                    table_cap: seqs * max_blocks + 1,
                };
                step.pack_graph(self.dev(), &self.inner.stats, plan, shape)
            }
            Some(GraphBucket::Mixed {
                tokens,
                decodes,
                prompts,
            }) => {
                let m = step::MixedShape {
                    tokens,
                    decodes,
                    prompts,
                    table_cap: (decodes + prompts) * max_blocks + 1,
                };
                step.pack_mixed(self.dev(), &self.inner.stats, plan, m)
            }
        }
    }

    /// The packed step's upload: the step clock's start, then the one copy.
    fn send(&self, step: &mut CudaStep) -> Result<()> {
        self.dev().bind()?;
        self.mark_step_start()?;
        step.copy(self.dev(), self.stream())
    }

    /// Packs `plan` as a graph step of `shape` and copies it, the step clock's start recorded
    /// between the two. `Ok(false)`, nothing copied, when the plan does not fit.
    fn upload_graph_shape(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        shape: step::GraphShape,
    ) -> Result<bool> {
        if !step.pack_graph(self.dev(), &self.inner.stats, plan, shape)? {
            return Ok(false);
        }
        self.mark_step_start()?;
        step.copy(self.dev(), self.stream())?;
        Ok(true)
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
            DType::F16 => return Err(BackendError::Invalid("f16 tensors on CUDA".into())),
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

    /// A step temporary of `shape` (contents undefined: the kernel writes every element).
    fn tmp(&self, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
        // Rows of activations are recycled by row width; one-dimensional temporaries (scratch
        // and lists whose size depends on the step) by capacity.
        let (buf, row_bytes) = if shape.len() <= 1 {
            let bytes = shape.first().copied().unwrap_or(1) * dtype.size();
            (self.inner.arena.take_flat(bytes)?, None)
        } else {
            let cols = shape.last().copied().unwrap_or(1).max(1);
            let rows = shape.iter().product::<usize>() / cols;
            let row_bytes = cols * dtype.size();
            (self.inner.arena.take(rows, row_bytes)?, Some(row_bytes))
        };
        Ok(self.arena_tensor(buf, shape.to_vec(), dtype, row_bytes))
    }

    /// A tensor over an arena buffer, handed back to the arena when dropped.
    fn arena_tensor(
        &self,
        buf: DevAlloc,
        shape: Vec<usize>,
        dtype: DType,
        row_bytes: Option<usize>,
    ) -> CudaTensor {
        CudaTensor {
            ptr: buf.ptr,
            shape,
            dtype,
            mem: Mem::Arena {
                arena: self.inner.arena.clone(),
                buf: Some(buf),
                row_bytes,
            },
        }
    }

    /// A `[rows, cols]` step temporary whose buffer holds at least `cap_rows` rows: for row
    /// counts that vary beyond the step's token bucket (MoE entries are tokens × top-k), so
    /// that the first large step after warm-up does not grow the arena.
    fn tmp_rows_with_capacity(
        &self,
        rows: usize,
        cols: usize,
        cap_rows: usize,
        dtype: DType,
    ) -> Result<CudaTensor> {
        let row_bytes = cols.max(1) * dtype.size();
        let buf = self.inner.arena.take(rows.max(cap_rows), row_bytes)?;
        Ok(self.arena_tensor(buf, vec![rows, cols], dtype, Some(row_bytes)))
    }

    /// Most rows a step temporary of routed MoE entries can have: the step bucket × top-k.
    fn moe_rows_cap(&self, top_k: usize) -> usize {
        self.inner.arena.max_rows.load(Ordering::Relaxed) * top_k.max(1)
    }

    fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `ptr` is a live allocation of at least `bytes` owned by the caller.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream()) }
            .map_err(|e| self.dev().fail("clearing memory", e))
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

    fn rope_table(&self, rope: &Rope) -> Result<u64> {
        // Looked up by the frequencies' bits without building a key: this runs per layer.
        let bits = f32_bits(&rope.inv_freq);
        let mut ropes = self.inner.ropes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = ropes.get(bits) {
            return Ok(b.ptr);
        }
        let key = bits.to_vec();
        let buf = DevAlloc::new(self.dev(), 4 * key.len(), &self.inner.stats)?;
        let bytes = super::f32_bytes(&rope.inv_freq);
        // SAFETY: the buffer holds exactly these bytes; the source is synchronised below.
        unsafe { htod(self.dev(), self.stream(), buf.ptr, bytes)? };
        sync(self.dev(), self.stream())?;
        let ptr = buf.ptr;
        ropes.insert(key, buf);
        Ok(ptr)
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

impl Backend for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn act_dtype(&self) -> DType {
        self.inner.dtype
    }

    fn is_lost(&self) -> bool {
        self.is_broken()
    }

    fn upload(&self, host: HostTensor<'_>) -> Result<CudaTensor> {
        host.check()?;
        let dev = self.dev();
        dev.bind()?;
        let n: usize = host.shape.iter().product();
        let to = self.inner.dtype;
        let dst = Arc::new(DevAlloc::new(dev, n * to.size(), &self.inner.stats)?);
        if host.dtype == to {
            // SAFETY: the allocation holds `n * size` bytes, the source's length.
            unsafe { htod(dev, self.stream(), dst.ptr, host.bytes)? };
        } else {
            // Checkpoint dtype → device, then converted there (no f32 staging on the host).
            let staged = DevAlloc::new(dev, host.bytes.len(), &self.inner.stats)?;
            // SAFETY: as above for the staging buffer.
            unsafe { htod(dev, self.stream(), staged.ptr, host.bytes)? };
            let entry = match (host.dtype, to) {
                (DType::F32, DType::BF16) => "cast_f32_to_bf16",
                (DType::BF16, DType::F32) => "cast_bf16_to_f32",
                (DType::F16, DType::BF16) => "cast_f16_to_bf16",
                (DType::F16, DType::F32) => "cast_f16_to_f32",
                (from, to) => {
                    return Err(BackendError::Invalid(format!(
                        "no conversion from {from:?} to {to:?}"
                    )));
                }
            };
            let n = n as u64;
            self.launch_exact(
                entry,
                (grid_for(n, self.sm_count()), 1, 1),
                (BLOCK, 1, 1),
                0,
                &[Arg::Ptr(dst.ptr), Arg::Ptr(staged.ptr), Arg::U64(n)],
            )?;
            // The staging buffer is freed on drop: wait for the cast first.
            sync(dev, self.stream())?;
        }
        sync(dev, self.stream())?;
        Ok(CudaTensor {
            ptr: dst.ptr,
            shape: host.shape.to_vec(),
            dtype: to,
            mem: Mem::Owned(dst),
        })
    }

    fn copy_into(&self, src: &CudaTensor, dst: &mut CudaTensor) -> Result<()> {
        if src.shape != dst.shape || src.dtype != dst.dtype {
            return Err(BackendError::Shape {
                what: format!("copy_into ({:?} into {:?})", src.dtype, dst.dtype),
                got: src.shape.clone(),
                expected: dst.shape.clone(),
            });
        }
        let dev = self.dev();
        dev.bind()?;
        // SAFETY: both tensors hold `bytes` bytes (same shape and dtype) and are distinct
        // allocations; stream-ordered like every kernel (a memcpy node inside a capture).
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr,
                src.ptr,
                src.len() * src.dtype.size(),
                self.stream(),
            )
        }
        .map_err(|e| dev.fail("copying on the device", e))
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        let dev = self.dev();
        dev.bind()?;
        let mut bytes = vec![0u8; t.len() * t.dtype.size()];
        // SAFETY: the tensor holds that many bytes; the copy completes before `sync` returns.
        unsafe { dtoh(dev, self.stream(), &mut bytes, t.ptr)? };
        sync(dev, self.stream())?;
        Ok(HostTensor {
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &bytes,
        }
        .to_f32())
    }

    fn shape<'a>(&self, t: &'a CudaTensor) -> &'a [usize] {
        &t.shape
    }

    fn dtype(&self, t: &CudaTensor) -> DType {
        t.dtype
    }

    fn bf16_ssm_state(&self) -> bool {
        true
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| BackendError::OutOfMemory(format!("shape {shape:?} overflows")))?;
        self.dev().bind()?;
        let buf = Arc::new(DevAlloc::new(self.dev(), n, &self.inner.stats)?);
        self.memset_zero(buf.ptr, n)?;
        sync(self.dev(), self.stream())?;
        Ok(CudaTensor {
            ptr: buf.ptr,
            shape: shape.to_vec(),
            dtype,
            mem: Mem::Owned(buf),
        })
    }

    fn fill_dummy(&self, t: &mut CudaTensor, seed: u64, std: f32, mean: f32) -> Result<()> {
        let n = t.len() as u64;
        if std == 0.0 {
            self.launch(
                "fill",
                t.dtype,
                grid_for(n, self.sm_count()),
                &[Arg::Ptr(t.ptr), Arg::U64(n), Arg::F32(mean)],
            )?;
        } else {
            self.launch(
                "fill_random",
                t.dtype,
                grid_for(n, self.sm_count()),
                &[Arg::Ptr(t.ptr), Arg::U64(n), Arg::U64(seed), Arg::F32(std)],
            )?;
        }
        sync(self.dev(), self.stream())
    }
}

impl LayerOps for CudaBackend {
    type Step = CudaStep;

    fn set_ssm_chunk_size(&self, chunk: usize) {
        self.inner
            .device
            .ssm_chunk
            .store(chunk as u32, Ordering::Relaxed);
    }

    fn zeros_like(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let t = self.tmp(&x.shape, x.dtype)?;
        self.memset_zero(t.ptr, t.len() * t.dtype.size())?;
        Ok(t)
    }

    fn embedding(&self, table: &CudaTensor, step: &CudaStep) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.gather_rows(table, step.col(step.cols.tokens), step.dims.tokens)
    }

    fn linear(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let (n, k) = x.rows_cols();
        let (m, wk) = w.rows_cols();
        if wk != k {
            return Err(shape_err("linear weight", &w.shape, vec![m, k]));
        }
        if let Some(b) = bias
            && b.len() != m
        {
            return Err(shape_err("linear bias", &b.shape, vec![m]));
        }
        self.check_dtype("linear input", x)?;
        self.check_dtype("linear weight", w)?;
        if let Some(mut outs) = self.try_gemv(x, &[(w, bias)], GemvMode::Plain, Activation::Silu)? {
            return Ok(outs.pop().expect("one segment"));
        }
        let out = self.tmp(&[n, m], x.dtype)?;
        self.inner.gemm.linear(
            self.stream(),
            x.dtype,
            x.ptr,
            w.ptr,
            bias.map(|b| b.ptr),
            out.ptr,
            (n, k, m),
        )?;
        Ok(out)
    }

    fn linear_shared(
        &self,
        x: &CudaTensor,
        weights: &[(&CudaTensor, Option<&CudaTensor>)],
    ) -> Result<Vec<CudaTensor>> {
        if self.gemv_inputs_fit(x, weights)
            && let Some(outs) = self.try_gemv(x, weights, GemvMode::Plain, Activation::Silu)?
        {
            return Ok(outs);
        }
        weights.iter().map(|(w, b)| self.linear(x, w, *b)).collect()
    }

    fn gated_linear(
        &self,
        x: &CudaTensor,
        gate: (&CudaTensor, Option<&CudaTensor>),
        up: (&CudaTensor, Option<&CudaTensor>),
        act: Activation,
    ) -> Result<CudaTensor> {
        let weights = [gate, up];
        if self.gemv_inputs_fit(x, &weights)
            && let Some(mut outs) = self.try_gemv(x, &weights, GemvMode::Gated, act)?
        {
            return Ok(outs.pop().expect("one output"));
        }
        let [g, u] = <[CudaTensor; 2]>::try_from(self.linear_shared(x, &weights)?)
            .map_err(|_| BackendError::Invalid("linear_shared: not two outputs".into()))?;
        self.gated_activation(&g, &u, act)
    }

    fn linear_activated(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        if self.gemv_inputs_fit(x, &[(w, bias)])
            && let Some(mut outs) = self.try_gemv(x, &[(w, bias)], GemvMode::Activated, act)?
        {
            return Ok(outs.pop().expect("one output"));
        }
        let mut y = self.linear(x, w, bias)?;
        self.activate(&mut y, act)?;
        Ok(y)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        if x.shape != y.shape || x.dtype != y.dtype {
            return Err(shape_err("add", &y.shape, x.shape.clone()));
        }
        let n = x.len() as u64;
        self.launch(
            "add_assign",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::U64(n)],
        )
    }

    fn scale_assign(&self, x: &mut CudaTensor, s: f32) -> Result<()> {
        let n = x.len() as u64;
        self.launch(
            "scale_assign",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::U64(n), Arg::F32(s)],
        )
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        let (rows, cols) = x.rows_cols();
        if w.len() != cols {
            return Err(shape_err("rms_norm weight", &w.shape, vec![cols]));
        }
        let out = self.tmp(&x.shape, x.dtype)?;
        self.launch(
            "rms_norm",
            x.dtype,
            rows as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(w.ptr),
                Arg::U32(cols as u32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaTensor,
        delta: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, cols) = residual.rows_cols();
        if delta.shape != residual.shape || w.len() != cols {
            return Err(shape_err(
                "add_rms_norm",
                &delta.shape,
                residual.shape.clone(),
            ));
        }
        let out = self.tmp(&residual.shape, residual.dtype)?;
        self.launch(
            "add_rms_norm",
            residual.dtype,
            rows as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(residual.ptr),
                Arg::Ptr(delta.ptr),
                Arg::Ptr(w.ptr),
                Arg::U32(cols as u32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    fn gated_rms_norm(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        w: &CudaTensor,
        group: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        if gate.shape != x.shape {
            return Err(shape_err(
                "gated_rms_norm gate",
                &gate.shape,
                x.shape.clone(),
            ));
        }
        let out = self.gate_norm_cols(
            Cols::all(x),
            Cols::all(gate),
            Some(w),
            group,
            eps,
            GateNorm::GateThenNorm,
        )?;
        Ok(out.reshaped(&x.shape))
    }

    fn activate(&self, x: &mut CudaTensor, act: Activation) -> Result<()> {
        let n = x.len() as u64;
        self.launch(
            "activate",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::U64(n), Arg::U32(act_code(act))],
        )
    }

    fn gated_activation(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        act: Activation,
    ) -> Result<CudaTensor> {
        if gate.shape != up.shape {
            return Err(shape_err("gated_activation", &up.shape, gate.shape.clone()));
        }
        let out = self.tmp(&gate.shape, gate.dtype)?;
        let n = out.len() as u64;
        self.launch(
            "act_mul",
            gate.dtype,
            grid_for(n, self.sm_count()),
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(gate.ptr),
                Arg::Ptr(up.ptr),
                Arg::U64(n),
                Arg::U32(act_code(act)),
            ],
        )?;
        Ok(out)
    }

    fn split_cols<const N: usize>(
        &self,
        x: &CudaTensor,
        widths: [usize; N],
    ) -> Result<[CudaTensor; N]> {
        let (rows, cols) = x.rows_cols();
        if widths.iter().sum::<usize>() != cols {
            return Err(BackendError::Invalid(format!(
                "split widths {widths:?} do not sum to {cols} columns"
            )));
        }
        let mut parts = Vec::with_capacity(N);
        let mut start = 0;
        for &w in &widths {
            let p = self.tmp(&[rows, w], x.dtype)?;
            let n = (rows * w) as u64;
            self.launch(
                "copy_cols",
                x.dtype,
                grid_for(n, self.sm_count()),
                &[
                    Arg::Ptr(p.ptr),
                    Arg::Ptr(x.ptr),
                    Arg::U32(rows as u32),
                    Arg::U32(w as u32),
                    Arg::U32(cols as u32),
                    Arg::U32(start as u32),
                ],
            )?;
            start += w;
            parts.push(p);
        }
        parts
            .try_into()
            .map_err(|_| BackendError::Invalid("split_cols arity".into()))
    }

    fn gather_logit_rows(&self, x: &CudaTensor, step: &CudaStep) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.gather_rows(x, step.col(step.cols.logit_rows), step.dims.logit_rows)
    }

    fn apply_rope(
        &self,
        x: &mut CudaTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        let (n, cols) = x.rows_cols();
        if cols != heads * head_dim || n != step.dims.tokens || rope.rotary_dim > head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: x {:?}, {heads} heads × {head_dim}, {} positions",
                x.shape, step.dims.tokens
            )));
        }
        let table = self.rope_table(rope)?;
        self.launch(
            "rope",
            x.dtype,
            n as u32,
            &[
                Arg::Ptr(x.ptr),
                Arg::U32(n as u32),
                Arg::U32(heads as u32),
                Arg::U32(head_dim as u32),
                Arg::U32((rope.rotary_dim / 2) as u32),
                Arg::Ptr(step.col(step.cols.positions)),
                Arg::Ptr(table),
                Arg::F32(rope.attention_scaling),
                Arg::U32(cols as u32),
            ],
        )
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.check_attention(q, k, v, cache, shape, step)?;
        let n = step.dims.tokens;
        let kv_width = shape.kv_heads * shape.head_dim;
        self.launch(
            "kv_write",
            q.dtype,
            n as u32,
            &[
                Arg::Ptr(cache.k.ptr),
                Arg::Ptr(cache.v.ptr),
                Arg::Ptr(k.ptr),
                Arg::Ptr(v.ptr),
                Arg::Ptr(step.col(step.cols.slot_mapping)),
                Arg::U32(n as u32),
                Arg::U32(kv_width as u32),
                Arg::U64(cache_rows(cache)),
            ],
        )?;
        self.attend(q, cache, shape, step)
    }

    fn rope_paged_attention(
        &self,
        q: CudaTensor,
        k: CudaTensor,
        v: &CudaTensor,
        cache: &mut KvLayer<CudaTensor>,
        shape: AttnShape,
        rope: &Rope,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.check_attention(&q, &k, v, cache, shape, step)?;
        if rope.rotary_dim > shape.head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: rotary dim {} > head dim {}",
                rope.rotary_dim, shape.head_dim
            )));
        }
        let n = step.dims.tokens;
        let table = self.rope_table(rope)?;
        self.launch(
            "rope_kv_write",
            q.dtype,
            n as u32,
            &[
                Arg::Ptr(cache.k.ptr),
                Arg::Ptr(cache.v.ptr),
                Arg::Ptr(k.ptr),
                Arg::Ptr(v.ptr),
                Arg::Ptr(step.col(step.cols.slot_mapping)),
                Arg::U32(n as u32),
                Arg::U32(shape.kv_heads as u32),
                Arg::U32(shape.head_dim as u32),
                Arg::U32((rope.rotary_dim / 2) as u32),
                Arg::Ptr(step.col(step.cols.positions)),
                Arg::Ptr(table),
                Arg::F32(rope.attention_scaling),
                Arg::U64(cache_rows(cache)),
                Arg::Ptr(q.ptr),
                Arg::U32(shape.heads as u32),
            ],
        )?;
        self.attend(&q, cache, shape, step)
    }

    fn ssm_slot_ops(&self, pools: &mut SsmPools<CudaTensor>, step: &CudaStep) -> Result<()> {
        self.step_ready(step)?;
        if step.ssm.ops() == 0 {
            return Ok(());
        }
        self.check_pools(pools, step, false)?;
        // Raw 4-byte words per slot: the SSM pool may be stored as bf16.
        let per_slot = |t: &CudaTensor| (t.bytes() / 4 / pools.slots.max(1)) as u64;
        let dims = ssm::PoolDims {
            slots: pools.slots as u32,
            conv_per_slot: per_slot(&pools.conv),
            ssm_per_slot: per_slot(&pools.ssm),
        };
        let launches = ssm::launches_slot_ops(&step.ssm, dims);
        self.run_ssm(launches, step, pools, &SsmTensors::default(), &[])
    }

    fn causal_conv1d(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let out = self.conv_cols(Cols::all(x), weight, bias, pools, layer, step)?;
        Ok(out.reshaped(&x.shape))
    }

    fn ssm_scan(
        &self,
        x: &CudaTensor,
        b: &CudaTensor,
        c: &CudaTensor,
        dt: &CudaTensor,
        a_log: &CudaTensor,
        d: &CudaTensor,
        dt_bias: &CudaTensor,
        shape: SsmShape,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let cols = [x, b, c, dt].map(Cols::all);
        let out = self.scan_cols(cols, a_log, d, dt_bias, shape, pools, layer, step)?;
        Ok(out.reshaped(&x.shape))
    }

    fn mamba2_mix(
        &self,
        zxbcdt: &CudaTensor,
        m: &Mamba2Mix<'_, CudaTensor>,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.mamba2_mix_in_place(zxbcdt, m, pools, layer, step)
    }

    // Gated DeltaNet models (Qwen3-Next, Qwen3.5) run on the CPU backend for now. What the
    // kernels need: a per-head RMS norm with a [head_dim] weight; a sigmoid gate with row
    // broadcast; and the gated delta rule — the recurrent step for decode rows (state [v_heads,
    // k_dim, v_dim] per slot in `pools.ssm`, updated in place) and a chunked scan for prompt
    // rows (per chunk: a triangular solve for the deltas, then outputs and the carried state;
    // snapshot targets cut chunks like the Mamba2 scan does), reading the step's sequence
    // offsets, slots and snapshot targets.
    fn head_rms_norm(
        &self,
        _x: &CudaTensor,
        _w: &CudaTensor,
        _head_dim: usize,
        _eps: f32,
    ) -> Result<CudaTensor> {
        Err(unsupported_yet(
            "head_rms_norm (per-head q/k norms of gated attention)",
        ))
    }

    fn sigmoid_gate(&self, _x: &mut CudaTensor, _gate: &CudaTensor) -> Result<()> {
        Err(unsupported_yet(
            "sigmoid_gate (gated attention, shared-expert gate)",
        ))
    }

    fn gated_delta_rule(
        &self,
        _q: &CudaTensor,
        _k: &CudaTensor,
        _v: &CudaTensor,
        _a: &CudaTensor,
        _b: &CudaTensor,
        _a_log: &CudaTensor,
        _dt_bias: &CudaTensor,
        _shape: GdnShape,
        _pools: &mut SsmPools<CudaTensor>,
        _layer: usize,
        _step: &CudaStep,
    ) -> Result<CudaTensor> {
        Err(unsupported_yet(
            "gated_delta_rule (Gated DeltaNet chunked scan and state update)",
        ))
    }

    fn moe(
        &self,
        x: &CudaTensor,
        router_logits: &CudaTensor,
        routing: &MoeRouting<CudaTensor>,
        experts: &StackedExperts<CudaTensor>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let dims = self.moe_dims(x, router_logits, routing, experts, out)?;
        if dims.tokens == 0 {
            return Ok(());
        }
        let routed = self.route_on_device(router_logits, routing)?;
        self.moe_grouped(x, &routed, experts, dims, out)
    }
}

impl StepBackend for CudaBackend {
    fn new_step(&self, max_tokens: usize) -> Result<CudaStep> {
        self.inner
            .arena
            .max_rows
            .fetch_max(max_tokens.max(1), Ordering::Relaxed);
        let mut step = CudaStep::new();
        step.ssm_chunk = self.inner.device.ssm_chunk.load(Ordering::Relaxed);
        // Allocated now: a replica whose first steps all replay graphs would otherwise make
        // the first allocation of its eager step object long into serving.
        step.reserve(self.dev(), &self.inner.stats, step::MIN_STEP_BYTES)?;
        Ok(step)
    }

    /// Decode buckets of 1 to 256 sequences (powers of two up to the batch's); mixed buckets
    /// of every [`MIXED_TOKEN_STEP`] tokens up to [`MIXED_MAX_TOKENS`] (and the step's budget),
    /// each with a power of two of decodes up to half the tokens and each count of
    /// [`MIXED_PROMPTS`] prompt chunks.
    fn graph_buckets(&self, max_batch: usize, max_tokens: usize) -> Vec<GraphBucket> {
        let decodes = || {
            GRAPH_BUCKETS
                .iter()
                .copied()
                .filter(move |&b| b <= max_batch.next_power_of_two())
        };
        let mut out: Vec<GraphBucket> =
            decodes().map(|seqs| GraphBucket::Decode { seqs }).collect();
        let top = MIXED_MAX_TOKENS.min(max_tokens.next_multiple_of(MIXED_TOKEN_STEP));
        for tokens in (MIXED_TOKEN_STEP..=top).step_by(MIXED_TOKEN_STEP) {
            for prompts in MIXED_PROMPTS {
                out.extend(decodes().filter(|&d| d <= tokens / 2).map(|decodes| {
                    GraphBucket::Mixed {
                        tokens,
                        decodes,
                        prompts,
                    }
                }));
            }
        }
        out
    }

    fn upload_graph_step(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: GraphBucket,
        max_blocks: usize,
    ) -> Result<bool> {
        match bucket {
            GraphBucket::Decode { seqs } => self.upload_graph_shaped(
                plan,
                step,
                seqs,
                step::GraphShape::splits_for(seqs),
                max_blocks,
            ),
            GraphBucket::Mixed { .. } => {
                if !self.pack_for(plan, step, Some(bucket), max_blocks, false)? {
                    return Ok(false);
                }
                self.send(step)?;
                Ok(true)
            }
        }
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

    fn send_step(&self, step: &mut CudaStep) -> Result<()> {
        self.send(step)
    }

    fn step_clock_start(&self) -> Result<()> {
        self.dev().bind()?;
        let mut clock = self.clock()?;
        if let Some(c) = clock.as_mut() {
            // The start is recorded with the step's first device operation (its upload).
            c.timing = true;
            c.started = false;
            c.ended = false;
        }
        Ok(())
    }

    fn step_clock_end(&self) -> Result<Option<DeviceStepTime>> {
        let dev = self.dev();
        let mut clock = self.inner.clock.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = clock.as_mut() else {
            return Ok(None);
        };
        let timed = c.timing && c.started && c.ended;
        c.timing = false;
        if !timed {
            return Ok(None);
        }
        dev.bind()?;
        // SAFETY: events of this context, all recorded and complete (the read-back waited
        // for `end`, the last of them).
        let ms = |a, b| {
            unsafe { result::event::elapsed(a, b) }
                .map(f64::from)
                .map_err(|e| dev.fail("reading an event", e))
        };
        let busy = ms(c.start, c.end)?;
        let idle = if c.have_prev {
            ms(c.prev_end, c.start)?
        } else {
            0.0
        };
        std::mem::swap(&mut c.end, &mut c.prev_end);
        c.have_prev = true;
        Ok(Some(DeviceStepTime {
            busy_s: busy / 1e3,
            idle_before_s: idle.max(0.0) / 1e3,
        }))
    }

    fn capture_graph(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<usize> {
        let dev = self.dev();
        dev.bind()?;
        sync(dev, self.stream())?;
        // Relaxed: allocations on other threads (another replica) stay legal meanwhile.
        // SAFETY: a live stream of this context, not capturing.
        unsafe {
            result::stream::begin_capture(
                self.stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(|e| dev.fail("starting a graph capture", e))?;
        let ran = run();
        // The capture ends whatever `run` did, so the stream is usable again.
        // SAFETY: this stream is capturing (begun above).
        let graph = unsafe { result::stream::end_capture(self.stream()) };
        ran?;
        let graph = graph.map_err(|e| dev.fail("ending a graph capture", e))?;
        // SAFETY: a graph just captured; flags 0.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(exec) => exec,
                Err(e) => {
                    // SAFETY: the graph was created above and is not used again.
                    unsafe {
                        let _ = result::graph::destroy(graph);
                    }
                    return Err(dev.fail("instantiating a graph", e));
                }
            };
        let mut graphs = self.inner.graphs.lock().unwrap_or_else(|p| p.into_inner());
        graphs.push(Graph { graph, exec });
        Ok(graphs.len() - 1)
    }

    fn replay_graph(&self, id: usize) -> Result<()> {
        let dev = self.dev();
        dev.bind()?;
        let graphs = self.inner.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let g = graphs
            .get(id)
            .ok_or_else(|| BackendError::Invalid(format!("no graph {id}")))?;
        // SAFETY: an instantiated graph of this context, launched on its stream.
        unsafe { result::graph::launch(g.exec, self.stream()) }
            .map_err(|e| dev.fail("replaying a graph", e))
    }

    fn upload_step(&self, plan: &StepPlan, step: &mut CudaStep) -> Result<()> {
        self.pack_for(plan, step, None, 0, false)?;
        self.send(step)
    }

    fn arena_stats(&self) -> ArenaStats {
        ArenaStats {
            grown: self.inner.stats.arena_grown.load(Ordering::Relaxed),
            bytes: self.inner.stats.arena_bytes.load(Ordering::Relaxed),
        }
    }

    fn sample(&self, logits: &mut CudaTensor, step: &CudaStep, out: &mut SampleOut) -> Result<()> {
        self.sample_start(logits, step, out)?;
        self.sample_finish(out)
    }

    fn sample_start(
        &self,
        logits: &mut CudaTensor,
        step: &CudaStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.step_ready(step)?;
        // A read-back started earlier and never finished is waited for (its pinned buffer
        // may be replaced below) and given up.
        if let Some(p) = self.lock_pending().take() {
            memory::wait_event(self.dev(), p.done)?;
        }
        let (rows, vocab) = logits.rows_cols();
        let n = step.dims.sample_rows;
        if rows != step.dims.logit_rows {
            return Err(BackendError::Invalid(format!(
                "{rows} logits rows for {} logit rows in the step",
                step.dims.logit_rows
            )));
        }
        let k = step.dims.k.min(vocab).max(1);
        out.reshape(n, k);
        if n == 0 {
            return Ok(());
        }
        // The tail works on f32 rows; bf16 logits are widened first.
        let widened;
        let lg: &CudaTensor = if logits.dtype == DType::F32 {
            logits
        } else {
            let w = self.tmp(&logits.shape, DType::F32)?;
            let len = w.len() as u64;
            self.launch_exact(
                "cast_bf16_to_f32",
                (grid_for(len, self.sm_count()), 1, 1),
                (BLOCK, 1, 1),
                0,
                &[Arg::Ptr(w.ptr), Arg::Ptr(logits.ptr), Arg::U64(len)],
            )?;
            widened = w;
            &widened
        };
        // Results land in one buffer: tokens [n·k] u32, logits [n·k] f32, lse [n] f32.
        let words = 2 * n * k + n;
        let res = self.tmp(&[words], DType::F32)?;
        let (tok_ptr, cand_ptr, lse_ptr) = (
            res.ptr,
            res.ptr + 4 * (n * k) as u64,
            res.ptr + 8 * (n * k) as u64,
        );
        let scratch: Vec<CudaTensor> = chimera_kernels::sample::scratch_bytes(n, vocab, k)
            .into_iter()
            .map(|b| self.tmp(&[b.div_ceil(4).max(1)], DType::F32))
            .collect::<Result<_>>()?;
        let c = &step.cols;
        for l in chimera_kernels::sample::launches(n, vocab, k) {
            let args: Vec<Arg> = l
                .args
                .iter()
                .map(|a| {
                    Ok(match *a {
                        SampleArg::Logits => Arg::Ptr(lg.ptr),
                        SampleArg::SampleRows => Arg::Ptr(step.col(c.sample_rows)),
                        SampleArg::Repetition => Arg::Ptr(step.col(c.repetition)),
                        SampleArg::Presence => Arg::Ptr(step.col(c.presence)),
                        SampleArg::Frequency => Arg::Ptr(step.col(c.frequency)),
                        SampleArg::WantLse => Arg::Ptr(step.col(c.want_lse)),
                        SampleArg::HistOffsets => Arg::Ptr(step.col(c.hist_offsets)),
                        SampleArg::HistTokens => Arg::Ptr(step.col(c.hist_tokens)),
                        SampleArg::HistCounts => Arg::Ptr(step.col(c.hist_counts)),
                        SampleArg::HistBias => Arg::Ptr(step.col(c.hist_bias)),
                        SampleArg::CandTokens => Arg::Ptr(tok_ptr),
                        SampleArg::CandLogits => Arg::Ptr(cand_ptr),
                        SampleArg::Lse => Arg::Ptr(lse_ptr),
                        SampleArg::Scratch(i) => Arg::Ptr(
                            scratch
                                .get(i)
                                .ok_or_else(|| {
                                    BackendError::Invalid(format!("sampling scratch {i}"))
                                })?
                                .ptr,
                        ),
                        SampleArg::U32(v) => Arg::U32(v),
                    })
                })
                .collect::<Result<_>>()?;
            self.launch_exact(l.entry, l.grid, l.block, l.smem, &args)?;
        }
        // Penalties were applied to the f32 copy; keep the caller's rows in step with them.
        if logits.dtype != DType::F32 {
            let len = lg.len() as u64;
            self.launch_exact(
                "cast_f32_to_bf16",
                (grid_for(len, self.sm_count()), 1, 1),
                (BLOCK, 1, 1),
                0,
                &[Arg::Ptr(logits.ptr), Arg::Ptr(lg.ptr), Arg::U64(len)],
            )?;
        }
        // The step's one device-to-host copy; `sample_finish` waits for it.
        let bytes = 4 * words;
        let mut rb = self
            .inner
            .readback
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if rb.as_ref().is_none_or(|p| p.bytes < bytes) {
            *rb = Some(Pinned::new(self.dev(), bytes.next_power_of_two())?);
        }
        let Some(pinned) = rb.as_mut() else {
            return Err(bad_tensor("readback"));
        };
        let dst = &mut pinned.as_mut_slice()[..bytes];
        // SAFETY: `res` holds `bytes`; the pinned buffer is only replaced by a later
        // `sample_start`, which first waits for this read-back.
        unsafe { dtoh(self.dev(), self.stream(), dst, res.ptr)? };
        let done = self.record_step_end()?;
        *self.lock_pending() = Some(PendingRead { rows: n, k, done });
        Ok(())
    }

    fn sample_ready(&self) -> bool {
        self.lock_pending()
            .as_ref()
            .is_none_or(|p| memory::event_done(p.done))
    }

    fn sample_finish(&self, out: &mut SampleOut) -> Result<()> {
        let Some(p) = self.lock_pending().take() else {
            return Ok(());
        };
        memory::poll_event(self.dev(), p.done)?;
        let (n, k) = (p.rows, p.k);
        if out.cand_tokens.len() != n * k || out.lse.len() != n {
            return Err(BackendError::Invalid(format!(
                "finishing a read-back of {n} rows of {k} into columns of another shape"
            )));
        }
        let rb = self
            .inner
            .readback
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(pinned) = rb.as_ref() else {
            return Err(bad_tensor("readback"));
        };
        let src = &pinned.as_slice()[..4 * (2 * n * k + n)];
        let (tokens, rest) = src.split_at(4 * n * k);
        let (logits, lse) = rest.split_at(4 * n * k);
        memory::read_words(tokens, &mut out.cand_tokens, |w| w);
        memory::read_words(logits, &mut out.cand_logits, f32::from_bits);
        memory::read_words(lse, &mut out.lse, f32::from_bits);
        Ok(())
    }
}

/// Device addresses of one SSM operation's tensors (0 where the operation has none).
#[derive(Debug, Default, Clone, Copy)]
struct SsmTensors {
    x: u64,
    b: u64,
    c: u64,
    dt: u64,
    a_log: u64,
    d: u64,
    dt_bias: u64,
    weight: u64,
    bias: u64,
    out: u64,
}

impl CudaBackend {
    /// Checks the pools, and (for the conv and the scan) that the step's scan chunks were
    /// planned: slot operations need no chunk size.
    fn check_pools(&self, pools: &SsmPools<CudaTensor>, step: &CudaStep, scan: bool) -> Result<()> {
        if scan && step.ssm_chunk == 0 {
            return Err(BackendError::Invalid(
                "SSM operation on a step planned without an SSD chunk size \
                 (LayerOps::set_ssm_chunk_size was not called when the model loaded)"
                    .into(),
            ));
        }
        // The conv state is f32; the recurrent state f32 or (opt-in) bf16, an even number of
        // elements per slot so that the slot ops move whole 4-byte words.
        for (what, t, bf16_ok) in [("conv", &pools.conv, false), ("ssm", &pools.ssm, true)] {
            let dtype_ok = t.dtype == DType::F32 || (bf16_ok && t.dtype == DType::BF16);
            if !dtype_ok
                || t.bytes() % (4 * pools.slots.max(1)) != 0
                || t.shape.first() != Some(&pools.slots)
                || t.shape.get(1) != Some(&pools.layers)
            {
                return Err(BackendError::Invalid(format!(
                    "{what} pool {:?} {:?} is not {} [{} slots, {} layers, …]",
                    t.dtype,
                    t.shape,
                    if bf16_ok { "f32 or bf16" } else { "f32" },
                    pools.slots,
                    pools.layers
                )));
            }
        }
        Ok(())
    }

    /// Launches an SSM planner's kernels, mapping its symbolic arguments.
    fn run_ssm(
        &self,
        launches: Vec<chimera_kernels::Launch<ssm::SsmArg>>,
        step: &CudaStep,
        pools: &SsmPools<CudaTensor>,
        t: &SsmTensors,
        scratch: &[CudaTensor],
    ) -> Result<()> {
        use ssm::SsmArg as A;
        for l in launches {
            let args: Vec<Arg> = l
                .args
                .iter()
                .map(|a| {
                    Ok(match *a {
                        A::X => Arg::Ptr(t.x),
                        A::B => Arg::Ptr(t.b),
                        A::C => Arg::Ptr(t.c),
                        A::Dt => Arg::Ptr(t.dt),
                        A::ALog => Arg::Ptr(t.a_log),
                        A::D => Arg::Ptr(t.d),
                        A::DtBias => Arg::Ptr(t.dt_bias),
                        A::Weight => Arg::Ptr(t.weight),
                        A::Bias => Arg::Ptr(t.bias),
                        A::Out => Arg::Ptr(t.out),
                        A::ConvPool => Arg::Ptr(pools.conv.ptr),
                        A::SsmPool => Arg::Ptr(pools.ssm.ptr),
                        A::Work(c) => Arg::Ptr(step.ssm_col(c)),
                        A::Scratch(i) => Arg::Ptr(
                            scratch
                                .get(i)
                                .ok_or_else(|| BackendError::Invalid(format!("SSM scratch {i}")))?
                                .ptr,
                        ),
                        A::U32(v) => Arg::U32(v),
                        A::U64(v) => Arg::U64(v),
                        A::F32(v) => Arg::F32(v),
                    })
                })
                .collect::<Result<_>>()?;
            self.launch_exact(l.entry, l.grid, l.block, l.smem, &args)?;
        }
        Ok(())
    }

    /// `out[r] = x[rows[r]]` for the `n` row indices at device address `rows` (a step
    /// column); an index outside `x` gives a NaN row, never a silent wrong one.
    fn gather_rows(&self, x: &CudaTensor, rows: u64, n: usize) -> Result<CudaTensor> {
        let (n_in, cols) = x.rows_cols();
        let out = self.tmp(&[n, cols], x.dtype)?;
        self.launch(
            "gather_rows",
            x.dtype,
            n as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(rows),
                Arg::U32(n as u32),
                Arg::U32(cols as u32),
                Arg::U32(n_in as u32),
            ],
        )?;
        Ok(out)
    }

    fn check_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            ..
        } = shape;
        let n = step.dims.tokens;
        let kv_width = kv_heads * head_dim;
        if q.rows_cols() != (n, heads * head_dim)
            || k.rows_cols() != (n, kv_width)
            || v.rows_cols() != (n, kv_width)
            || heads % kv_heads.max(1) != 0
            || cache.k.shape.len() != 4
            || cache.k.shape[2] * cache.k.shape[3] != kv_width
            || cache.v.shape != cache.k.shape
        {
            return Err(BackendError::Invalid(format!(
                "attention inputs q {:?} k {:?} v {:?} cache {:?} do not match {heads}q/{kv_heads}kv × {head_dim} over {n} tokens",
                q.shape, k.shape, v.shape, cache.k.shape
            )));
        }
        for t in [q, k, v, &cache.k, &cache.v] {
            self.check_dtype("attention", t)?;
        }
        Ok(())
    }

    /// Attention of every query over its sequence's cached keys (this step's already written).
    fn attend(
        &self,
        q: &CudaTensor,
        cache: &KvLayer<CudaTensor>,
        shape: AttnShape,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            scale,
        } = shape;
        let out = self.tmp(&q.shape, q.dtype)?;
        let dims = AttnDims {
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            block_size: step.dims.block_size as u32,
            num_seqs: step.dims.seqs as u32,
        };
        let bf16 = q.dtype == DType::BF16;
        let attn_err =
            |e: chimera_kernels::attention::AttnError| BackendError::Invalid(e.to_string());
        let launches =
            chimera_kernels::attention::launches(&step.attn, dims, bf16, self.prefill_kernel())
                .map_err(attn_err)?;
        let scratch: Vec<CudaTensor> = chimera_kernels::attention::scratch_bytes(&step.attn, dims)
            .into_iter()
            .map(|b| self.tmp(&[b.div_ceil(4).max(1)], DType::F32))
            .collect::<Result<_>>()?;
        for l in launches {
            let args: Vec<Arg> = l
                .args
                .iter()
                .map(|a| {
                    Ok(match *a {
                        AttnArg::Q => Arg::Ptr(q.ptr),
                        AttnArg::KCache => Arg::Ptr(cache.k.ptr),
                        AttnArg::VCache => Arg::Ptr(cache.v.ptr),
                        AttnArg::Out => Arg::Ptr(out.ptr),
                        AttnArg::CuSeqlens => Arg::Ptr(step.col(step.cols.cu_seqlens)),
                        AttnArg::CtxLens => Arg::Ptr(step.col(step.cols.ctx_lens)),
                        AttnArg::BtOffsets => Arg::Ptr(step.col(step.cols.bt_offsets)),
                        AttnArg::BlockTables => Arg::Ptr(step.col(step.cols.block_tables)),
                        AttnArg::Work(c) => Arg::Ptr(step.attn_col(c)),
                        AttnArg::Scratch(i) => Arg::Ptr(
                            scratch
                                .get(i)
                                .ok_or_else(|| {
                                    BackendError::Invalid(format!("attention scratch {i}"))
                                })?
                                .ptr,
                        ),
                        AttnArg::U32(v) => Arg::U32(v),
                        AttnArg::F32Scale => Arg::F32(scale),
                    })
                })
                .collect::<Result<_>>()?;
            self.launch_exact(l.entry, l.grid, l.block, l.smem, &args)?;
        }
        Ok(out)
    }
}

fn cache_rows(cache: &KvLayer<CudaTensor>) -> u64 {
    (cache.k.shape[0] * cache.k.shape[1]) as u64
}

/// An f32 slice's bit patterns as u32 (same size and alignment; no copy).
fn f32_bits(v: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is a valid u32.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u32>(), v.len()) }
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

/// The error of an operation the CUDA backend does not have yet (the model runs on `cpu`).
fn unsupported_yet(what: &str) -> BackendError {
    BackendError::Invalid(format!(
        "{what} is not supported on CUDA yet; run this model with engine.backend = \"cpu\""
    ))
}
