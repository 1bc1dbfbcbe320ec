//! GEMMs through cuBLASLt with cached descriptors and algorithms.
//!
//! `linear` is `y[n, m] = x[n, k] · w[m, k]ᵀ (+ b)` on row-major tensors. cuBLASLt is
//! column-major, so the product is computed as `yᵀ (m×n) = op_T(W) · Xᵀ`: the row-major weight
//! `[m, k]` is the column-major `k×m` matrix transposed, and row-major `x` is column-major
//! `k×n`. The bias is cuBLASLt's BIAS epilogue (one value per output feature).
//!
//! Everything that does not depend on the data pointers — the operation descriptor, the
//! three layouts and the heuristic's algorithm — is created once per `(m, n, k, bias, dtype)`
//! and reused; eager prefill steps would otherwise pay the heuristic on every GEMM. The
//! workspace is allocated once. f32 mode computes in plain FP32 (`CUBLAS_COMPUTE_32F`, no
//! TF32), bf16 mode multiplies bf16 with f32 accumulation.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::sys as drv;

use super::device::Device;
use super::memory::{DevAlloc, MemStats};
use crate::backend::{BackendError, DType, Result};

const WORKSPACE_BYTES: usize = 32 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    bias: bool,
    /// The output dtype (and the inputs' unless `fp8`).
    dtype: DType,
    /// e4m3 inputs with one f32 scale per row of each (cuBLASLt's outer-vector scaling).
    fp8: bool,
}

impl Key {
    fn new((n, k, m): (usize, usize, usize), bias: bool, dtype: DType, fp8: bool) -> Self {
        Self {
            m,
            n,
            k,
            bias,
            dtype,
            fp8,
        }
    }
}

struct Plan {
    desc: lts::cublasLtMatmulDesc_t,
    a: lts::cublasLtMatrixLayout_t,
    b: lts::cublasLtMatrixLayout_t,
    d: lts::cublasLtMatrixLayout_t,
    algo: lts::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once for this plan and is destroyed once.
        // (A layout left null by a failed `Gemm::plan` is skipped.)
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

struct Handle(lts::cublasLtHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created once by create_handle.
        unsafe {
            let _ = lt::destroy_handle(self.0);
        }
    }
}

/// A cuBLASLt handle, its workspace and the plan cache of one backend (one stream).
pub struct Gemm {
    handle: Handle,
    workspace: DevAlloc,
    plans: Mutex<HashMap<Key, Plan>>,
    /// FP8 shapes this cuBLASLt has no algorithm for (asked once each).
    unsupported: Mutex<std::collections::HashSet<Key>>,
    device: Arc<Device>,
}

// SAFETY: cuBLASLt handles and descriptors are used under the plan mutex by one stream.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

fn lt_err(what: &str, e: lt::CublasError) -> BackendError {
    BackendError::Device(format!("cuBLASLt {what}: {e:?}"))
}

fn data_type(d: DType) -> lts::cudaDataType {
    match d {
        DType::F32 => lts::cudaDataType::CUDA_R_32F,
        DType::BF16 => lts::cudaDataType::CUDA_R_16BF,
        DType::F16 => lts::cudaDataType::CUDA_R_16F,
        DType::F8E4M3 => lts::cudaDataType::CUDA_R_8F_E4M3,
    }
}

/// Sets a descriptor attribute to `value` (a plain value of the type the attribute takes:
/// an i32 flag, an enum, a device pointer as u64).
fn set_attr<T: Copy>(
    desc: lts::cublasLtMatmulDesc_t,
    attr: lts::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: `desc` is live; `value` points at `size_of::<T>()` readable bytes.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| lt_err(&format!("setting {attr:?}"), e))
}

impl Gemm {
    pub fn new(device: &Arc<Device>, stats: &MemStats) -> Result<Self> {
        // SAFETY: probing for the shared library has no preconditions.
        if !unsafe { lts::is_culib_present() } {
            return Err(BackendError::Device(
                "cuBLASLt (libcublasLt.so.13) was not found: install the CUDA 13 runtime \
                 libraries (e.g. `pip install nvidia-cublas`) and put them on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        device.bind()?;
        let handle = Handle(lt::create_handle().map_err(|e| lt_err("creating a handle", e))?);
        let workspace = DevAlloc::new(device, WORKSPACE_BYTES, stats)?;
        Ok(Self {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
            unsupported: Mutex::new(std::collections::HashSet::new()),
            device: device.clone(),
        })
    }

    /// The descriptor, layouts and algorithm of `key`.
    fn plan(&self, key: Key) -> Result<Plan> {
        let desc = self.describe(key)?;
        let in_ty = data_type(if key.fp8 { DType::F8E4M3 } else { key.dtype });
        let layout = |ty, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                .map_err(|e| lt_err("creating a layout", e))
        };
        // The plan owns each handle as soon as it exists (its Drop destroys them, also on
        // error); a layout not made yet is null, which destroying ignores.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: lts::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.a = layout(in_ty, key.k, key.m, key.k)?;
        plan.b = layout(in_ty, key.k, key.n, key.k)?;
        plan.d = layout(data_type(key.dtype), key.m, key.n, key.m)?;
        plan.algo = self.heuristic(key, &plan)?;
        Ok(plan)
    }

    /// The operation descriptor of `key`: `op_T(W) · Xᵀ` in f32 compute, the FP8 scale modes
    /// and the bias epilogue where `key` has them.
    fn describe(&self, key: Key) -> Result<lts::cublasLtMatmulDesc_t> {
        use lts::cublasLtMatmulDescAttributes_t as A;
        let desc = lt::create_matmul_desc(
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lts::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_err("creating a matmul descriptor", e))?;
        let configure = || -> Result<()> {
            let (op_t, op_n): (i32, i32) = (1, 0);
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
            if key.fp8 {
                // The heuristic checks that the scale pointers are set: any device address
                // stands in (each call sets the real ones).
                let stand_in = self.workspace.ptr;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &stand_in)?;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &stand_in)?;
                // One scale per row of the weight (per output feature) and per token.
                let outer =
                    lts::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
            }
            if key.bias {
                let epi = lts::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
            }
            Ok(())
        };
        configure().inspect_err(|_| {
            // SAFETY: created above and not handed out.
            let _ = unsafe { lt::destroy_matmul_desc(desc) };
        })?;
        Ok(desc)
    }

    /// cuBLASLt's first algorithm for `plan` (descriptor and layouts of `key`) within the
    /// workspace.
    fn heuristic(&self, key: Key, plan: &Plan) -> Result<lts::cublasLtMatmulAlgo_t> {
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("creating a preference", e))?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: `pref` is live; the value is a u64 as the attribute requires.
        let found = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lts::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .map_err(|e| lt_err("setting the workspace preference", e))
            .map(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle.0,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.d,
                    plan.d,
                    pref,
                )
            })
        };
        // SAFETY: created above; nothing else holds it.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heuristic = found?.map_err(|e| {
            lt_err(
                &format!(
                    "finding an algorithm for {}×{}·{}ᵀ ({:?}{})",
                    key.n,
                    key.k,
                    key.m,
                    key.dtype,
                    if key.fp8 { ", e4m3 inputs" } else { "" }
                ),
                e,
            )
        })?;
        Ok(heuristic.algo)
    }

    /// `y[n, m] = x[n, k] · w[m, k]ᵀ (+ bias[m])`, all of `dtype`, enqueued on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(
        &self,
        stream: drv::CUstream,
        dtype: DType,
        x: u64,
        w: u64,
        bias: Option<u64>,
        y: u64,
        (n, k, m): (usize, usize, usize),
    ) -> Result<()> {
        let key = Key::new((n, k, m), bias.is_some(), dtype, false);
        self.run(stream, key, x, w, bias, y, None)
    }

    /// `y[n, m] = (x · sx)[n, k] · (w · sw)[m, k]ᵀ (+ bias[m])` with e4m3 `x` and `w`, f32
    /// scales `sx[n]` (per token) and `sw[m]` (per output feature), and `dtype` output and
    /// bias: cuBLASLt's FP8 GEMM with outer-vector scaling (cuBLAS 12.9 on; see
    /// [`Gemm::prepare_fp8`] for whether this cuBLASLt has it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_fp8(
        &self,
        stream: drv::CUstream,
        dtype: DType,
        (x, sx): (u64, u64),
        (w, sw): (u64, u64),
        bias: Option<u64>,
        y: u64,
        (n, k, m): (usize, usize, usize),
    ) -> Result<()> {
        let key = Key::new((n, k, m), bias.is_some(), dtype, true);
        self.run(stream, key, x, w, bias, y, Some((sw, sx)))
    }

    /// Makes (once) the plan of the FP8 GEMM [`Gemm::linear_fp8`] runs for this shape: `Err`
    /// where this cuBLASLt has no algorithm for it, before anything is enqueued.
    pub(crate) fn prepare_fp8(
        &self,
        dtype: DType,
        bias: bool,
        (n, k, m): (usize, usize, usize),
    ) -> Result<()> {
        let key = Key::new((n, k, m), bias, dtype, true);
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if plans.contains_key(&key) {
            return Ok(());
        }
        let mut unsupported = self.unsupported.lock().unwrap_or_else(|p| p.into_inner());
        if unsupported.contains(&key) {
            return Err(BackendError::Invalid(format!(
                "no FP8 GEMM for {n}×{k}·{m}ᵀ in this cuBLASLt"
            )));
        }
        match self.plan(key) {
            Ok(plan) => {
                plans.insert(key, plan);
                Ok(())
            }
            Err(e) => {
                unsupported.insert(key);
                Err(e)
            }
        }
    }

    /// Runs the plan of `key` (made once); `scales` are the weight's and the input's scale
    /// vectors of an FP8 plan.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        stream: drv::CUstream,
        key: Key,
        x: u64,
        w: u64,
        bias: Option<u64>,
        y: u64,
        scales: Option<(u64, u64)>,
    ) -> Result<()> {
        let Key { m, n, k, .. } = key;
        if n == 0 || m == 0 {
            return Ok(());
        }
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(self.plan(key)?),
        };
        use lts::cublasLtMatmulDescAttributes_t as A;
        if let Some((sa, sb)) = scales {
            set_attr(plan.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa)?;
            set_attr(plan.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb)?;
        }
        if let Some(b) = bias {
            set_attr(plan.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b)?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let timed = self.device.op_begin(stream)?;
        // SAFETY: the plan's layouts describe the buffers' extents (checked by the caller's
        // shape checks); the workspace is this backend's and the stream orders its reuse.
        unsafe {
            lt::matmul(
                self.handle.0,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                y as *const c_void,
                plan.d,
                y as *mut c_void,
                plan.d,
                &plan.algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream as lts::cudaStream_t,
            )
        }
        .map_err(|e| {
            lt_err(
                &format!("matmul {n}×{k}·{m}ᵀ on device {}", self.device.ordinal),
                e,
            )
        })?;
        self.device.op_end("cublasLt", timed, stream)
    }
}
