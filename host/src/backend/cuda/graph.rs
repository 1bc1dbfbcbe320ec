//! CUDA graphs: the step shapes captured as graphs (decode buckets of a power of two of
//! sequences; mixed buckets of tokens, decodes and prompt chunks), their capture from the
//! stream and their replay. A graph's step object keeps fixed addresses, so a replay reads
//! the current step's metadata (see [`super::upload`]).

use cudarc::driver::{result, sys};

use super::CudaBackend;
use super::memory::sync;
use crate::backend::{BackendError, GraphBucket, Result};

/// A captured and instantiated CUDA graph, destroyed with the backend.
pub(super) struct Graph {
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
/// kernels that long. (Buckets of 8 and 16 tokens were tried for verify steps: on an H100
/// their graphs cost more than the eager steps: see `eager_verify_tokens` in the model runner.)
const MIXED_TOKEN_STEP: usize = 32;
const MIXED_MAX_TOKENS: usize = 512;

/// Prompt chunks a mixed graph holds: two (most mixed steps carry one or two), or eight. Each
/// padding prompt is an attention tile and a grid row of the SSD chunk pass that return at
/// once, which short steps notice.
const MIXED_PROMPTS: [usize; 2] = [2, 8];

/// Decode buckets of 1 to 256 sequences (powers of two up to the batch's); mixed buckets
/// of every [`MIXED_TOKEN_STEP`] tokens up to [`MIXED_MAX_TOKENS`] (and the step's budget),
/// each with a power of two of decodes up to half the tokens and each count of
/// [`MIXED_PROMPTS`] prompt chunks.
pub(super) fn buckets(max_batch: usize, max_tokens: usize) -> Vec<GraphBucket> {
    let decodes = || {
        GRAPH_BUCKETS
            .iter()
            .copied()
            .filter(move |&b| b <= max_batch.next_power_of_two())
    };
    let mut out: Vec<GraphBucket> = decodes().map(|seqs| GraphBucket::Decode { seqs }).collect();
    let top = MIXED_MAX_TOKENS.min(max_tokens.next_multiple_of(MIXED_TOKEN_STEP));
    for tokens in (MIXED_TOKEN_STEP..=top).step_by(MIXED_TOKEN_STEP) {
        for prompts in MIXED_PROMPTS {
            out.extend(
                decodes()
                    .filter(|&d| d <= tokens / 2)
                    .map(|decodes| GraphBucket::Mixed {
                        tokens,
                        decodes,
                        prompts,
                    }),
            );
        }
    }
    out
}

impl CudaBackend {
    pub(super) fn capture(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<usize> {
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
        // SAFETY: a graph just captured; flags 0. The driver call itself: the flags' Rust type
        // differs between cudarc's bindings of CUDA versions, the C parameter does not.
        let mut exec = std::mem::MaybeUninit::<sys::CUgraphExec>::uninit();
        let instantiated =
            unsafe { sys::cuGraphInstantiateWithFlags(exec.as_mut_ptr(), graph, 0).result() }
                .map(|()| unsafe { exec.assume_init() });
        let exec = match instantiated {
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

    pub(super) fn replay(&self, id: usize) -> Result<()> {
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
}
