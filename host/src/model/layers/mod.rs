//! Layers shared by every architecture: written once, composed by the files in `arch/`.
//!
//! A model is an embedding, a stack of pre-norm residual [`Sublayer`]s (`h += mixer(norm(h))`)
//! and a final norm + LM head. What differs between architectures is only which mixers appear
//! in which order and how tensors are named on disk.

pub mod attention;
pub mod gated_attention;
pub mod gated_delta_net;
pub mod mamba2;
pub mod mlp;
pub mod moe;
pub mod rope;

use super::ModelError;
use super::weights::WeightStore;
use crate::backend::{HostTensor, KvLayer, KvScales, LayerOps, SsmPools};

pub use attention::Attention;
pub use gated_attention::GatedAttention;
pub use gated_delta_net::GatedDeltaNet;
pub use mamba2::Mamba2Mixer;
pub use mlp::Mlp;
pub use moe::Moe;

/// Loads named tensors with shape checks, for one backend.
pub struct Loader<'a, B: LayerOps> {
    pub store: &'a WeightStore,
    pub backend: &'a B,
    /// Load the checkpoint's MTP head, where the architecture has one.
    pub mtp: bool,
}

impl<B: LayerOps> Loader<'_, B> {
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<B::Tensor, ModelError> {
        self.store.load(self.backend, name, shape)
    }

    pub fn optional(&self, name: &str, shape: &[usize]) -> Result<Option<B::Tensor>, ModelError> {
        if self.store.has(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The FP8 KV-cache scales an attention module's checkpoint carries (`{prefix}.k_scale` and
    /// `{prefix}.v_scale`, one value each, as vLLM reads them), or `None`. Used only when the
    /// cache is FP8 (`cache.kv_dtype`); one without the other, or a scale that is not a
    /// positive finite number, is an error naming the tensor.
    pub fn kv_scales(&self, prefix: &str) -> Result<Option<KvScales>, ModelError> {
        let (k, v) = (format!("{prefix}.k_scale"), format!("{prefix}.v_scale"));
        if !self.store.has(&k) && !self.store.has(&v) {
            return Ok(None);
        }
        let one = |name: &str| -> Result<f32, ModelError> {
            let (values, _) = self.store.read_f32(name)?;
            match values[..] {
                [x] if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(ModelError::Unsupported(format!(
                    "{name}: an FP8 KV-cache scale must be one positive finite value, found {values:?}"
                ))),
            }
        };
        Ok(Some(KvScales {
            k: one(&k)?,
            v: one(&v)?,
        }))
    }

    /// `{prefix}.weight` `[out, inp]` and, when `bias`, `{prefix}.bias` `[out]`. The weight is
    /// FP8 where the checkpoint or online quantization makes it so
    /// ([`WeightStore::load_linear`]).
    pub fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear<B>, ModelError> {
        let w = self.store.load_linear(self.backend, prefix, &[out, inp])?;
        let b = if bias {
            Some(self.tensor(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }

    /// `name` (exactly `shape`) widened to f32 on the host, for load-time rewrites: config
    /// multipliers folded into weights, fused tensors split.
    pub fn host_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.tensor(name, shape)?;
        Ok(self.backend.download(&t)?)
    }

    /// Uploads host values of `shape` (converted to the backend's dtype there).
    pub fn upload_f32(&self, values: &[f32], shape: &[usize]) -> Result<B::Tensor, ModelError> {
        Ok(self.backend.upload(HostTensor::f32(values, shape))?)
    }

    pub fn rms_norm(&self, name: &str, width: usize, eps: f64) -> Result<RmsNorm<B>, ModelError> {
        Ok(RmsNorm {
            w: self.tensor(name, &[width])?,
            eps: eps as f32,
        })
    }
}

// ---- zero-centred norms (Qwen3-Next, Qwen3.5) -------------------------------------------

impl<B: LayerOps> Loader<'_, B> {
    /// An RMS norm whose checkpoint stores `w − 1` (the model scales by `1 + w`, computed in
    /// f32 as transformers does): the weight is offset once at load. Dummy weights are made up
    /// as ones, which stand for the offset weight.
    pub fn rms_norm_centred(
        &self,
        name: &str,
        width: usize,
        eps: f64,
    ) -> Result<RmsNorm<B>, ModelError> {
        if self.store.is_dummy() {
            return self.rms_norm(name, width, eps);
        }
        let (mut w, shape) = self.store.read_f32(name)?;
        if shape != [width] {
            return Err(ModelError::TensorShape {
                path: self.store.path_of(name),
                tensor: name.to_string(),
                got: shape,
                expected: vec![width],
            });
        }
        for v in &mut w {
            *v += 1.0;
        }
        Ok(RmsNorm {
            w: self.backend.upload(HostTensor::f32(&w, &[width]))?,
            eps: eps as f32,
        })
    }
}

/// A dense projection `y = x·Wᵀ (+ b)`.
pub struct Linear<B: LayerOps> {
    pub w: B::Tensor,
    pub b: Option<B::Tensor>,
}

impl<B: LayerOps> Linear<B> {
    pub fn forward(&self, backend: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(backend.linear(x, &self.w, self.b.as_ref())?)
    }

    /// Several projections of the same input ([`LayerOps::linear_shared`]: one launch where the
    /// device can).
    pub fn forward_shared<const N: usize>(
        backend: &B,
        x: &B::Tensor,
        layers: [&Self; N],
    ) -> Result<[B::Tensor; N], ModelError> {
        let weights = layers.map(|l| (&l.w, l.b.as_ref()));
        let outs = backend.linear_shared(x, &weights)?;
        outs.try_into().map_err(|v: Vec<B::Tensor>| {
            ModelError::Backend(format!("linear_shared gave {} outputs for {N}", v.len()))
        })
    }

    /// The layer `y_j = out_scale(j) · ((in_scale · x)·W_jᵀ + b_j)`, with the multipliers folded
    /// into the weights once at load (µP-style config multipliers; the kernels see a plain
    /// linear). Unchanged, and not copied, when every factor is 1.
    pub fn scaled(
        self,
        l: &Loader<'_, B>,
        in_scale: f32,
        out_scale: impl Fn(usize) -> f32,
    ) -> Result<Self, ModelError> {
        let shape = l.backend.shape(&self.w).to_vec();
        let [rows, cols] = shape[..] else {
            return Err(ModelError::Backend(format!(
                "scaled linear: weight of shape {shape:?}"
            )));
        };
        if in_scale == 1.0 && (0..rows).all(|r| out_scale(r) == 1.0) {
            return Ok(self);
        }
        let mut w = l.backend.download(&self.w)?;
        for (r, row) in w.chunks_exact_mut(cols).enumerate() {
            let f = in_scale * out_scale(r);
            row.iter_mut().for_each(|v| *v *= f);
        }
        let b = match &self.b {
            Some(b) => {
                let mut b = l.backend.download(b)?;
                b.iter_mut()
                    .enumerate()
                    .for_each(|(r, v)| *v *= out_scale(r));
                Some(l.upload_f32(&b, &[rows])?)
            }
            None => None,
        };
        Ok(Self {
            w: l.upload_f32(&w, &[rows, cols])?,
            b,
        })
    }
}

pub struct RmsNorm<B: LayerOps> {
    pub w: B::Tensor,
    pub eps: f32,
}

impl<B: LayerOps> RmsNorm<B> {
    pub fn forward(&self, backend: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(backend.rms_norm(x, &self.w, self.eps)?)
    }
}

/// Everything a mixer may need besides its input: the uploaded step and the caches.
pub struct StepCtx<'a, B: LayerOps> {
    pub step: &'a B::Step,
    pub kv: &'a mut [KvLayer<B::Tensor>],
    pub ssm: Option<&'a mut SsmPools<B::Tensor>>,
}

/// The token mixer (or channel mixer) inside one residual sublayer.
pub enum Mixer<B: LayerOps> {
    /// `cache` indexes the model's attention layers.
    Attention(Attention<B>),
    /// `cache` indexes the model's SSM layers.
    Mamba2(Mamba2Mixer<B>),
    /// Gated attention (Qwen3-Next, Qwen3.5); `cache` indexes the attention layers.
    GatedAttention(GatedAttention<B>),
    /// Gated DeltaNet; `cache` indexes the recurrent layers (shared with Mamba2's).
    GatedDeltaNet(GatedDeltaNet<B>),
    Mlp(Mlp<B>),
    Moe(Moe<B>),
    /// Several mixers on the same input, their outputs summed (Falcon-H1: Mamba2 ‖ attention).
    Parallel(Vec<Mixer<B>>),
}

impl<B: LayerOps> Mixer<B> {
    pub fn forward(
        &self,
        backend: &B,
        x: &B::Tensor,
        ctx: &mut StepCtx<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        match self {
            Mixer::Attention(a) => a.forward(backend, x, ctx),
            Mixer::Mamba2(m) => m.forward(backend, x, ctx),
            Mixer::GatedAttention(a) => a.forward(backend, x, ctx),
            Mixer::GatedDeltaNet(m) => m.forward(backend, x, ctx),
            Mixer::Mlp(m) => m.forward(backend, x),
            Mixer::Moe(m) => m.forward(backend, x),
            Mixer::Parallel(parts) => {
                let mut parts = parts.iter();
                let first = parts
                    .next()
                    .ok_or_else(|| ModelError::Backend("an empty parallel mixer".into()))?;
                let mut y = first.forward(backend, x, ctx)?;
                for part in parts {
                    backend.add_assign(&mut y, &part.forward(backend, x, ctx)?)?;
                }
                Ok(y)
            }
        }
    }
}

/// `h += mixer(norm(h))`.
pub struct Sublayer<B: LayerOps> {
    pub norm: RmsNorm<B>,
    pub mixer: Mixer<B>,
}

impl<B: LayerOps> Mixer<B> {
    /// Calls `f(cache, scales)` for each attention layer in this mixer with the checkpoint's
    /// FP8 KV-cache scales.
    pub fn each_kv_scales(&self, f: &mut impl FnMut(usize, KvScales)) {
        match self {
            Mixer::Attention(a) => a.kv_scales.into_iter().for_each(|s| f(a.cache, s)),
            Mixer::GatedAttention(a) => a.kv_scales.into_iter().for_each(|s| f(a.cache, s)),
            Mixer::Parallel(parts) => parts.iter().for_each(|m| m.each_kv_scales(f)),
            Mixer::Mamba2(_) | Mixer::GatedDeltaNet(_) | Mixer::Mlp(_) | Mixer::Moe(_) => {}
        }
    }
}

impl<B: LayerOps> Sublayer<B> {
    pub fn forward(
        &self,
        backend: &B,
        h: &mut B::Tensor,
        ctx: &mut StepCtx<'_, B>,
    ) -> Result<(), ModelError> {
        let x = self.norm.forward(backend, h)?;
        let y = self.mix(backend, &x, ctx)?;
        backend.add_assign(h, &y)?;
        Ok(())
    }

    /// The mixer alone, on the already normalised input: `mixer(x)`.
    pub fn mix(
        &self,
        backend: &B,
        x: &B::Tensor,
        ctx: &mut StepCtx<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        self.mixer.forward(backend, x, ctx)
    }
}
