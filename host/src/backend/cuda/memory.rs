//! Device memory: persistent allocations (weights, caches, step buffers), the step arena of
//! recycled temporaries, and pinned host staging.
//!
//! The arena works like the CPU backend's: buffers of activations are kept per row width in
//! bytes, each sized for the step bucket's `max_rows`. Flat buffers (scratch, work lists: a
//! size that depends on the step, not a row count) are kept by capacity, a power of two, and
//! a request takes the smallest free one that fits, so scratch sized for a large step serves
//! every smaller one. Once the largest step shapes have been seen no kernel temporary reaches
//! the driver. Reuse is safe without events because one stream orders every
//! use: a buffer returned to the arena by a dropped tensor is only handed to work enqueued
//! later on the same stream. Every driver allocation is counted ([`MemStats`]), so a test can
//! assert that the step loop allocates nothing once warm.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use super::device::Device;
use crate::backend::{BackendError, Result};

/// Driver allocation counters of one backend (device allocations only).
#[derive(Debug, Default)]
pub struct MemStats {
    pub allocations: AtomicU64,
    pub bytes: AtomicU64,
    /// Arena growths (temporaries that found no recycled buffer).
    pub arena_grown: AtomicU64,
    pub arena_bytes: AtomicU64,
}

/// One device allocation, freed on drop.
pub struct DevAlloc {
    pub ptr: u64,
    pub bytes: usize,
    device: Arc<Device>,
}

impl std::fmt::Debug for DevAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevAlloc({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl DevAlloc {
    pub fn new(device: &Arc<Device>, bytes: usize, stats: &MemStats) -> Result<Self> {
        device.bind()?;
        // A zero-byte request still gets a real (tiny) allocation, so every pointer is valid.
        // SAFETY: the context is current on this thread.
        let ptr = unsafe { result::malloc_sync(bytes.max(256)) }.map_err(|e| {
            let free = result::mem_get_info()
                .map(|(free, total)| {
                    format!(
                        " ({:.2} GiB free of {:.2} GiB: lower cache.memory_budget or \
                         engine.max_batched_tokens, or set cache.memory_fraction)",
                        free as f64 / f64::from(1u32 << 30),
                        total as f64 / f64::from(1u32 << 30)
                    )
                })
                .unwrap_or_default();
            device.fail(&format!("allocating {bytes} bytes{free}"), e)
        })?;
        let count = stats.allocations.fetch_add(1, Ordering::Relaxed) + 1;
        stats.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        tracing::debug!(bytes, count, "driver allocation");
        Ok(Self {
            ptr,
            bytes,
            device: device.clone(),
        })
    }
}

impl Drop for DevAlloc {
    fn drop(&mut self) {
        if self.device.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context and freed once; cuMemFree waits
            // for pending work that uses it.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// The smallest flat buffer [`Arena::take_flat`] allocates.
pub const MIN_FLAT_BYTES: usize = 1 << 20;

/// Recycled temporaries keyed by row width in bytes.
pub struct Arena {
    device: Arc<Device>,
    free: Mutex<HashMap<usize, Vec<DevAlloc>>>,
    /// Flat buffers by capacity in bytes.
    flat: Mutex<BTreeMap<usize, Vec<DevAlloc>>>,
    pub max_rows: AtomicUsize,
    pub stats: Arc<MemStats>,
}

impl Arena {
    pub fn new(device: Arc<Device>, stats: Arc<MemStats>) -> Self {
        Self {
            device,
            free: Mutex::new(HashMap::new()),
            flat: Mutex::new(BTreeMap::new()),
            max_rows: AtomicUsize::new(1),
            stats,
        }
    }

    /// A buffer for `rows` rows of `row_bytes`, from the free list when one is big enough.
    pub fn take(&self, rows: usize, row_bytes: usize) -> Result<DevAlloc> {
        let need = rows * row_bytes;
        let key = row_bytes.max(1);
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            // The smallest that fits: a larger buffer (a MoE temporary at capacity) stays free
            // for the request that needs it.
            if let Some(list) = free.get_mut(&key)
                && let Some((i, _)) = list
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| b.bytes >= need)
                    .min_by_key(|(_, b)| b.bytes)
            {
                return Ok(list.swap_remove(i));
            }
        }
        // Past the bucket (MoE rows are tokens × top-k), round up so that growth is rare.
        let max_rows = self.max_rows.load(Ordering::Relaxed);
        let want = if rows > max_rows {
            rows.next_power_of_two()
        } else {
            max_rows
        } * key;
        self.grow(want)
    }

    /// A flat buffer of at least `bytes`: the smallest free one that fits, else a new one of
    /// the next power of two, at least [`MIN_FLAT_BYTES`]: the scratch of kernels whose plans
    /// vary from step to step (split-KV partials, sampling parts, scan chunks) is mostly far
    /// smaller, so the buffers of the first steps serve the later ones too instead of growing
    /// the arena one power of two at a time through a long run.
    pub fn take_flat(&self, bytes: usize) -> Result<DevAlloc> {
        {
            let mut flat = self.flat.lock().unwrap_or_else(|p| p.into_inner());
            let fit = flat
                .range_mut(bytes.max(1)..)
                .find(|(_, list)| !list.is_empty())
                .and_then(|(_, list)| list.pop());
            if let Some(b) = fit {
                return Ok(b);
            }
        }
        self.grow_kind(bytes.max(MIN_FLAT_BYTES).next_power_of_two(), "flat")
    }

    /// Returns a flat buffer.
    pub fn give_flat(&self, buf: DevAlloc) {
        let mut flat = self.flat.lock().unwrap_or_else(|p| p.into_inner());
        flat.entry(buf.bytes).or_default().push(buf);
    }

    fn grow(&self, want: usize) -> Result<DevAlloc> {
        self.grow_kind(want, "rows")
    }

    fn grow_kind(&self, want: usize, kind: &'static str) -> Result<DevAlloc> {
        tracing::debug!(bytes = want, kind, "arena grows");
        self.stats.arena_grown.fetch_add(1, Ordering::Relaxed);
        self.stats
            .arena_bytes
            .fetch_add(want as u64, Ordering::Relaxed);
        DevAlloc::new(&self.device, want, &self.stats)
    }

    pub fn give(&self, row_bytes: usize, buf: DevAlloc) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.entry(row_bytes.max(1)).or_default().push(buf);
    }

    /// Calls `f(ptr, bytes)` for every recycled buffer.
    pub fn for_each_free(&self, mut f: impl FnMut(u64, usize) -> Result<()>) -> Result<()> {
        let free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        for b in free.values().flatten() {
            f(b.ptr, b.bytes)?;
        }
        let flat = self.flat.lock().unwrap_or_else(|p| p.into_inner());
        for b in flat.values().flatten() {
            f(b.ptr, b.bytes)?;
        }
        Ok(())
    }

    /// Drops every recycled buffer (memory goes back to the driver).
    pub fn trim(&self) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.flat.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Page-locked host memory for staging copies (portable, not write-combined: the host reads
/// the sampling results back from it).
pub struct Pinned {
    ptr: *mut u8,
    pub bytes: usize,
    device: Arc<Device>,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through &mut self.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    pub fn new(device: &Arc<Device>, bytes: usize) -> Result<Self> {
        device.bind()?;
        // SAFETY: the context is current; flags 0 = plain page-locked memory.
        let ptr = unsafe { result::malloc_host(bytes.max(64), 0) }
            .map_err(|e| device.fail(&format!("pinning {bytes} bytes of host memory"), e))?;
        Ok(Self {
            ptr: ptr.cast(),
            bytes,
            device: device.clone(),
        })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes were allocated at `ptr` and are exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.device.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host and freed once.
            unsafe {
                let _ = result::free_host(self.ptr.cast());
            }
        }
    }
}

/// Copies host bytes to the device on `stream` (pageable sources are staged by the driver).
///
/// # Safety
/// `dst` must hold `src.len()` bytes; for pinned sources, `src` must stay untouched until the
/// stream passes this copy.
pub(crate) unsafe fn htod(
    device: &Device,
    stream: sys::CUstream,
    dst: u64,
    src: &[u8],
) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_htod_async(dst, src, stream) }
        .map_err(|e| device.fail("copying to the device", e))
}

/// Copies device bytes to the host on `stream` (the caller synchronises before reading).
///
/// # Safety
/// `src` must hold `dst.len()` bytes and `dst` must stay alive until the stream passes it.
pub(crate) unsafe fn dtoh(
    device: &Device,
    stream: sys::CUstream,
    dst: &mut [u8],
    src: u64,
) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_dtoh_async(dst, src, stream) }
        .map_err(|e| device.fail("copying from the device", e))
}

/// Waits until `event` (recorded on a stream of this context) has completed, with the
/// driver's own wait (its scheduling mode: with fewer contexts than cores, a spin), as the
/// stream synchronisation before it did. The step's read-back uses [`poll_event`] instead.
pub(crate) fn wait_event(device: &Device, event: sys::CUevent) -> Result<()> {
    // SAFETY: a live event of this context.
    unsafe { result::event::synchronize(event) }
        .map_err(|e| device.fail("waiting for the device", e))
}

/// Waits until `event` has completed by polling it from this thread (`cuEventQuery` in a
/// loop): for the step's read-back, where the engine thread has nothing else to do (the next
/// step is scheduled and packed) and the device waits for the next launch. Against the
/// driver's wait, alternating in one GPU call (`serving-idle`, scheduling ahead), device idle
/// at 1 / 64 / 256 was 0.37–0.60 / 0.38–0.62 / 0.33–0.53 % polling, 0.44–0.75 / 0.49–0.63 /
/// 0.54–0.57 % waiting.
pub(crate) fn poll_event(device: &Device, event: sys::CUevent) -> Result<()> {
    loop {
        // SAFETY: a live event of this context.
        match unsafe { result::event::query(event) } {
            Ok(()) => return Ok(()),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            Err(e) => return Err(device.fail("waiting for the device", e)),
        }
    }
}

/// Whether the work before `event` is done; an error counts as done (waiting on the event
/// reports it).
pub(crate) fn event_done(event: sys::CUevent) -> bool {
    // SAFETY: a live event of this context.
    !matches!(unsafe { result::event::query(event) },
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY)
}

/// Reads little-endian 32-bit words from `src` into `dst` (as many as both hold), each
/// mapped by `f`: a loop the compiler turns into a vectorised copy.
pub(crate) fn read_words<T>(src: &[u8], dst: &mut [T], f: impl Fn(u32) -> T) {
    for (d, w) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    }
}

pub(crate) fn sync(device: &Device, stream: sys::CUstream) -> Result<()> {
    // SAFETY: a live stream of this context.
    unsafe { result::stream::synchronize(stream) }.map_err(|e| device.fail("synchronising", e))
}

/// An error that says a pointer is not a device allocation of this backend.
pub fn bad_tensor(what: &str) -> BackendError {
    BackendError::Invalid(format!("{what}: not a tensor of this CUDA backend"))
}

#[cfg(test)]
mod tests {
    use super::read_words;

    /// Words are read little-endian, in order, as far as both sides reach.
    #[test]
    fn read_words_decodes_little_endian_words_in_order() {
        let src: Vec<u8> = [7u32, 0x0102_0304, f32::to_bits(-1.5), u32::MAX]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let mut ints = [0u32; 3];
        read_words(&src, &mut ints, |w| w);
        assert_eq!(ints, [7, 0x0102_0304, f32::to_bits(-1.5)]);
        let mut floats = [0f32; 2];
        read_words(&src[8..], &mut floats, f32::from_bits);
        assert_eq!(floats[0], -1.5);
        assert!(floats[1].is_nan());
        // A destination longer than the source keeps its tail.
        let mut long = [9u32; 6];
        read_words(&src, &mut long, |w| w);
        assert_eq!(long[4..], [9, 9]);
    }
}
