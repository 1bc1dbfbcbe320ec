//! One CUDA device as the backend uses it: the context (cudarc, loaded dynamically, event
//! tracking off before any allocation), the compiled kernel modules, and launches checked
//! against the kernel crate's entry tables.
//!
//! Everything here is raw driver calls through `cudarc::driver::result`: the backend manages
//! its own memory ([`super::memory`]) and passes device pointers as kernel arguments, so the
//! launch code is the same for weights, caches and arena temporaries.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use chimera_kernels::attention::PrefillKernel;
use chimera_kernels::{Entry, KernelCache, Param};
use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::backend::{BackendError, Result};

/// Why no usable CUDA device is there, with what to do about it.
pub fn probe_error(ordinal: usize) -> Option<String> {
    // SAFETY: probing for the shared library has no preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Some(
            "no CUDA driver (libcuda.so) was found: install the NVIDIA driver, or set \
             engine.backend = \"cpu\""
                .into(),
        );
    }
    if let Err(e) = result::init() {
        return Some(format!(
            "the CUDA driver failed to initialise ({e:?}): check `nvidia-smi`, or set engine.backend = \"cpu\""
        ));
    }
    match result::device::get_count() {
        Ok(n) if (n as usize) > ordinal => None,
        Ok(n) => Some(format!(
            "CUDA device {ordinal} does not exist ({n} visible): fix engine.devices or CUDA_VISIBLE_DEVICES"
        )),
        Err(e) => Some(format!("counting CUDA devices failed: {e:?}")),
    }
}

pub(crate) fn dev_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

/// A loaded kernel: its driver handle and its declared parameters.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub func: sys::CUfunction,
    pub entry: &'static Entry,
}

// SAFETY: CUfunction handles are valid from any thread once the module is loaded.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// A kernel argument; its kind must match the entry's declared parameter.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Arg {
    fn kind(&self) -> Param {
        match self {
            Arg::Ptr(_) => Param::Ptr,
            Arg::U32(_) => Param::U32,
            Arg::I32(_) => Param::I32,
            Arg::U64(_) => Param::U64,
            Arg::F32(_) => Param::F32,
        }
    }
}

/// The prefill attention kernel where the device built Hopper's (`attention_sm90.cu`, `sm_90a`).
const DEFAULT_PREFILL: PrefillKernel = PrefillKernel::WgmmaPingPong;

/// A device: context, modules and facts about it.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub ordinal: usize,
    pub name: String,
    /// `sm_90a`-style NVRTC target.
    pub arch: String,
    pub sm_count: u32,
    kernels: HashMap<&'static str, Kernel>,
    modules: Vec<sys::CUmodule>,
    /// Set by the first error that leaves the context unusable (an illegal address, a
    /// launch failure): the replica is out of service from then on.
    pub(crate) sticky: AtomicBool,
    /// The SSD chunk size of the model's Mamba2 layers (0: none), set at model load.
    pub(crate) ssm_chunk: std::sync::atomic::AtomicU32,
    /// Steps whose Mamba2 prompts are all at most this long scan them token by token
    /// (`ssm::recurrent_prompts`; 0: never): `CHIMERA_SSM_RECURRENT_TOKENS` at start, else
    /// `ssm::RECURRENT_TOKENS`; switchable so the bench can time both paths in one run.
    pub(crate) ssm_recurrent_tokens: std::sync::atomic::AtomicU32,
    /// Launch kernels with programmatic stream serialization (see [`Device::launch`]).
    pdl: AtomicBool,
    /// The d = 128 prefill attention kernel, a [`PrefillKernel`] as u8 (see
    /// [`Device::set_prefill_kernel`]).
    prefill: AtomicU8,
    /// Per-operation device time, while switched on ([`Device::profile_start`]).
    profiling: AtomicBool,
    profile: Mutex<Vec<(&'static str, sys::CUevent, sys::CUevent)>>,
}

/// Device time of one kind of operation over a profiled stretch of launches.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The kernel entry's name (`cublasLt` for cuBLASLt matmuls).
    pub name: &'static str,
    pub calls: usize,
    pub ms: f64,
}

// SAFETY: module handles are only unloaded in Drop; the context is bound per thread before use.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for &m in &self.modules {
                // SAFETY: each module was loaded once by this device and is unloaded once.
                unsafe {
                    let _ = result::module::unload(m);
                }
            }
        }
    }
}

impl Device {
    /// Opens device `ordinal`, turns event tracking off (before any allocation: graph capture
    /// needs it) and loads every kernel, compiling what the on-disk cache lacks.
    pub fn open(ordinal: usize, cache: &KernelCache) -> Result<Arc<Self>> {
        if let Some(why) = probe_error(ordinal) {
            return Err(BackendError::Device(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating the CUDA context", e))?;
        // SAFETY: the backend synchronises its one stream itself; no cudarc-managed slices
        // cross streams.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| dev_err("reading the compute capability", e))?;
        if major < 8 {
            return Err(BackendError::Device(format!(
                "GPU compute capability {major}.{minor} is too old: chimera's CUDA kernels need \
                 sm_80 or newer (Ampere, Hopper); set engine.backend = \"cpu\""
            )));
        }
        // Hopper-only instructions (wgmma) need the `a` target.
        let arch = if major == 9 {
            format!("sm_{major}{minor}a")
        } else {
            format!("sm_{major}{minor}")
        };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| dev_err("reading the SM count", e))? as u32;
        let (kernels, modules) = load_kernels(cache, &arch)?;
        raise_shared_memory(&kernels, &arch)?;
        // Hopper's wgmma kernel where it was built, unless CHIMERA_WGMMA=0.
        let prefill = if kernels.contains_key(DEFAULT_PREFILL.entry())
            && std::env::var("CHIMERA_WGMMA").map_or(true, |v| v != "0")
        {
            DEFAULT_PREFILL
        } else {
            PrefillKernel::MmaSync
        };
        Ok(Arc::new(Self {
            ctx,
            ordinal,
            name,
            arch,
            sm_count,
            kernels,
            modules,
            sticky: AtomicBool::new(false),
            ssm_chunk: std::sync::atomic::AtomicU32::new(0),
            ssm_recurrent_tokens: std::sync::atomic::AtomicU32::new(
                crate::config::env_knob("CHIMERA_SSM_RECURRENT_TOKENS")
                    .unwrap_or(chimera_kernels::ssm::RECURRENT_TOKENS),
            ),
            // Programmatic dependent launch exists from compute capability 9.0 on.
            pdl: AtomicBool::new(
                major >= 9 && std::env::var("CHIMERA_PDL").map_or(true, |v| v != "0"),
            ),
            prefill: AtomicU8::new(prefill as u8),
            profiling: AtomicBool::new(false),
            profile: Mutex::new(Vec::new()),
        }))
    }

    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        self.kernels
            .get(name)
            .copied()
            .ok_or_else(|| BackendError::Device(format!("no kernel named {name}")))
    }

    pub fn bind(&self) -> Result<()> {
        if self.sticky.load(Ordering::Relaxed) {
            return Err(BackendError::Device(format!(
                "CUDA device {} had an unrecoverable error earlier; this replica is out of service",
                self.ordinal
            )));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.fail("binding the CUDA context", e))
    }

    /// Maps a driver error to a backend error, marking the device out of service when the
    /// error is one a context does not survive.
    pub fn fail(&self, what: &str, e: result::DriverError) -> BackendError {
        use sys::cudaError_enum as E;
        let sticky = matches!(
            e.0,
            E::CUDA_ERROR_ILLEGAL_ADDRESS
                | E::CUDA_ERROR_LAUNCH_FAILED
                | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
                | E::CUDA_ERROR_MISALIGNED_ADDRESS
                | E::CUDA_ERROR_INVALID_PC
                | E::CUDA_ERROR_HARDWARE_STACK_ERROR
                | E::CUDA_ERROR_ECC_UNCORRECTABLE
                | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        if sticky {
            self.sticky.store(true, Ordering::Relaxed);
        }
        if e.0 == E::CUDA_ERROR_OUT_OF_MEMORY {
            return BackendError::OutOfMemory(format!("{what} on CUDA device {}", self.ordinal));
        }
        BackendError::Device(format!("{what}: {e:?}"))
    }

    /// Starts timing every launch (and cuBLASLt call) on the device with an event pair, for
    /// [`Device::profile_take`]. Eager launches only: not while a graph is being captured.
    /// Costs two event records a launch while on, one relaxed load while off.
    pub fn profile_start(&self) {
        self.profiling.store(true, Ordering::Relaxed);
    }

    /// Stops timing, waits for the device and sums the device time of each operation over the
    /// timed launches, longest total first.
    pub fn profile_take(&self) -> Result<Vec<OpTime>> {
        self.profiling.store(false, Ordering::Relaxed);
        let ops = std::mem::take(&mut *self.profile.lock().unwrap_or_else(|p| p.into_inner()));
        self.bind()?;
        let synced = result::ctx::synchronize().map_err(|e| self.fail("synchronizing", e));
        let mut by_name: Vec<OpTime> = Vec::new();
        let mut failed = synced.err();
        for (name, a, b) in ops {
            if failed.is_none() {
                // SAFETY: both events were recorded on this context and the context is idle.
                match unsafe { result::event::elapsed(a, b) } {
                    Ok(ms) => match by_name.iter_mut().find(|o| o.name == name) {
                        Some(o) => {
                            o.calls += 1;
                            o.ms += f64::from(ms);
                        }
                        None => by_name.push(OpTime {
                            name,
                            calls: 1,
                            ms: f64::from(ms),
                        }),
                    },
                    Err(e) => failed = Some(self.fail("reading an event", e)),
                }
            }
            // SAFETY: each event is destroyed once, after its last use.
            unsafe {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        by_name.sort_by(|x, y| y.ms.total_cmp(&x.ms));
        Ok(by_name)
    }

    /// When profiling: records and returns the start event of an operation on `stream`.
    pub(crate) fn op_begin(&self, stream: sys::CUstream) -> Result<Option<sys::CUevent>> {
        if !self.profiling.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| self.fail("creating an event", e))?;
        // SAFETY: an event of this context, recorded on one of its streams.
        unsafe { result::event::record(ev, stream) }
            .map_err(|e| self.fail("recording an event", e))?;
        Ok(Some(ev))
    }

    /// Ends the operation `op_begin` started (nothing when it returned None).
    pub(crate) fn op_end(
        &self,
        name: &'static str,
        start: Option<sys::CUevent>,
        stream: sys::CUstream,
    ) -> Result<()> {
        let Some(start) = start else { return Ok(()) };
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| self.fail("creating an event", e))?;
        // SAFETY: as in `op_begin`.
        unsafe { result::event::record(ev, stream) }
            .map_err(|e| self.fail("recording an event", e))?;
        self.profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name, start, ev));
        Ok(())
    }

    /// Programmatic dependent launch on or off (on unless `CHIMERA_PDL=0`): what it gains is
    /// measured by turning it off.
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, Ordering::Relaxed);
    }

    /// The d = 128 bf16 prefill attention kernel for the launches from now on: by default
    /// Hopper's wgmma kernel where it was built (compute capability 9.0, `sm_90a`) unless
    /// `CHIMERA_WGMMA=0`, else `mma.sync`. A kernel this device has not built falls back to
    /// `mma.sync`. Returns the kernel now in use.
    pub fn set_prefill_kernel(&self, k: PrefillKernel) -> PrefillKernel {
        let k = if self.kernels.contains_key(k.entry()) {
            k
        } else {
            PrefillKernel::MmaSync
        };
        self.prefill.store(k as u8, Ordering::Relaxed);
        k
    }

    /// The d = 128 bf16 prefill attention kernel in use.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        let v = self.prefill.load(Ordering::Relaxed);
        PrefillKernel::ALL
            .into_iter()
            .find(|k| *k as u8 == v)
            .unwrap_or(PrefillKernel::MmaSync)
    }

    /// Launches `kernel` on `stream` after checking `args` against its declared parameters.
    ///
    /// With programmatic stream serialization (PDL, sm_90), the driver may start the kernel
    /// while the previous kernel in the stream finishes: every kernel begins with
    /// `CHIMERA_PDL_ENTRY()` (checked by the kernel crate's ABI test), which waits until its
    /// predecessors have completed and their writes are visible before touching memory. What
    /// is saved is the gap between consecutive small kernels (launch latency and block
    /// scheduling), also inside captured graphs.
    pub(crate) fn launch(
        &self,
        stream: sys::CUstream,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let params = kernel.entry.params;
        if params.len() != args.len()
            || params
                .iter()
                .zip(args)
                .any(|(p, a)| *p != a.kind() && !(*p == Param::U64 && a.kind() == Param::Ptr))
        {
            return Err(BackendError::Invalid(format!(
                "kernel {} takes {params:?}, launched with {args:?}",
                kernel.entry.name
            )));
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // Argument storage: each pointer handed to the driver points at a value here.
        let mut vals: [u64; 32] = [0; 32];
        let mut ptrs: [*mut c_void; 32] = [std::ptr::null_mut(); 32];
        if args.len() > vals.len() {
            return Err(BackendError::Invalid(format!(
                "kernel {} has too many arguments",
                kernel.entry.name
            )));
        }
        for (i, a) in args.iter().enumerate() {
            vals[i] = match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::U32(v) => u64::from(v),
                Arg::I32(v) => u64::from(v as u32),
                Arg::F32(v) => u64::from(v.to_bits()),
            };
        }
        for (i, p) in ptrs.iter_mut().enumerate().take(args.len()) {
            // 4-byte parameters read the low half of the slot (little-endian).
            *p = (&mut vals[i] as *mut u64).cast();
        }
        let timed = self.op_begin(stream)?;
        let launched = if self.pdl.load(Ordering::Relaxed) {
            launch_with_pdl(stream, kernel, grid, block, smem, &mut ptrs)
        } else {
            // SAFETY: the arguments match the kernel's declared parameters (checked above and,
            // against the PTX, by the kernel crate's ABI test); every pointer argument is a
            // live device allocation of this context owned by the caller until the stream
            // passes it.
            unsafe {
                result::launch_kernel(
                    kernel.func,
                    grid,
                    block,
                    smem,
                    stream,
                    &mut ptrs[..args.len()],
                )
            }
        };
        launched.map_err(|e| self.fail(&format!("launching {}", kernel.entry.name), e))?;
        self.op_end(kernel.entry.name, timed, stream)
    }
}

/// Launches `kernel` with programmatic stream serialization allowed: [`Device::launch`]'s
/// PDL path, `ptrs` its checked argument storage.
fn launch_with_pdl(
    stream: sys::CUstream,
    kernel: Kernel,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    ptrs: &mut [*mut c_void; 32],
) -> std::result::Result<(), DriverError> {
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        // SAFETY: an all-zero union is a valid value of every member.
        value: unsafe { std::mem::zeroed() },
    };
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as for the plain launch in `Device::launch`; `config` and `attr` outlive
    // the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            kernel.func,
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Compiles every kernel source for `arch` (what `cache` lacks) and loads it: the kernels by
/// entry name, and the modules that hold them.
fn load_kernels(
    cache: &KernelCache,
    arch: &str,
) -> Result<(HashMap<&'static str, Kernel>, Vec<sys::CUmodule>)> {
    let replaced = chimera_kernels::replaced_files();
    if !replaced.is_empty() {
        tracing::warn!(
            files = replaced.join(", "),
            "kernel sources replaced from ${}",
            chimera_kernels::SOURCES_ENV
        );
    }
    let compiled = chimera_kernels::compile_all(Some(cache), arch)
        .map_err(|e| BackendError::Device(format!("compiling the CUDA kernels for {arch}: {e}")))?;
    let mut kernels = HashMap::new();
    let mut modules = Vec::new();
    for c in &compiled {
        let source = chimera_kernels::sources()
            .iter()
            .find(|s| s.name == c.source)
            .ok_or_else(|| BackendError::Device(format!("unknown source {}", c.source)))?;
        // SAFETY: the image is a CUBIN NVRTC produced for this device's architecture.
        let module = unsafe { result::module::load_data(c.cubin.as_ptr().cast()) }
            .map_err(|e| dev_err(&format!("loading {}", c.source), e))?;
        modules.push(module);
        for entry in source.entries {
            let cname = std::ffi::CString::new(entry.name)
                .map_err(|_| BackendError::Device("kernel name".into()))?;
            // SAFETY: the module is loaded; the name is NUL-terminated.
            let func = unsafe { result::module::get_function(module, cname) }
                .map_err(|e| dev_err(&format!("finding kernel {}", entry.name), e))?;
            kernels.insert(entry.name, Kernel { func, entry });
        }
    }
    Ok((kernels, modules))
}

/// Raises the dynamic shared memory limit of the kernels that launch with more than the
/// default 48 KiB (those of sources not built for `arch` are absent).
fn raise_shared_memory(kernels: &HashMap<&'static str, Kernel>, arch: &str) -> Result<()> {
    for (name, bytes) in chimera_kernels::attention::smem_opt_in()
        .chain(chimera_kernels::moe::smem_opt_in())
        .chain(chimera_kernels::ssm::smem_opt_in())
    {
        if chimera_kernels::entry(name).is_some_and(|(src, _)| !src.builds_for(arch)) {
            continue;
        }
        let k = kernels
            .get(name)
            .ok_or_else(|| BackendError::Device(format!("no kernel named {name}")))?;
        // SAFETY: a loaded function and a valid attribute value.
        unsafe {
            result::function::set_function_attribute(
                k.func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| dev_err(&format!("raising the shared memory of {name}"), e))?;
    }
    Ok(())
}
