//! Multi-token-prediction (MTP) heads, as Qwen3.5 and Qwen3-Next checkpoints ship them
//! (`mtp.*`): a draft of the token after next from the target's last hidden state and the
//! next token, through one extra decoder layer that shares the target's embedding and LM head.
//!
//! For position `p` the head reads `h_p`, the target's hidden state after its final norm,
//! and the embedding of token `p + 1`:
//!
//! ```text
//! x = fc([norm_e(embed(t_{p+1})) ‖ norm_h(h_p)])      fc: [hidden, 2·hidden]
//! x = decoder layer (gated full attention + MLP or MoE, with its own KV at position p)
//! o = norm(x)          →  logits = lm_head(o) guess t_{p+2}
//! ```
//!
//! Every norm scales by `1 + w`, as in the rest of these models. A chain of drafts feeds `o`
//! back as the hidden state of the next position with the draft just made. The head's
//! attention layer keeps K/V in the target's paged cache as one more attention layer (same
//! block tables): position `p` of that layer holds what the head computed for `(h_p,
//! t_{p+1})`, so it is written after every step, for every row the step kept (the engine's
//! MTP pass, [`crate::engine::MtpPass`]).

use super::layers::{Linear, Loader, RmsNorm, StepCtx, Sublayer};
use super::{Model, ModelError};
use crate::backend::LayerOps;

/// The loaded head; `layers` is one attention sublayer and one channel-mixer sublayer.
pub struct MtpHead<B: LayerOps> {
    pub norm_embed: RmsNorm<B>,
    pub norm_hidden: RmsNorm<B>,
    /// `fc`'s input columns over the embedding, and over the hidden state (split at load, so
    /// that the concatenation is two projections summed).
    pub fc_embed: Linear<B>,
    pub fc_hidden: Linear<B>,
    pub layers: Vec<Sublayer<B>>,
    pub norm: RmsNorm<B>,
}

/// How many MTP layers a config declares (`mtp_num_hidden_layers` in Qwen3.5,
/// `num_nextn_predict_layers` in Qwen3-Next; 0 when neither is set).
pub fn declared_layers(c: &super::config::HfConfig) -> Result<usize, ModelError> {
    for key in ["mtp_num_hidden_layers", "num_nextn_predict_layers"] {
        if c.get(key).is_some() {
            return c.usize(key);
        }
    }
    Ok(0)
}

impl<B: LayerOps> MtpHead<B> {
    /// The norms and `fc` under `prefix` (`mtp`); `layers` built by the architecture (they
    /// are its own decoder layer kinds).
    pub fn load(
        l: &Loader<'_, B>,
        prefix: &str,
        hidden: usize,
        eps: f64,
        layers: Vec<Sublayer<B>>,
    ) -> Result<Self, ModelError> {
        let fc = l.host_f32(&format!("{prefix}.fc.weight"), &[hidden, 2 * hidden])?;
        let (mut we, mut wh) = (Vec::with_capacity(hidden * hidden), Vec::new());
        wh.reserve(hidden * hidden);
        for row in fc.chunks(2 * hidden) {
            we.extend_from_slice(&row[..hidden]);
            wh.extend_from_slice(&row[hidden..]);
        }
        Ok(Self {
            norm_embed: l.rms_norm_centred(
                &format!("{prefix}.pre_fc_norm_embedding.weight"),
                hidden,
                eps,
            )?,
            norm_hidden: l.rms_norm_centred(
                &format!("{prefix}.pre_fc_norm_hidden.weight"),
                hidden,
                eps,
            )?,
            fc_embed: Linear {
                w: l.upload_f32(&we, &[hidden, hidden])?,
                b: None,
            },
            fc_hidden: Linear {
                w: l.upload_f32(&wh, &[hidden, hidden])?,
                b: None,
            },
            layers,
            norm: l.rms_norm_centred(&format!("{prefix}.norm.weight"), hidden, eps)?,
        })
    }
}

impl<B: LayerOps> Model<B> {
    /// The MTP head over the uploaded `step` (its tokens are each row's *next* token, its
    /// positions and slot mapping the rows' own), `hidden` holding the target's final hidden
    /// state of each row. Returns, for the step's `logit_rows`, the head's normalised output
    /// (the hidden state a chain feeds back) and the logits.
    pub fn mtp_forward(
        &self,
        backend: &B,
        step: &B::Step,
        caches: &mut super::ModelCaches<B>,
        hidden: &B::Tensor,
    ) -> Result<(B::Tensor, B::Tensor), ModelError> {
        let Some(mtp) = &self.mtp else {
            return Err(ModelError::Unsupported(
                "this model has no MTP head (mtp.* tensors)".into(),
            ));
        };
        let mut e = backend.embedding(&self.embed, step)?;
        if self.embed_scale != 1.0 {
            backend.scale_assign(&mut e, self.embed_scale)?;
        }
        let e = mtp.norm_embed.forward(backend, &e)?;
        let hn = mtp.norm_hidden.forward(backend, hidden)?;
        let mut h = mtp.fc_embed.forward(backend, &e)?;
        backend.add_assign(&mut h, &mtp.fc_hidden.forward(backend, &hn)?)?;
        let mut ctx = StepCtx {
            step,
            kv: &mut caches.kv,
            ssm: None,
        };
        let (_, out) = self.run_layers(backend, &mtp.layers, h, &mut ctx, &mtp.norm, false)?;
        let logits = self.logits(backend, &out)?;
        Ok((out, logits))
    }
}
