//! Models: Hugging Face folders in, a forward pass over batch inputs out.
//!
//! [`load`] reads `config.json`, picks the architecture file for `architectures[0]`, and
//! builds a [`Model`] from shared layers: an embedding, pre-norm residual sublayers, a final
//! norm and an LM head. The model owns weights only. The engine owns every cache and passes it
//! in ([`ModelCaches`]) together with the backend's step object (uploaded once from a
//! [`StepPlan`]); the model never allocates per-request state, never reads host-side batch
//! data, and knows nothing of how blocks or slots were chosen. Model code may branch on
//! shapes, never on token values or per-sequence lengths.

pub mod arch;
pub mod batch;
pub mod builtin;
pub mod config;
pub mod gguf;
pub mod hub;
pub mod layers;
pub mod mtp;
pub mod quant;
pub mod weights;

use std::path::{Path, PathBuf};

use crate::cache::{KvCacheDtype, SsmStateDtype};
pub use batch::{CacheSpec, SsmSnapshot};

use crate::backend::{
    BackendError, DType, KvLayer, KvScales, LayerOps, SsmPools, StepBackend, StepPlan,
};
use layers::{Linear, RmsNorm, StepCtx, Sublayer};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Weights { path: PathBuf, message: String },
    #[error("tensor `{tensor}` not found in {files}")]
    MissingTensor { tensor: String, files: String },
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        tensor: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "{path}: tensor `{tensor}` has dtype {dtype}; only f32, bf16, f16, f64 and FP8 e4m3 \
         (with scales) weights load"
    )]
    TensorDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("unsupported architecture `{0}` (supported: {supported})", supported = arch::SUPPORTED.join(", "))]
    UnsupportedArchitecture(String),
    #[error("unsupported model setting: {0}")]
    Unsupported(String),
    #[error("backend: {0}")]
    Backend(String),
}

impl From<BackendError> for ModelError {
    fn from(e: BackendError) -> Self {
        ModelError::Backend(e.to_string())
    }
}

/// Facts about a loaded model that the rest of the system needs.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub cache: CacheSpec,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Per chunk, in order: every token when `all_logits`, else the last token when
    /// `want_logits`.
    Last,
    /// Every token of every chunk (one row per token; prompt logprobs, parity tests).
    All,
}

/// Storage types of a model's caches (`cache.kv_dtype`, `cache.ssm_state_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheDtypes {
    pub kv: KvCacheDtype,
    pub ssm_state: SsmStateDtype,
}

/// The caches a forward pass reads and writes, owned by the engine.
pub struct ModelCaches<B: LayerOps> {
    pub kv: Vec<KvLayer<B::Tensor>>,
    /// Slot-major state of every SSM layer (`None` for models without SSM layers).
    pub ssm: Option<SsmPools<B::Tensor>>,
    pub block_size: usize,
    pub num_blocks: usize,
    pub num_slots: usize,
    /// Keep every row's final hidden state ([`Self::hidden`]) in each forward pass: the MTP
    /// head reads them.
    pub keep_hidden: bool,
    /// The last forward pass's final (normalised) hidden state of every row, `[tokens,
    /// hidden]`, when `keep_hidden`.
    pub hidden: Option<B::Tensor>,
}

impl<B: LayerOps> ModelCaches<B> {
    /// Zeroed caches: `num_blocks` KV blocks of `block_size` tokens per attention layer and
    /// `num_slots` SSM-state slots holding every SSM layer. K and V are stored as
    /// `dtypes.kv` (FP8 with `kv_scales[layer]`, 1.0 where the list is short), the recurrent
    /// state as `dtypes.ssm_state` where the backend can (bf16 is opt-in), else f32.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: &B,
        spec: &CacheSpec,
        conv_shape: (usize, usize),
        ssm_shape: (usize, usize, usize),
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
        dtypes: CacheDtypes,
        kv_scales: &[KvScales],
    ) -> Result<Self, ModelError> {
        let kv_shape = [num_blocks, block_size, spec.kv_heads, spec.head_dim];
        let kv_dtype = if dtypes.kv.is_fp8() {
            DType::F8E4M3
        } else {
            backend.act_dtype()
        };
        let kv = (0..spec.attn_layers)
            .map(|layer| {
                Ok(KvLayer {
                    k: backend.zeros(&kv_shape, kv_dtype)?,
                    v: backend.zeros(&kv_shape, kv_dtype)?,
                    fp8: dtypes
                        .kv
                        .is_fp8()
                        .then(|| kv_scales.get(layer).copied().unwrap_or_default()),
                })
            })
            .collect::<Result<_, BackendError>>()?;
        let layers = spec.ssm_layers;
        let ssm = if layers > 0 {
            Some(SsmPools {
                conv: backend
                    .zeros(&[num_slots, layers, conv_shape.0, conv_shape.1], DType::F32)?,
                ssm: backend.zeros(
                    &[num_slots, layers, ssm_shape.0, ssm_shape.1, ssm_shape.2],
                    if dtypes.ssm_state == SsmStateDtype::Bfloat16 && backend.bf16_ssm_state() {
                        DType::BF16
                    } else {
                        DType::F32
                    },
                )?,
                slots: num_slots,
                layers,
            })
        } else {
            None
        };
        Ok(Self {
            kv,
            ssm,
            block_size,
            num_blocks,
            num_slots,
            keep_hidden: false,
            hidden: None,
        })
    }

    /// Checks the plan against the caches' sizes (block ids, table lengths, slots).
    pub fn check(&self, plan: &StepPlan) -> Result<(), ModelError> {
        if plan.block_size != self.block_size && !self.kv.is_empty() {
            return Err(ModelError::Backend(format!(
                "invalid batch: block size {} for caches of {}",
                plan.block_size, self.block_size
            )));
        }
        plan.check_caches(
            self.num_blocks,
            !self.kv.is_empty(),
            self.num_slots,
            self.ssm.is_some(),
        )
        .map_err(|e| ModelError::Backend(e.to_string()))
    }
}

/// A causal language model assembled from shared layers.
pub struct Model<B: LayerOps> {
    pub info: ModelInfo,
    pub embed: B::Tensor,
    pub layers: Vec<Sublayer<B>>,
    pub final_norm: RmsNorm<B>,
    /// None when the embeddings are tied.
    pub lm_head: Option<Linear<B>>,
    /// Conv state `(channels, kernel − 1)` and recurrent state `(heads, head_dim, state)` per
    /// SSM slot, for sizing caches (zeros when the model has no SSM layers).
    pub conv_shape: (usize, usize),
    pub ssm_shape: (usize, usize, usize),
    /// Config multipliers applied to activations (1 unless the architecture sets them): the
    /// embedding output (Granite, Falcon-H1 `embedding_multiplier`) and the logits (Granite
    /// `1 / logits_scaling`, Falcon-H1 `lm_head_multiplier`). Multipliers inside the layers
    /// are folded into their weights at load.
    pub embed_scale: f32,
    pub logits_scale: f32,
    /// The multi-token-prediction head, loaded when asked for ([`LoadOptions::mtp`]) and the
    /// checkpoint has one; its attention layer is the last of `info.cache.attn_layers`.
    pub mtp: Option<mtp::MtpHead<B>>,
}

impl<B: LayerOps> Model<B> {
    /// The cache layout on `backend`: its KV blocks hold the backend's activation dtype (bf16
    /// on a serving GPU), which is what [`ModelCaches::new`] allocates. Planning with the f32
    /// size of [`ModelInfo::cache`] would leave half of a bf16 budget unused.
    pub fn cache_spec_on(&self, backend: &B) -> CacheSpec {
        CacheSpec {
            kv_elem_bytes: backend.act_dtype().size(),
            ..self.info.cache.clone()
        }
    }

    /// Zeroed caches sized for this model, K, V and the recurrent state in the backend's
    /// own dtypes.
    pub fn new_caches(
        &self,
        backend: &B,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Result<ModelCaches<B>, ModelError> {
        self.new_caches_with(
            backend,
            num_blocks,
            block_size,
            num_slots,
            CacheDtypes::default(),
        )
    }

    /// [`Self::new_caches`] with K and V stored as `dtypes.kv` (an FP8 cache takes the
    /// checkpoint's scales, [`Self::kv_scales`]) and the recurrent state as `dtypes.ssm_state`
    /// (where the backend supports it).
    pub fn new_caches_with(
        &self,
        backend: &B,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
        dtypes: CacheDtypes,
    ) -> Result<ModelCaches<B>, ModelError> {
        ModelCaches::new(
            backend,
            &self.info.cache,
            self.conv_shape,
            self.ssm_shape,
            num_blocks,
            block_size,
            num_slots,
            dtypes,
            &self.kv_scales(),
        )
    }

    /// The FP8 KV-cache scales of each attention layer (its cache index): the checkpoint's
    /// where it has them, else 1.0.
    pub fn kv_scales(&self) -> Vec<KvScales> {
        let mut scales = vec![KvScales::default(); self.info.cache.attn_layers];
        for l in &self.layers {
            l.mixer.each_kv_scales(&mut |cache, s| {
                if let Some(slot) = scales.get_mut(cache) {
                    *slot = s;
                }
            });
        }
        scales
    }

    /// The step's SSM slot restores and zeros, the first part of [`Self::forward`] (a mixed
    /// CUDA graph step runs them on their own before its replay).
    pub fn slot_ops(
        &self,
        backend: &B,
        step: &B::Step,
        caches: &mut ModelCaches<B>,
    ) -> Result<(), ModelError> {
        if let Some(pools) = caches.ssm.as_mut() {
            backend.ssm_slot_ops(pools, step)?;
        }
        Ok(())
    }

    /// One forward pass over the uploaded step. Returns the logits of the step's
    /// `logit_rows`, `[rows, vocab]`, on the backend.
    pub fn forward(
        &self,
        backend: &B,
        step: &B::Step,
        caches: &mut ModelCaches<B>,
    ) -> Result<B::Tensor, ModelError> {
        self.slot_ops(backend, step, caches)?;
        let mut h = backend.embedding(&self.embed, step)?;
        if self.embed_scale != 1.0 {
            backend.scale_assign(&mut h, self.embed_scale)?;
        }
        let mut ctx = StepCtx {
            step,
            kv: &mut caches.kv,
            ssm: caches.ssm.as_mut(),
        };
        let keep = caches.keep_hidden;
        let (all, h) =
            self.run_layers(backend, &self.layers, h, &mut ctx, &self.final_norm, keep)?;
        if keep {
            caches.hidden = all;
        }
        self.logits(backend, &h)
    }

    /// `layers` over `h`, then `norm`: the normalised hidden state of the step's logit rows,
    /// and with `keep_all` of every row as well. Each sublayer's residual add is fused into
    /// the next norm (`add_rms_norm`); the last one into the final norm, over the logit rows
    /// only unless every row is kept.
    pub(crate) fn run_layers(
        &self,
        backend: &B,
        layers: &[Sublayer<B>],
        mut h: B::Tensor,
        ctx: &mut StepCtx<'_, B>,
        norm: &RmsNorm<B>,
        keep_all: bool,
    ) -> Result<(Option<B::Tensor>, B::Tensor), ModelError> {
        let step = ctx.step;
        let mut pending: Option<B::Tensor> = None;
        for layer in layers {
            let x = match pending.take() {
                None => layer.norm.forward(backend, &h)?,
                Some(y) => backend.add_rms_norm(&mut h, &y, &layer.norm.w, layer.norm.eps)?,
            };
            pending = Some(layer.mix(backend, &x, ctx)?);
        }
        if keep_all {
            let all = match pending {
                None => norm.forward(backend, &h)?,
                Some(y) => backend.add_rms_norm(&mut h, &y, &norm.w, norm.eps)?,
            };
            let rows = backend.gather_logit_rows(&all, step)?;
            return Ok((Some(all), rows));
        }
        let mut h = backend.gather_logit_rows(&h, step)?;
        let h = match pending {
            None => norm.forward(backend, &h)?,
            Some(y) => {
                let y = backend.gather_logit_rows(&y, step)?;
                backend.add_rms_norm(&mut h, &y, &norm.w, norm.eps)?
            }
        };
        Ok((None, h))
    }

    /// The LM head (shared by the MTP head) over normalised hidden rows.
    pub(crate) fn logits(&self, backend: &B, h: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let mut logits = match &self.lm_head {
            Some(head) => head.forward(backend, h)?,
            None => backend.linear(h, &self.embed, None)?,
        };
        if self.logits_scale != 1.0 {
            backend.scale_assign(&mut logits, self.logits_scale)?;
        }
        Ok(logits)
    }
}

/// The reference path runs whole steps: it builds and uploads them as the model runner does.
impl<B: StepBackend> Model<B> {
    /// The reference path for tests and `chimera generate`: finishes `plan` (every token's
    /// logits when `mode` is [`LogitsMode::All`]), uploads it, runs the pass and returns the
    /// logits rows on the host.
    pub fn forward_host(
        &self,
        backend: &B,
        plan: &mut StepPlan,
        caches: &mut ModelCaches<B>,
        mode: LogitsMode,
    ) -> Result<Vec<f32>, ModelError> {
        if mode == LogitsMode::All {
            for s in &mut plan.seqs {
                s.all_logits = true;
                s.want_logits = true;
            }
        }
        plan.finish().map_err(BackendError::from)?;
        caches.check(plan)?;
        let mut step = backend.new_step(plan.num_tokens())?;
        backend.upload_step(plan, &mut step)?;
        let logits = self.forward(backend, &step, caches)?;
        Ok(backend.download(&logits)?)
    }
}

/// How a model is loaded beyond its files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// `model.quantization = "fp8"`: bf16 projections are quantized to FP8 at load
    /// ([`quant`]).
    pub fp8: bool,
    /// `speculative.method = "mtp"`: the checkpoint's MTP head is loaded (else its `mtp.*`
    /// tensors are left unread).
    pub mtp: bool,
}

/// Loads the model in `dir` (Hugging Face layout) onto `backend`.
pub fn load<B: LayerOps>(dir: &Path, backend: &B) -> Result<Model<B>, ModelError> {
    load_with(dir, backend, LoadOptions::default())
}

/// [`load`] with options (online quantization).
pub fn load_with<B: LayerOps>(
    dir: &Path,
    backend: &B,
    options: LoadOptions,
) -> Result<Model<B>, ModelError> {
    if !dir.is_dir() {
        return Err(ModelError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "model folder not found"),
        });
    }
    let config = config::HfConfig::load(dir)?;
    let mut store = weights::WeightStore::open(dir)?;
    store.set_quantization(quant::Quantization::from_config(&config, options.fp8)?);
    arch::build(&config, &store, backend, options)
}

/// Builds the model described by the `config.json` in `dir` (or the file itself) with
/// made-up weights (`model.load_format = "dummy"`): seeded random values of the right shapes,
/// norm weights ones. Full-size configs run without their checkpoints.
pub fn load_dummy<B: LayerOps>(
    path: &Path,
    backend: &B,
    seed: u64,
) -> Result<Model<B>, ModelError> {
    load_dummy_with(path, backend, seed, LoadOptions::default())
}

/// [`load_dummy`] with options: FP8 projections (made-up values quantized per row) where
/// the config's `quantization_config` or `options` asks for them.
pub fn load_dummy_with<B: LayerOps>(
    path: &Path,
    backend: &B,
    seed: u64,
    options: LoadOptions,
) -> Result<Model<B>, ModelError> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let config = config::HfConfig::load(&dir)?;
    let mut store = weights::WeightStore::dummy(seed);
    store.set_quantization(quant::Quantization::from_config(&config, options.fp8)?);
    arch::build(&config, &store, backend, options)
}

/// Index of the largest value (first on ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of one sequence straight on the model, with private caches: the reference
/// path used by `chimera generate` and the parity tests (the engine is the serving path).
/// Prefills `prompt` in chunks of at most `prefill_chunk` tokens, then decodes up to
/// `max_tokens`, stopping after any of `stop_ids`.
pub fn greedy_generate<B: StepBackend>(
    model: &Model<B>,
    backend: &B,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    prefill_chunk: usize,
) -> Result<Vec<u32>, ModelError> {
    let dtypes = CacheDtypes::default();
    greedy_generate_cached(
        model,
        backend,
        prompt,
        (max_tokens, stop_ids),
        prefill_chunk,
        dtypes,
    )
}

/// [`greedy_generate`] (`until`: its `max_tokens` and `stop_ids`) with caches of `dtypes`
/// (an FP8 KV cache, say): the reference of the engine with those caches.
pub fn greedy_generate_cached<B: StepBackend>(
    model: &Model<B>,
    backend: &B,
    prompt: &[u32],
    (max_tokens, stop_ids): (usize, &[u32]),
    prefill_chunk: usize,
    dtypes: CacheDtypes,
) -> Result<Vec<u32>, ModelError> {
    const BLOCK: usize = 16;
    if prompt.is_empty() {
        return Err(ModelError::Unsupported(
            "an empty prompt has nothing to continue".into(),
        ));
    }
    let total = prompt.len() + max_tokens;
    let blocks = total.div_ceil(BLOCK);
    let mut caches = model.new_caches_with(backend, blocks, BLOCK, 1, dtypes)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut done = 0;
    let mut logits = Vec::new();
    let mut plan = StepPlan::default();
    for chunk in prompt.chunks(prefill_chunk.max(1)) {
        plan.clear(BLOCK);
        if done == 0 {
            plan.slot_ops.push(crate::backend::SlotOp::Zero { slot: 0 });
        }
        let last = done + chunk.len() == prompt.len();
        plan.push(chunk, done, &table, 0, last);
        logits = model.forward_host(backend, &mut plan, &mut caches, LogitsMode::Last)?;
        done += chunk.len();
    }
    let mut out = Vec::with_capacity(max_tokens);
    for _ in 0..max_tokens {
        let next = argmax(&logits);
        out.push(next);
        if stop_ids.contains(&next) || out.len() == max_tokens {
            break;
        }
        plan.clear(BLOCK);
        plan.push(&[next], done, &table, 0, true);
        logits = model.forward_host(backend, &mut plan, &mut caches, LogitsMode::Last)?;
        done += 1;
    }
    Ok(out)
}
