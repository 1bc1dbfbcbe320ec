//! CUDA graph capture of a backend's stream, for checks that a piece of the step is
//! capturable: nothing in it synchronises, reads back or allocates from the driver, and its
//! launches replay correctly from a graph. Captured in relaxed mode; the buffers the captured
//! work touches must stay alive (and unmoved) while the graph is replayed.

use std::sync::Arc;

use cudarc::driver::{CudaGraph, sys};

use super::CudaBackend;
use super::device::dev_err;
use crate::backend::{BackendError, Result};

/// A captured, instantiated graph on its backend's stream.
pub struct Captured {
    graph: CudaGraph,
}

impl Captured {
    /// Enqueues the graph on the stream it was captured from.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().map_err(|e| dev_err("graph launch", e))
    }
}

impl CudaBackend {
    /// Captures the work `f` enqueues on this backend's stream into a graph. Fails if `f`
    /// fails or does anything a capture forbids (a synchronisation, a device-to-host copy).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Captured> {
        self.synchronize()?;
        let stream: &Arc<cudarc::driver::CudaStream> = &self.inner.stream;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| dev_err("begin capture", e))?;
        let body = f();
        // End the capture whatever happened, so the stream is usable again.
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        body?;
        match ended.map_err(|e| dev_err("end capture", e))? {
            Some(graph) => Ok(Captured { graph }),
            None => Err(BackendError::Device("capture produced no graph".into())),
        }
    }
}
