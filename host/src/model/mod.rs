//! Models: Hugging Face folders in, a forward pass over batch inputs out.
//!
//! [`load`] reads `config.json`, picks the architecture file for `architectures[0]`, and
//! builds a [`Model`] from shared layers: an embedding, pre-norm residual sublayers, a final
//! norm and an LM head. The model owns weights only. The engine owns every cache and passes it
//! in ([`ModelCaches`]) together with [`BatchInputs`]; the model never allocates per-request
//! state and knows nothing of how blocks or slots were chosen.

pub mod arch;
pub mod batch;
pub mod builtin;
pub mod config;
pub mod layers;
pub mod weights;

use std::path::{Path, PathBuf};

pub use batch::{BatchInputs, CacheSpec, SeqChunk, SsmSnapshot};

use crate::backend::{Backend, BackendError, KvLayer, SsmLayer};
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
        "{path}: tensor `{tensor}` has dtype {dtype}; only f32, bf16, f16 and f64 weights load"
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

/// The caches a forward pass reads and writes, owned by the engine.
pub struct ModelCaches<B: Backend> {
    pub kv: Vec<KvLayer<B::Tensor>>,
    pub ssm: Vec<SsmLayer<B::Tensor>>,
    pub block_size: usize,
    pub num_blocks: usize,
    pub num_slots: usize,
}

impl<B: Backend> ModelCaches<B> {
    /// Zeroed caches: `num_blocks` KV blocks of `block_size` tokens per attention layer and
    /// `num_slots` SSM-state slots per SSM layer.
    pub fn new(
        backend: &B,
        spec: &CacheSpec,
        conv_shape: (usize, usize),
        ssm_shape: (usize, usize, usize),
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> Self {
        let kv_shape = [num_blocks, block_size, spec.kv_heads, spec.head_dim];
        let kv = (0..spec.attn_layers)
            .map(|_| KvLayer {
                k: backend.zeros(&kv_shape),
                v: backend.zeros(&kv_shape),
            })
            .collect();
        let ssm = (0..spec.ssm_layers)
            .map(|_| SsmLayer {
                conv: backend.zeros(&[num_slots, conv_shape.0, conv_shape.1]),
                ssm: backend.zeros(&[num_slots, ssm_shape.0, ssm_shape.1, ssm_shape.2]),
            })
            .collect();
        Self {
            kv,
            ssm,
            block_size,
            num_blocks,
            num_slots,
        }
    }

    /// Copies one SSM slot (every layer) to another: snapshot restore and save.
    pub fn copy_ssm_slot(&mut self, backend: &B, src: u32, dst: u32) -> Result<(), ModelError> {
        for layer in &mut self.ssm {
            backend.copy_slot(&mut layer.conv, src, dst)?;
            backend.copy_slot(&mut layer.ssm, src, dst)?;
        }
        Ok(())
    }

    /// Zeroes one SSM slot (every layer): a request that starts from scratch.
    pub fn zero_ssm_slot(&mut self, backend: &B, slot: u32) -> Result<(), ModelError> {
        for layer in &mut self.ssm {
            backend.zero_slot(&mut layer.conv, slot)?;
            backend.zero_slot(&mut layer.ssm, slot)?;
        }
        Ok(())
    }
}

/// A causal language model assembled from shared layers.
pub struct Model<B: Backend> {
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
}

impl<B: Backend> Model<B> {
    /// Zeroed caches sized for this model.
    pub fn new_caches(
        &self,
        backend: &B,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
    ) -> ModelCaches<B> {
        ModelCaches::new(
            backend,
            &self.info.cache,
            self.conv_shape,
            self.ssm_shape,
            num_blocks,
            block_size,
            num_slots,
        )
    }

    /// One forward pass over the batch. Returns logits rows (`[rows, vocab]`, row-major).
    pub fn forward(
        &self,
        backend: &B,
        inputs: &BatchInputs,
        caches: &mut ModelCaches<B>,
        mode: LogitsMode,
    ) -> Result<Vec<f32>, ModelError> {
        validate(inputs, caches)?;
        let mut h = backend.embedding(&self.embed, &inputs.tokens)?;
        let mut ctx = StepCtx {
            positions: &inputs.positions,
            seqs: &inputs.seqs,
            kv: &mut caches.kv,
            ssm: &mut caches.ssm,
            block_size: caches.block_size,
        };
        for layer in &self.layers {
            layer.forward(backend, &mut h, &mut ctx)?;
        }
        let rows: Vec<u32> = match mode {
            LogitsMode::Last => inputs
                .seqs
                .iter()
                .flat_map(|s| {
                    let end = s.offset + s.len;
                    let first = match (s.all_logits, s.want_logits) {
                        (true, _) => s.offset,
                        (false, true) => end - 1,
                        (false, false) => end,
                    };
                    (first as u32)..(end as u32)
                })
                .collect(),
            LogitsMode::All => (0..inputs.tokens.len() as u32).collect(),
        };
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let h = backend.gather_rows(&h, &rows)?;
        let h = self.final_norm.forward(backend, &h)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(backend, &h)?,
            None => backend.linear(&h, &self.embed, None)?,
        };
        Ok(backend.to_host(&logits))
    }
}

fn validate<B: Backend>(inputs: &BatchInputs, caches: &ModelCaches<B>) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::Backend(format!("invalid batch: {m}")));
    if inputs.positions.len() != inputs.tokens.len() {
        return bad("positions and tokens differ in length".into());
    }
    let mut next = 0;
    for s in &inputs.seqs {
        if s.offset != next || s.len == 0 {
            return bad(format!(
                "chunk at {} of {} tokens is not contiguous",
                s.offset, s.len
            ));
        }
        next += s.len;
        let needed = (s.context_len + s.len).div_ceil(caches.block_size.max(1));
        if !caches.kv.is_empty() && s.block_table.len() < needed {
            return bad(format!(
                "block table has {} blocks, {needed} needed",
                s.block_table.len()
            ));
        }
        if !caches.ssm.is_empty() && s.ssm_slot as usize >= caches.num_slots {
            return bad(format!(
                "SSM slot {} out of {}",
                s.ssm_slot, caches.num_slots
            ));
        }
    }
    if next != inputs.tokens.len() {
        return bad("chunks do not cover the tokens".into());
    }
    Ok(())
}

/// Loads the model in `dir` (Hugging Face layout) onto `backend`.
pub fn load<B: Backend>(dir: &Path, backend: &B) -> Result<Model<B>, ModelError> {
    if !dir.is_dir() {
        return Err(ModelError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "model folder not found"),
        });
    }
    let config = config::HfConfig::load(dir)?;
    let store = weights::WeightStore::open(dir)?;
    arch::build(&config, &store, backend)
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
pub fn greedy_generate<B: Backend>(
    model: &Model<B>,
    backend: &B,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    prefill_chunk: usize,
) -> Result<Vec<u32>, ModelError> {
    const BLOCK: usize = 16;
    if prompt.is_empty() {
        return Err(ModelError::Unsupported(
            "an empty prompt has nothing to continue".into(),
        ));
    }
    let total = prompt.len() + max_tokens;
    let blocks = total.div_ceil(BLOCK);
    let mut caches = model.new_caches(backend, blocks, BLOCK, 1);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut done = 0;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(prefill_chunk.max(1)) {
        let mut batch = BatchInputs::default();
        let last = done + chunk.len() == prompt.len();
        batch.push(chunk, done, table.clone(), 0, last);
        logits = model.forward(backend, &batch, &mut caches, LogitsMode::Last)?;
        done += chunk.len();
    }
    let mut out = Vec::with_capacity(max_tokens);
    for _ in 0..max_tokens {
        let next = argmax(&logits);
        out.push(next);
        if stop_ids.contains(&next) || out.len() == max_tokens {
            break;
        }
        let mut batch = BatchInputs::default();
        batch.push(&[next], done, table.clone(), 0, true);
        logits = model.forward(backend, &batch, &mut caches, LogitsMode::Last)?;
        done += 1;
    }
    Ok(out)
}
