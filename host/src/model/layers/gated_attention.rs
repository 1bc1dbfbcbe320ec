//! Gated attention (Qwen3-Next, Qwen3.5 "full attention" layers): grouped-KV attention with
//! per-head RMS norms on q and k (zero-centred weights), partial RoPE after the norms, and an
//! output gate: `o_proj(attn · sigmoid(gate))`, where the gate comes from the same projection
//! as q.
//!
//! On disk `q_proj` has `2 · heads · head_dim` rows grouped per head (`[q_h, gate_h]`); the
//! rows are regrouped once at load into `[q | gate]` so the step splits columns only.

use super::{Linear, Loader, RmsNorm, StepCtx};
use crate::backend::{AttnShape, HostTensor, KvScales, LayerOps, Rope};
use crate::model::ModelError;

pub struct GatedAttention<B: LayerOps> {
    /// `[q (heads·head_dim) | gate (heads·head_dim)]` rows.
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    pub q_norm: RmsNorm<B>,
    pub k_norm: RmsNorm<B>,
    pub shape: AttnShape,
    pub rope: Rope,
    /// Index of this layer among the model's attention layers (its KV cache).
    pub cache: usize,
    /// The checkpoint's FP8 KV-cache scales, if it has them.
    pub kv_scales: Option<KvScales>,
}

/// What an architecture file states about one gated attention layer.
pub struct GatedAttentionSpec {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub bias: bool,
    pub eps: f64,
    pub rope: Rope,
    pub cache: usize,
}

impl<B: LayerOps> GatedAttention<B> {
    pub fn load(
        l: &Loader<'_, B>,
        prefix: &str,
        s: GatedAttentionSpec,
    ) -> Result<Self, ModelError> {
        if s.heads == 0 || s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return Err(ModelError::Unsupported(format!(
                "{} attention heads with {} KV heads (must divide evenly)",
                s.heads, s.kv_heads
            )));
        }
        let (q_out, kv_out) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let p = |n: &str| format!("{prefix}.{n}");
        let q = Linear {
            w: per_head_halves(l, &p("q_proj.weight"), s.heads, s.head_dim, s.hidden)?,
            b: match s.bias {
                true => Some(per_head_halves(
                    l,
                    &p("q_proj.bias"),
                    s.heads,
                    s.head_dim,
                    1,
                )?),
                false => None,
            },
        };
        Ok(Self {
            q,
            k: l.linear(&p("k_proj"), kv_out, s.hidden, s.bias)?,
            v: l.linear(&p("v_proj"), kv_out, s.hidden, s.bias)?,
            o: l.linear(&p("o_proj"), s.hidden, q_out, s.bias)?,
            q_norm: l.rms_norm_centred(&p("q_norm.weight"), s.head_dim, s.eps)?,
            k_norm: l.rms_norm_centred(&p("k_norm.weight"), s.head_dim, s.eps)?,
            shape: AttnShape {
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                scale: (s.head_dim as f32).powf(-0.5),
            },
            rope: s.rope,
            cache: s.cache,
            kv_scales: l.kv_scales(prefix)?,
        })
    }

    pub fn forward(
        &self,
        b: &B,
        x: &B::Tensor,
        ctx: &mut StepCtx<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        let s = self.shape;
        let width = s.heads * s.head_dim;
        let [q, gate] = b.split_cols(&self.q.forward(b, x)?, [width, width])?;
        let q = b.head_rms_norm(&q, &self.q_norm.w, s.head_dim, self.q_norm.eps)?;
        let k = self.k.forward(b, x)?;
        let k = b.head_rms_norm(&k, &self.k_norm.w, s.head_dim, self.k_norm.eps)?;
        let v = self.v.forward(b, x)?;
        let cache = ctx
            .kv
            .get_mut(self.cache)
            .ok_or_else(|| ModelError::Backend(format!("no KV cache for layer {}", self.cache)))?;
        let mut out = b.rope_paged_attention(q, k, &v, cache, s, &self.rope, ctx.step)?;
        b.sigmoid_gate(&mut out, &gate)?;
        self.o.forward(b, &out)
    }
}

/// `q_proj` weight (`cols` = hidden) or bias (`cols` = 1) with rows `[heads, 2, head_dim]`
/// regrouped into `[2, heads, head_dim]`: all query rows, then all gate rows.
fn per_head_halves<B: LayerOps>(
    l: &Loader<'_, B>,
    name: &str,
    heads: usize,
    head_dim: usize,
    cols: usize,
) -> Result<B::Tensor, ModelError> {
    let rows = 2 * heads * head_dim;
    let shape: Vec<usize> = if cols == 1 {
        vec![rows]
    } else {
        vec![rows, cols]
    };
    if l.store.is_dummy() {
        return l.tensor(name, &shape);
    }
    let raw = l.store.raw(name)?;
    if raw.shape != shape {
        return Err(ModelError::TensorShape {
            path: l.store.path_of(name),
            tensor: name.to_string(),
            got: raw.shape,
            expected: shape,
        });
    }
    let block = head_dim * cols * raw.dtype.size();
    let mut bytes = Vec::with_capacity(raw.bytes.len());
    for half in 0..2 {
        for h in 0..heads {
            let at = (2 * h + half) * block;
            bytes.extend_from_slice(&raw.bytes[at..at + block]);
        }
    }
    let host = HostTensor {
        dtype: raw.dtype,
        shape: &shape,
        bytes: &bytes,
    };
    Ok(l.backend.upload(host)?)
}
