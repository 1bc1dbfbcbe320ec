//! Tensor storage on the device: [`CudaTensor`] (a dense row-major tensor that owns a
//! persistent allocation or holds an arena buffer it gives back when dropped), the backend's
//! storage operations (upload with an on-device cast, download widened to f32, copies, zeros,
//! made-up weights) and the step temporaries drawn from the arena.
//!
//! Persistent tensors (weights, caches) are allocated here at start, never from the arena; a
//! temporary's contents are undefined until a kernel writes it (`poison_arena` lets a test
//! see any element left unwritten).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::result;

use super::device::Arg;
use super::memory::{Arena, DevAlloc, dtoh, htod, sync};
use super::{BLOCK, CudaBackend, grid_for};
use crate::backend::{ArenaStats, BackendError, DType, HostTensor, Result};

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

/// The scales of an FP8 weight ([`DType::F8E4M3`] codes): f32, one per row of every matrix
/// (`block` `None`), or one per `block` tile.
pub(super) struct Fp8Scales {
    pub ptr: u64,
    pub block: Option<[usize; 2]>,
    #[allow(dead_code, reason = "owns the memory `ptr` points into")]
    mem: Arc<DevAlloc>,
}

/// A dense row-major tensor in device memory.
pub struct CudaTensor {
    pub(super) ptr: u64,
    pub(super) shape: Vec<usize>,
    pub(super) dtype: DType,
    mem: Mem,
    /// The scales of FP8 codes (`dtype` [`DType::F8E4M3`]).
    pub(super) fp8: Option<Arc<Fp8Scales>>,
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

    pub(super) fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub(super) fn bytes(&self) -> usize {
        self.len() * self.dtype.size()
    }

    /// The same rows under `shape` (same element count and last dim, so the arena's row
    /// width is unchanged): a dense result given its input's leading dims back.
    pub(super) fn reshaped(mut self, shape: &[usize]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.len());
        debug_assert_eq!(shape.last(), self.shape.last());
        self.shape = shape.to_vec();
        self
    }

    /// `(rows, cols)` treating every leading dim as rows.
    pub(super) fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        (self.len().checked_div(cols).unwrap_or(0), cols)
    }
}

impl CudaBackend {
    pub(super) fn upload_host(&self, host: HostTensor<'_>) -> Result<CudaTensor> {
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
            fp8: None,
        })
    }

    pub(super) fn download_f32(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        if t.fp8.is_some() {
            return self.download_fp8(t);
        }
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

    pub(super) fn copy_on_device(&self, src: &CudaTensor, dst: &mut CudaTensor) -> Result<()> {
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

    pub(super) fn zeros_persistent(&self, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
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
            fp8: None,
        })
    }

    pub(super) fn fill_dummy_on_device(
        &self,
        t: &mut CudaTensor,
        seed: u64,
        std: f32,
        mean: f32,
    ) -> Result<()> {
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

    pub(super) fn zeros_tmp(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let t = self.tmp(&x.shape, x.dtype)?;
        self.memset_zero(t.ptr, t.len() * t.dtype.size())?;
        Ok(t)
    }

    /// A step temporary of `shape` (contents undefined: the kernel writes every element).
    pub(super) fn tmp(&self, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
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
    pub(super) fn arena_tensor(
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
            fp8: None,
        }
    }

    /// A `[rows, cols]` step temporary whose buffer holds at least `cap_rows` rows: for row
    /// counts that vary beyond the step's token bucket (MoE entries are tokens × top-k), so
    /// that the first large step after warm-up does not grow the arena.
    pub(super) fn tmp_rows_with_capacity(
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
    pub(super) fn moe_rows_cap(&self, top_k: usize) -> usize {
        self.inner.arena.max_rows.load(Ordering::Relaxed) * top_k.max(1)
    }

    pub(super) fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `ptr` is a live allocation of at least `bytes` owned by the caller.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream()) }
            .map_err(|e| self.dev().fail("clearing memory", e))
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

    pub(super) fn arena_growth(&self) -> ArenaStats {
        ArenaStats {
            grown: self.inner.stats.arena_grown.load(Ordering::Relaxed),
            bytes: self.inner.stats.arena_bytes.load(Ordering::Relaxed),
        }
    }
}

impl CudaTensor {
    /// An FP8 weight: `codes` (one byte an element) and `scales` in persistent allocations.
    pub(super) fn fp8_weight(
        codes: Arc<DevAlloc>,
        scales: Arc<DevAlloc>,
        shape: Vec<usize>,
        block: Option<[usize; 2]>,
    ) -> Self {
        CudaTensor {
            ptr: codes.ptr,
            shape,
            dtype: DType::F8E4M3,
            mem: Mem::Owned(codes),
            fp8: Some(Arc::new(Fp8Scales {
                ptr: scales.ptr,
                block,
                mem: scales,
            })),
        }
    }
}
