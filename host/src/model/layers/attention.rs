//! Multi-head attention with grouped KV heads, optional RoPE and a paged KV cache.

use super::{Linear, Loader, StepCtx};
use crate::backend::{AttnShape, KvScales, LayerOps, Rope};
use crate::model::ModelError;

pub struct Attention<B: LayerOps> {
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    pub shape: AttnShape,
    /// None for position-free attention (NemotronH).
    pub rope: Option<Rope>,
    /// Index of this layer among the model's attention layers (its KV cache).
    pub cache: usize,
    /// The checkpoint's FP8 KV-cache scales, if it has them.
    pub kv_scales: Option<KvScales>,
}

/// What an architecture file states about one attention layer.
pub struct AttentionSpec {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub bias: bool,
    pub out_bias: bool,
    pub rope: Option<Rope>,
    pub cache: usize,
}

impl<B: LayerOps> Attention<B> {
    pub fn load(l: &Loader<'_, B>, prefix: &str, s: AttentionSpec) -> Result<Self, ModelError> {
        if s.heads == 0 || s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return Err(ModelError::Unsupported(format!(
                "{} attention heads with {} KV heads (must divide evenly)",
                s.heads, s.kv_heads
            )));
        }
        let (q_out, kv_out) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        Ok(Self {
            q: l.linear(&format!("{prefix}.q_proj"), q_out, s.hidden, s.bias)?,
            k: l.linear(&format!("{prefix}.k_proj"), kv_out, s.hidden, s.bias)?,
            v: l.linear(&format!("{prefix}.v_proj"), kv_out, s.hidden, s.bias)?,
            o: l.linear(&format!("{prefix}.o_proj"), s.hidden, q_out, s.out_bias)?,
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
        let [q, k, v] = Linear::forward_shared(b, x, [&self.q, &self.k, &self.v])?;
        let s = self.shape;
        let cache = ctx
            .kv
            .get_mut(self.cache)
            .ok_or_else(|| ModelError::Backend(format!("no KV cache for layer {}", self.cache)))?;
        let out = match &self.rope {
            // Q and K are rotated on their way in (one launch with the KV write on a GPU).
            Some(rope) => b.rope_paged_attention(q, k, &v, cache, s, rope, ctx.step)?,
            None => b.paged_attention(&q, &k, &v, cache, s, ctx.step)?,
        };
        self.o.forward(b, &out)
    }
}
