//! The real model behind the engine: [`ModelRunner`] implements [`StepExecutor`] for any
//! [`Model`] on any [`StepBackend`]. It owns the model's device caches and the backend's step
//! object: each step's plan is uploaded once, the forward pass reads only the uploaded step,
//! and the step ends on the backend with the sampling tail, whose candidate columns are the
//! one device-to-host copy (plus full rows on steps that score prompt tokens). The weights are shared (`Arc`):
//! replicas on one device read the same copy, each with its own caches.
//!
//! **Graphs.** On a backend with device graphs (CUDA), the forward pass is captured once per
//! bucket when the caches are allocated ([`GraphBucket`]): decode-only steps of up to 256
//! sequences, and mixed steps (prefill chunks beside decodes, with prefix hits, slot
//! restores and SSM snapshots) up to the backend's largest mixed token bucket. Each step
//! replays the smallest bucket that takes it: the plan is uploaded padded to the bucket in a
//! fixed layout (padding rows and chunks write no cache and no state), a mixed step's slot
//! restores and zeros run first (outside the graph: their count varies), the graph runs,
//! and the sampling tail runs after it as usual. Other steps (prompt logprobs, steps larger
//! than every bucket) run eagerly. Output is the same either way (`engine.cuda_graphs =
//! false` turns graphs off).

use std::sync::Arc;

use super::executor::{CacheAllocation, ExecutorError, MtpSource, StepExecutor, StepOutput};
use crate::backend::{GraphBucket, StepBackend, StepPlan};
use crate::model::{CacheSpec, Model, ModelCaches};

pub struct ModelRunner<B: StepBackend> {
    backend: B,
    model: Arc<Model<B>>,
    caches: Option<ModelCaches<B>>,
    step: Option<B::Step>,
    use_graphs: bool,
    /// Captured graphs, decode buckets first, each kind from the smallest.
    graphs: Vec<CapturedGraph>,
    /// The logits the graphs leave: the buffer that the graphs of one logit-row count copy
    /// theirs into, exactly that many rows of the vocabulary.
    graph_outputs: Vec<B::Tensor>,
    /// The step object the graphs read (its buffer never moves).
    graph_step: Option<B::Step>,
    /// Block-table words per sequence a graph step holds.
    graph_blocks: usize,
    /// Steps replayed from a graph, and steps run eagerly.
    pub graph_steps: u64,
    /// Of the graph steps, those replayed from a mixed bucket.
    pub mixed_graph_steps: u64,
    pub eager_steps: u64,
    /// Seconds spent capturing the graphs.
    pub capture_seconds: f64,
    /// Device memory the graphs' logits buffers hold.
    pub graph_logits_bytes: usize,
    /// The device clock of the last step executed.
    device_time: Option<crate::backend::DeviceStepTime>,
    /// A step was launched and its results not yet waited for.
    in_flight: bool,
    /// The step [`StepExecutor::prepare`] packed for the next launch.
    packed: Option<Packed>,
    /// The launched step's sampling tail, held for [`StepExecutor::launch_tail`].
    held: Option<Tail<B>>,
    /// The MTP head's step objects (its plan, and the rows its hidden states are gathered
    /// from) and the normalised output of its last pass's logit rows (a chain's next input).
    mtp_steps: Option<(B::Step, B::Step)>,
    mtp_last: Option<B::Tensor>,
    /// The MTP pass's plan with row numbers for tokens (its buffers kept between passes).
    mtp_rows: StepPlan,
}

/// Where a step's sampling tail reads: a graph's step object and logits, or the eager step's.
enum Tail<B: StepBackend> {
    Graph { out: usize },
    Eager { logits: B::Tensor },
}

fn not_allocated() -> ExecutorError {
    ExecutorError::Allocation("caches used before allocate()".into())
}

/// A step packed on the host ahead of its launch.
#[derive(Debug, Clone, Copy)]
enum Packed {
    /// For the graph `graphs[i]`, in the graph step.
    Graph(usize),
    /// Eagerly, in the step object.
    Eager,
}

/// Mixed buckets a step's upload tries (the smallest that hold it) before it runs eagerly: a
/// bucket whose SSD-chunk capacity is too small refuses after planning the step.
const MAX_MIXED_TRIES: usize = 4;

/// Verify steps (speculative decoding) of at most this many tokens run eagerly
/// (`CHIMERA_EAGER_VERIFY_TOKENS`, a knob for measuring; default 8): a mixed graph pads them to
/// its bucket's layout and costs more than their launches. Measured on an H100 at batch 1,
/// context 2048 (`gpu-check --suite bench-spec`, one call), a verify step over a plain decode
/// step with k = 1 / 2 / 4 drafts: in mixed graphs of 8 and 16 tokens (with the tensor-core
/// GEMV) Llama-3-8B 1.202 / 1.206 / 1.276×, NemotronH-8B 1.450 / 1.549 / 1.572×; eagerly (with
/// cuBLASLt from 3 rows) Llama 1.098 / 1.304 / 1.368×, NemotronH 1.243 / 1.456 / 1.616×; the
/// eager step with the tensor-core GEMV, at the plan level, Llama 1.064 / 1.095 / 1.100×,
/// NemotronH 1.194 / 1.271 / 1.378×.
fn eager_verify_tokens() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::config::env_knob("CHIMERA_EAGER_VERIFY_TOKENS").unwrap_or(8))
}

/// One captured bucket: its graph and where it leaves its logits.
struct CapturedGraph {
    bucket: GraphBucket,
    id: usize,
    /// Index into [`ModelRunner::graph_outputs`].
    out: usize,
}

/// Order of the replay search: decode buckets, then mixed ones, each from the smallest (by
/// tokens, then decodes, then prompts).
fn replay_order(b: &GraphBucket) -> (u8, usize, usize, usize) {
    match *b {
        GraphBucket::Decode { seqs } => (0, seqs, 0, 0),
        GraphBucket::Mixed {
            tokens,
            decodes,
            prompts,
        } => (1, tokens, decodes, prompts),
    }
}

/// Order of capture: the largest layouts first (the first upload sizes the graph step's
/// buffer, which cannot move afterwards): by chunks, then tokens.
fn capture_order(b: &GraphBucket) -> std::cmp::Reverse<(usize, usize)> {
    std::cmp::Reverse(match *b {
        GraphBucket::Decode { seqs } => (seqs, seqs),
        GraphBucket::Mixed {
            tokens,
            decodes,
            prompts,
        } => (decodes + prompts, tokens),
    })
}

/// Token rows of a bucket's layout.
fn bucket_rows(b: &GraphBucket) -> usize {
    match *b {
        GraphBucket::Decode { seqs } => seqs,
        GraphBucket::Mixed { tokens, .. } => tokens,
    }
}

impl<B: StepBackend> ModelRunner<B> {
    /// A runner over `model` (a `Model` or an `Arc` of one shared with other replicas).
    pub fn new(backend: B, model: impl Into<Arc<Model<B>>>) -> Self {
        Self {
            backend,
            model: model.into(),
            caches: None,
            step: None,
            use_graphs: true,
            graphs: Vec::new(),
            graph_outputs: Vec::new(),
            graph_step: None,
            graph_blocks: 0,
            graph_steps: 0,
            mixed_graph_steps: 0,
            eager_steps: 0,
            capture_seconds: 0.0,
            graph_logits_bytes: 0,
            device_time: None,
            in_flight: false,
            held: None,
            packed: None,
            mtp_steps: None,
            mtp_last: None,
            mtp_rows: StepPlan::default(),
        }
    }

    /// Whether decode steps replay captured graphs where the backend has them (default on).
    pub fn with_graphs(mut self, on: bool) -> Self {
        self.use_graphs = on;
        self
    }

    /// Buckets captured (empty without graphs), in replay-search order.
    pub fn graph_buckets(&self) -> Vec<GraphBucket> {
        self.graphs.iter().map(|g| g.bucket).collect()
    }

    /// Captures a graph of the forward pass for every bucket the backend offers, the largest
    /// layout first (it sizes the graph step's buffer; a bucket that does not fit it is left
    /// out). A capture that fails (a model whose forward pass reads results back on the host)
    /// leaves the runner without graphs.
    fn capture_graphs(&mut self, max_batch: usize, max_tokens: usize) -> Result<(), ExecutorError> {
        let mut buckets = self.backend.graph_buckets(max_batch, max_tokens);
        let Some(caches) = self.caches.as_mut() else {
            return Ok(());
        };
        if buckets.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        buckets.sort_by_key(capture_order);
        let per_seq = self
            .model
            .info
            .max_position_embeddings
            .max(1)
            .div_ceil(caches.block_size.max(1));
        self.graph_blocks = per_seq.min(caches.num_blocks).max(1);
        let alloc = |e: crate::backend::BackendError| ExecutorError::Allocation(e.to_string());
        let rows = buckets.iter().map(bucket_rows).max().unwrap_or(1);
        let mut step = self.backend.new_step(rows).map_err(alloc)?;
        let mut empty = StepPlan::new(caches.block_size);
        empty
            .finish()
            .map_err(|e| ExecutorError::Allocation(e.to_string()))?;
        let mut graphs = Vec::new();
        // The graphs of one logit-row count share the buffer they copy their logits into: the
        // logits a forward pass returns sit in a step temporary sized for the largest step
        // (`max_tokens` rows of the vocabulary), too big for each graph to keep one.
        let mut outputs: Vec<B::Tensor> = Vec::new();
        let mut shared: std::collections::HashMap<usize, usize> = Default::default();
        let fail = |e: crate::model::ModelError| ExecutorError::Allocation(e.to_string());
        for bucket in buckets {
            let uploaded = self
                .backend
                .upload_graph_step(&empty, &mut step, bucket, self.graph_blocks)
                .map_err(alloc)?;
            if !uploaded {
                continue;
            }
            // An eager run first: it grows the arena and builds lazy tables, so the capture
            // allocates nothing and uploads nothing.
            let (backend, model) = (&self.backend, &self.model);
            let warm = model.forward(backend, &step, caches).map_err(fail)?;
            let rows = backend.shape(&warm)[0];
            let out = match shared.get(&rows) {
                Some(&i) => i,
                None => {
                    let t = backend
                        .zeros(backend.shape(&warm), backend.dtype(&warm))
                        .map_err(alloc)?;
                    outputs.push(t);
                    shared.insert(rows, outputs.len() - 1);
                    outputs.len() - 1
                }
            };
            drop(warm);
            let captured = backend.capture_graph(&mut || {
                let l = model
                    .forward(backend, &step, caches)
                    .map_err(|e| crate::backend::BackendError::Invalid(e.to_string()))?;
                backend.copy_into(&l, &mut outputs[out])
            });
            let id = match captured {
                Ok(id) => id,
                Err(e) => {
                    tracing::warn!(
                        "steps run without CUDA graphs: capturing {bucket:?} failed: {e}"
                    );
                    return Ok(());
                }
            };
            graphs.push(CapturedGraph { bucket, id, out });
        }
        self.install_graphs(graphs, outputs, step, started);
        Ok(())
    }

    /// Keeps the captured graphs (in replay order), their logits buffers and their step, and
    /// says what was captured.
    fn install_graphs(
        &mut self,
        mut graphs: Vec<CapturedGraph>,
        outputs: Vec<B::Tensor>,
        step: B::Step,
        started: std::time::Instant,
    ) {
        graphs.sort_by_key(|g| replay_order(&g.bucket));
        self.graphs = graphs;
        self.graph_outputs = outputs;
        self.graph_step = Some(step);
        self.capture_seconds = started.elapsed().as_secs_f64();
        let decode: Vec<usize> = self
            .graphs
            .iter()
            .filter_map(|g| match g.bucket {
                GraphBucket::Decode { seqs } => Some(seqs),
                GraphBucket::Mixed { .. } => None,
            })
            .collect();
        self.graph_logits_bytes = (self.graph_outputs.iter())
            .map(|t| {
                let b = &self.backend;
                b.shape(t).iter().product::<usize>() * b.dtype(t).size()
            })
            .sum();
        tracing::info!(
            decode_buckets = ?decode,
            mixed_buckets = self.graphs.len() - decode.len(),
            seconds = self.capture_seconds,
            logits_buffers = self.graph_outputs.len(),
            logits_mib = self.graph_logits_bytes >> 20,
            "captured CUDA graphs"
        );
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
}

impl<B: StepBackend> StepExecutor for ModelRunner<B> {
    fn cache_spec(&self) -> CacheSpec {
        self.model.cache_spec_on(&self.backend)
    }

    fn vocab_size(&self) -> usize {
        self.model.info.vocab_size
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.model.info.eos_token_ids
    }

    fn allocate(&mut self, alloc: CacheAllocation) -> Result<(), ExecutorError> {
        let caches = self
            .model
            .new_caches_with(
                &self.backend,
                alloc.num_blocks,
                alloc.block_size,
                alloc.num_ssm_slots,
                alloc.dtypes,
            )
            .map_err(|e| ExecutorError::Allocation(e.to_string()))?;
        self.caches = Some(caches);
        let new_step = |b: &B| {
            b.new_step(alloc.max_tokens)
                .map_err(|e| ExecutorError::Allocation(e.to_string()))
        };
        self.step = Some(new_step(&self.backend)?);
        if self.model.mtp.is_some() {
            // The head reads every row's final hidden state, which a replayed graph does not
            // leave: the steps run eagerly.
            if let Some(c) = self.caches.as_mut() {
                c.keep_hidden = true;
            }
            self.mtp_steps = Some((new_step(&self.backend)?, new_step(&self.backend)?));
            let buckets = self
                .backend
                .graph_buckets(alloc.max_running, alloc.max_tokens);
            if self.use_graphs && !buckets.is_empty() {
                tracing::info!("CUDA graphs off: the MTP head reads every step's hidden states");
            }
            self.use_graphs = false;
        }
        if self.use_graphs {
            self.capture_graphs(alloc.max_running.min(alloc.max_tokens), alloc.max_tokens)?;
        }
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.launch(plan, out)?;
        self.finish(out)
    }

    fn launch(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.packed = None;
        self.launch_prepared(plan, out)
    }

    fn prepare(&mut self, plan: &StepPlan) {
        self.packed = None;
        if self.backend.packs_ahead() && self.pack_ahead(plan).is_err() {
            self.packed = None;
        }
    }

    fn launch_prepared(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        self.start_forward(plan, out, false)?;
        self.start_tail(plan, out, false)
    }

    fn splits_tail(&self) -> bool {
        true
    }

    fn launch_forward(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        self.start_forward(plan, out, true)
    }

    fn launch_tail(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.start_tail(plan, out, true)
    }

    fn finish(&mut self, out: &mut StepOutput) -> Result<(), ExecutorError> {
        if !std::mem::take(&mut self.in_flight) {
            return Ok(());
        }
        if self.held.take().is_some() {
            // Its forward pass is done or will be; nothing waits on the host for it.
            let _ = self.backend.step_clock_end();
            return Err(ExecutorError::InvalidBatch(
                "a step finished without its sampling tail".into(),
            ));
        }
        let done = self
            .backend
            .sample_finish(&mut out.cands)
            .map_err(ExecutorError::Backend);
        let clock = self.backend.step_clock_end();
        done.map_err(|e| self.lost_or(e))?;
        self.device_time = clock.map_err(ExecutorError::Backend)?;
        Ok(())
    }

    fn output_ready(&mut self) -> bool {
        !self.in_flight || self.backend.sample_ready()
    }

    fn take_device_time(&mut self) -> Option<crate::backend::DeviceStepTime> {
        self.device_time.take()
    }

    fn applies_token_masks(&self) -> bool {
        self.backend.applies_token_masks()
    }

    fn has_mtp(&self) -> bool {
        self.model.mtp.is_some()
    }

    fn mtp_draft(
        &mut self,
        plan: &StepPlan,
        source: MtpSource,
        rows: &[u32],
        drafts: &mut Vec<u32>,
    ) -> Result<(), ExecutorError> {
        let caches = self.caches.as_mut().ok_or_else(not_allocated)?;
        let (step, gather) = self
            .mtp_steps
            .as_mut()
            .ok_or_else(|| ExecutorError::InvalidBatch("this executor has no MTP head".into()))?;
        if rows.len() != plan.num_tokens() {
            return Err(ExecutorError::InvalidBatch(format!(
                "an MTP pass of {} tokens with {} hidden rows",
                plan.num_tokens(),
                rows.len()
            )));
        }
        let backend = &self.backend;
        let from = match source {
            MtpSource::Step => caches.hidden.as_ref(),
            MtpSource::Chain => self.mtp_last.as_ref(),
        }
        .ok_or_else(|| ExecutorError::InvalidBatch("an MTP pass with no hidden states".into()))?;
        // The rows are gathered as an embedding lookup whose ids are row numbers.
        let by_row = &mut self.mtp_rows;
        by_row.copy_from(plan);
        by_row.tokens.clear();
        by_row.tokens.extend_from_slice(rows);
        backend.upload_step(by_row, gather)?;
        let hidden = backend.embedding(from, gather)?;
        backend.upload_step(plan, step)?;
        let (out, logits) = self
            .model
            .mtp_forward(backend, step, caches, &hidden)
            .map_err(|e| ExecutorError::Forward(e.to_string()))?;
        let vocab = self.model.info.vocab_size;
        let host = backend.download(&logits)?;
        drafts.extend(host.chunks(vocab.max(1)).map(crate::model::argmax));
        self.mtp_last = Some(out);
        Ok(())
    }

    fn step_kinds(&self) -> super::executor::StepKinds {
        super::executor::StepKinds {
            eager: self.eager_steps,
            decode_graph: self.graph_steps - self.mixed_graph_steps,
            mixed_graph: self.mixed_graph_steps,
        }
    }
}

impl<B: StepBackend> ModelRunner<B> {
    /// Enqueues `plan`'s forward pass (see [`Self::run_forward`]) and holds its sampling tail
    /// for [`Self::start_tail`]; `late_masks`: the plan's masks are sent with the tail (the
    /// device clock counts the wait for them as idle).
    fn start_forward(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
        late_masks: bool,
    ) -> Result<(), ExecutorError> {
        self.device_time = None;
        // A step launched and never finished is waited for first: its read-back shares the
        // buffers this one uses.
        self.finish(out)?;
        let ran = self
            .backend
            .step_clock_start()
            .map_err(ExecutorError::Backend)
            .and_then(|()| self.run_forward(plan, out, late_masks));
        match ran {
            Ok(tail) => {
                self.held = Some(tail);
                self.in_flight = true;
                Ok(())
            }
            Err(e) => Err(self.fail_launch(e)),
        }
    }

    /// Enqueues the held sampling tail of the launched step; `late_masks`: `plan`'s masks are
    /// sent first (computed while the forward pass ran).
    fn start_tail(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
        late_masks: bool,
    ) -> Result<(), ExecutorError> {
        let Some(tail) = self.held.take() else {
            return Err(ExecutorError::InvalidBatch(
                "a sampling tail launched with no forward pass before it".into(),
            ));
        };
        let forward = ExecutorError::Backend;
        let backend = &self.backend;
        let ran = match tail {
            Tail::Graph { out: i } => {
                match (self.graph_step.as_mut(), self.graph_outputs.get_mut(i)) {
                    (Some(gstep), Some(logits)) => (if late_masks {
                        backend.send_masks(plan, gstep)
                    } else {
                        Ok(())
                    })
                    .and_then(|()| backend.sample_start(logits, gstep, &mut out.cands))
                    .map_err(forward),
                    _ => Err(ExecutorError::Forward(
                        "a graph step without its output".into(),
                    )),
                }
            }
            Tail::Eager { mut logits } => match self.step.as_mut() {
                Some(step) => (if late_masks {
                    backend.send_masks(plan, step)
                } else {
                    Ok(())
                })
                .and_then(|()| backend.sample_start(&mut logits, step, &mut out.cands))
                .map_err(forward),
                None => Err(not_allocated()),
            },
        };
        ran.map_err(|e| {
            self.in_flight = false;
            self.fail_launch(e)
        })
    }

    /// A launch that failed: the clock is read even so, so that the next step starts a fresh
    /// measurement.
    fn fail_launch(&mut self, e: ExecutorError) -> ExecutorError {
        self.held = None;
        let _ = self.backend.step_clock_end();
        self.lost_or(e)
    }

    /// `e`, or the replica's loss when the device is out of service.
    fn lost_or(&self, e: ExecutorError) -> ExecutorError {
        if self.backend.is_lost() {
            ExecutorError::DeviceLost(e.to_string())
        } else {
            e
        }
    }

    /// The graph that takes `plan`, tried from the smallest bucket that holds it with `fits`
    /// (which packs or uploads the step for that bucket and says whether it fit), or `None`:
    /// run it eagerly.
    fn pick_graph(
        graphs: &[CapturedGraph],
        plan: &StepPlan,
        eager_verify: usize,
        mut fits: impl FnMut(GraphBucket) -> Result<bool, ExecutorError>,
    ) -> Result<Option<usize>, ExecutorError> {
        if plan.wants_full_rows() {
            return Ok(None);
        }
        let decodes = plan.seqs.iter().filter(|q| q.len == 1).count();
        if plan.tokens.len() <= eager_verify && plan.seqs.iter().any(|q| q.sample_all) {
            return Ok(None);
        }
        let prompts = plan.seqs.len() - decodes;
        let mut mixed_tries = 0;
        for (i, g) in graphs.iter().enumerate() {
            if !g.bucket.holds(plan.tokens.len(), decodes, prompts) {
                continue;
            }
            // A refused mixed bucket has planned the step: a few tries, then eagerly. (A
            // decode bucket refuses before planning.)
            if matches!(g.bucket, GraphBucket::Mixed { .. }) {
                mixed_tries += 1;
                if mixed_tries > MAX_MIXED_TRIES {
                    break;
                }
            }
            if fits(g.bucket)? {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// Uploads the step (or sends the one [`StepExecutor::prepare`] packed, its tokens
    /// rewritten) and enqueues its forward pass; returns where its sampling tail reads (the
    /// tail's read-back is waited for by `finish`). A step that a graph takes: slot ops,
    /// replay. `late_masks`: the tail waits for masks the host computes meanwhile.
    fn run_forward(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
        late_masks: bool,
    ) -> Result<Tail<B>, ExecutorError> {
        let packed = self.upload(plan)?;
        let (Some(caches), Some(step)) = (self.caches.as_mut(), self.step.as_mut()) else {
            return Err(not_allocated());
        };
        let forward = ExecutorError::Backend;
        let backend = &self.backend;
        out.full.vocab = self.model.info.vocab_size;
        out.full.data.clear();
        if let (Packed::Graph(i), Some(gstep)) = (packed, self.graph_step.as_mut()) {
            let g = &self.graphs[i];
            if matches!(g.bucket, GraphBucket::Mixed { .. }) {
                self.mixed_graph_steps += 1;
                self.model
                    .slot_ops(backend, gstep, caches)
                    .map_err(|e| ExecutorError::Forward(e.to_string()))?;
            }
            backend.replay_graph(g.id).map_err(forward)?;
            self.graph_steps += 1;
            if late_masks {
                backend.hold_tail().map_err(forward)?;
            }
            return Ok(Tail::Graph { out: g.out });
        }
        self.eager_steps += 1;
        let logits = self
            .model
            .forward(backend, step, caches)
            .map_err(|e| ExecutorError::Forward(e.to_string()))?;
        if plan.wants_full_rows() {
            out.full.data = backend.download(&logits).map_err(forward)?;
        }
        if late_masks {
            backend.hold_tail().map_err(forward)?;
        }
        Ok(Tail::Eager { logits })
    }

    /// Puts `plan`'s inputs on the device: the tokens of a step packed ahead
    /// ([`Self::pack_ahead`]), else the whole step, into a graph's buffers where one fits.
    fn upload(&mut self, plan: &StepPlan) -> Result<Packed, ExecutorError> {
        let (Some(caches), Some(step)) = (self.caches.as_ref(), self.step.as_mut()) else {
            return Err(not_allocated());
        };
        let invalid = ExecutorError::Backend;
        let backend = &self.backend;
        if let Some(p) = self.packed.take() {
            let target = match (p, self.graph_step.as_mut()) {
                (Packed::Graph(_), Some(gstep)) => gstep,
                (Packed::Graph(_), None) => {
                    return Err(ExecutorError::InvalidBatch(
                        "a step packed for a graph without graphs".into(),
                    ));
                }
                (Packed::Eager, _) => step,
            };
            backend.repack_tokens(plan, target).map_err(invalid)?;
            backend.send_step(target).map_err(invalid)?;
            return Ok(p);
        }
        caches
            .check(plan)
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        let blocks = self.graph_blocks;
        let graph = match self.graph_step.as_mut() {
            Some(gstep) => Self::pick_graph(&self.graphs, plan, eager_verify_tokens(), |bucket| {
                backend
                    .upload_graph_step(plan, gstep, bucket, blocks)
                    .map_err(invalid)
            })?,
            None => None,
        };
        if let Some(i) = graph {
            return Ok(Packed::Graph(i));
        }
        backend.upload_step(plan, step).map_err(invalid)?;
        Ok(Packed::Eager)
    }

    /// Packs `plan` on the host for its launch (see [`StepExecutor::prepare`]).
    fn pack_ahead(&mut self, plan: &StepPlan) -> Result<(), ExecutorError> {
        let (Some(caches), Some(step)) = (self.caches.as_mut(), self.step.as_mut()) else {
            return Err(not_allocated());
        };
        caches
            .check(plan)
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        let invalid = ExecutorError::Backend;
        let (backend, blocks) = (&self.backend, self.graph_blocks);
        if let Some(gstep) = self.graph_step.as_mut()
            && let Some(i) =
                Self::pick_graph(&self.graphs, plan, eager_verify_tokens(), |bucket| {
                    backend
                        .pack_step(plan, gstep, Some(bucket), blocks)
                        .map_err(invalid)
                })?
        {
            self.packed = Some(Packed::Graph(i));
            return Ok(());
        }
        // An eager step whose buffers must grow is packed at its launch instead, once the
        // device no longer reads them.
        if backend.pack_step(plan, step, None, 0).map_err(invalid)? {
            self.packed = Some(Packed::Eager);
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A verify step takes the mixed bucket like a prompt chunk of its tokens, unless the
    /// eager rule keeps verify steps of its size off the graphs.
    #[test]
    fn verify_steps_take_the_mixed_bucket_unless_kept_eager() {
        let graphs = [CapturedGraph {
            bucket: GraphBucket::Mixed {
                tokens: 32,
                decodes: 1,
                prompts: 2,
            },
            id: 0,
            out: 0,
        }];
        let plan = |tokens: usize, verify: bool| {
            let mut p = StepPlan::new(16);
            let toks: Vec<u32> = (0..tokens as u32).collect();
            p.push(&toks, 40, &[0, 1, 2, 3], 0, true).sample_all = verify;
            p.finish().unwrap();
            p
        };
        let pick = |p: &StepPlan, eager: usize| {
            type Runner = ModelRunner<crate::backend::cpu::CpuBackend>;
            Runner::pick_graph(&graphs, p, eager, |_| Ok(true)).unwrap()
        };
        assert_eq!(pick(&plan(5, true), 0), Some(0));
        assert_eq!(pick(&plan(5, true), 8), None);
        assert_eq!(pick(&plan(5, false), 8), Some(0));
        assert_eq!(pick(&plan(12, true), 8), Some(0));
    }
}
