//! Tensor storage on the CPU: [`CpuTensor`] (row-major f32 values that go back to the arena
//! when a temporary is dropped), the [`Arena`] of recycled buffers kept per row width, and the
//! backend's storage operations (uploads widened to f32, copies, zeros, made-up weights) and
//! step temporaries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::CpuBackend;
use crate::backend::fp8::{self, Fp8Weight};
use crate::backend::{ArenaStats, BackendError, DType, HostTensor, Result};

/// A dense f32 tensor in host memory.
#[derive(Debug, Default)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
    /// Where the memory goes back when the tensor is dropped (temporaries only).
    arena: Option<Arc<Arena>>,
}

impl Clone for CpuTensor {
    fn clone(&self) -> Self {
        Self {
            data: self.data.clone(),
            shape: self.shape.clone(),
            arena: None,
        }
    }
}

impl PartialEq for CpuTensor {
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape && self.data == other.data
    }
}

impl Drop for CpuTensor {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            arena.give(
                std::mem::take(&mut self.data),
                std::mem::take(&mut self.shape),
            );
        }
    }
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(BackendError::Invalid(format!(
                "{} values do not fill shape {shape:?}",
                data.len()
            )));
        }
        Ok(Self {
            data,
            shape: shape.to_vec(),
            arena: None,
        })
    }

    /// `(rows, cols)` treating every leading dim as rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.data.len().checked_div(cols).unwrap_or(0);
        (rows, cols)
    }

    pub fn row(&self, r: usize) -> &[f32] {
        let (_, c) = self.rows_cols();
        &self.data[r * c..(r + 1) * c]
    }
}

/// Recycled buffers for the tensors kernels create, kept per row width. Every buffer holds
/// `max_rows` rows of its width, so any later temporary of that width fits whatever the
/// step's token count: after the first step of a model, the arena grows only if more
/// temporaries of one width are alive at once than ever before.
/// A recycled tensor buffer: its values and its shape vector.
type FreeBuffer = (Vec<f32>, Vec<usize>);

#[derive(Debug, Default)]
pub struct Arena {
    free: Mutex<HashMap<usize, Vec<FreeBuffer>>>,
    pub(super) max_rows: AtomicUsize,
    grown: AtomicU64,
    bytes: AtomicU64,
}

impl Arena {
    /// A tensor of `shape` on a recycled buffer of its width: zeroed when `zero`, otherwise
    /// holding stale values for a kernel that writes every element.
    fn take(self: &Arc<Self>, shape: &[usize], zero: bool) -> CpuTensor {
        let len: usize = shape.iter().product();
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let rows = len / cols;
        let (mut data, mut dims) = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.get_mut(&cols).and_then(Vec::pop).unwrap_or_default()
        };
        if data.capacity() < len {
            let want = rows.max(self.max_rows.load(Ordering::Relaxed)) * cols;
            self.grown.fetch_add(1, Ordering::Relaxed);
            self.bytes
                .fetch_add(((want - data.capacity()) * 4) as u64, Ordering::Relaxed);
            data.reserve_exact(want - data.len());
        }
        if zero {
            data.clear();
        } else {
            data.truncate(len);
        }
        data.resize(len, 0.0);
        dims.clear();
        dims.extend_from_slice(shape);
        CpuTensor {
            data,
            shape: dims,
            arena: Some(self.clone()),
        }
    }

    fn give(&self, data: Vec<f32>, shape: Vec<usize>) {
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.entry(cols).or_default().push((data, shape));
    }
}

impl CpuBackend {
    pub(super) fn upload_host(&self, host: HostTensor<'_>) -> Result<CpuTensor> {
        host.check()?;
        let t = CpuTensor::new(host.to_f32(), host.shape)?;
        self.uploaded
            .fetch_add((t.data.len() * 4) as u64, Ordering::Relaxed);
        Ok(t)
    }

    /// An FP8 weight as the exact values it stands for (the oracle of the FP8 kernels).
    pub(super) fn upload_dequantized(&self, w: Fp8Weight<'_>) -> Result<CpuTensor> {
        w.check()?;
        let t = CpuTensor::new(w.dequantize(), &w.shape)?;
        self.uploaded
            .fetch_add((t.data.len() * 4) as u64, Ordering::Relaxed);
        Ok(t)
    }

    /// Online quantization, simulated: each row quantized to e4m3 with its scale
    /// `max|row| / 448`, then dequantized (the values a device with FP8 math multiplies by).
    pub(super) fn quantize_dequantized(&self, w: &CpuTensor) -> Result<CpuTensor> {
        let q = fp8::quantize_rows(&w.data, &w.shape);
        CpuTensor::new(q.dequantize(), &w.shape)
    }

    pub(super) fn download_f32(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    pub(super) fn copy_values(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        if src.shape != dst.shape {
            return Err(BackendError::Shape {
                what: "copy_into".into(),
                got: src.shape.clone(),
                expected: dst.shape.clone(),
            });
        }
        dst.data.copy_from_slice(&src.data);
        Ok(())
    }

    pub(super) fn zeros_persistent(&self, shape: &[usize], _dtype: DType) -> Result<CpuTensor> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| BackendError::OutOfMemory(format!("shape {shape:?} overflows")))?;
        let mut data = Vec::new();
        data.try_reserve_exact(n)
            .map_err(|e| BackendError::OutOfMemory(format!("{n} f32 for {shape:?}: {e}")))?;
        data.resize(n, 0.0);
        CpuTensor::new(data, shape)
    }

    pub(super) fn fill_dummy_values(
        &self,
        t: &mut CpuTensor,
        seed: u64,
        std: f32,
        mean: f32,
    ) -> Result<()> {
        for (i, v) in t.data.iter_mut().enumerate() {
            *v = if std == 0.0 {
                mean
            } else {
                crate::backend::dummy_value(seed, i as u64, std)
            };
        }
        Ok(())
    }

    pub(super) fn zeros_tmp(&self, x: &CpuTensor) -> Result<CpuTensor> {
        Ok(self.tmp_zeroed(&x.shape))
    }

    /// A step temporary the kernel overwrites completely (not zeroed).
    pub(super) fn tmp(&self, shape: &[usize]) -> CpuTensor {
        self.arena.take(shape, false)
    }

    /// A zeroed step temporary (for kernels that accumulate into it).
    pub(super) fn tmp_zeroed(&self, shape: &[usize]) -> CpuTensor {
        self.arena.take(shape, true)
    }

    /// Fills every free arena buffer with NaN, so a test can show that no kernel reads a
    /// temporary it did not write (stale values would surface in its outputs).
    pub fn poison_arena(&self) {
        let mut free = self.arena.free.lock().unwrap_or_else(|p| p.into_inner());
        for (data, _) in free.values_mut().flatten() {
            let cap = data.capacity();
            data.clear();
            data.resize(cap, f32::NAN);
        }
    }

    /// Bytes of the tensors uploaded so far (a model's weights, as f32), shared by clones.
    pub fn weight_bytes(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    pub(super) fn arena_growth(&self) -> ArenaStats {
        ArenaStats {
            grown: self.arena.grown.load(Ordering::Relaxed),
            bytes: self.arena.bytes.load(Ordering::Relaxed),
        }
    }
}
