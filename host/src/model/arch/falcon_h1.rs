//! `FalconH1ForCausalLM`: every layer runs a Mamba2 mixer and RoPE attention in parallel on
//! the same normed input and adds both to the residual, then a gated SiLU MLP, each pre-norm.
//! The config's µP multipliers act exactly where transformers applies them; all but two are
//! folded into weights at load: attention input × `attention_in_multiplier` (q, k, v), keys ×
//! `key_multiplier`, attention output × `attention_out_multiplier`, the Mamba2 input ×
//! `ssm_in_multiplier`, its `in_proj` output columns × the µP vector built from
//! `ssm_multipliers` (z, x, B, C, dt), its output × `ssm_out_multiplier`, the MLP gate ×
//! `mlp_multipliers[0]` and its output × `mlp_multipliers[1]`. Embeddings ×
//! `embedding_multiplier` and logits × `lm_head_multiplier` run on the activations. The Mamba2
//! width is `mamba_d_ssm` when set; its output norm is absent unless `mamba_rms_norm`, and then
//! comes before the gate when `mamba_norm_before_gate`.

use super::{Assembly, bool_any, mamba_keyed_spec, usize_any};
use crate::backend::{Activation, LayerOps};
use crate::model::config::HfConfig;
use crate::model::layers::attention::AttentionSpec;
use crate::model::layers::mamba2::{Mamba2Spec, OutNormKind};
use crate::model::layers::{Attention, Loader, Mamba2Mixer, Mixer, Mlp, Sublayer, rope};
use crate::model::{Model, ModelError};

/// A list of numbers from the config, or `default` when absent.
fn f32_list(c: &HfConfig, key: &str, default: &[f32]) -> Result<Vec<f32>, ModelError> {
    let Some(v) = c.get(key) else {
        return Ok(default.to_vec());
    };
    let list = v
        .as_array()
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_f64().map(|f| f as f32))
                .collect::<Option<Vec<f32>>>()
        })
        .ok_or_else(|| c.error(format!("`{key}` must be a list of numbers, got {v}")))?;
    if list.len() != default.len() {
        return Err(c.error(format!(
            "`{key}` must hold {} numbers, got {}",
            default.len(),
            list.len()
        )));
    }
    Ok(list)
}

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let eps = c.f64_or("rms_norm_eps", 1e-5)?;
    let heads = c.usize("num_attention_heads")?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(c, &["head_dim"], Some(hidden / heads.max(1)))?;
    let attn_bias = c.bool_or("attention_bias", false)?;
    let mlp_bias = c.bool_or("mlp_bias", false)?;
    let act_name = c.str_or("hidden_act", "silu")?;
    if act_name != "silu" {
        return Err(c.error(format!(
            "hidden_act `{act_name}`: Falcon-H1's Mamba2 mixer needs silu"
        )));
    }
    let m = |k: &str| -> Result<f32, ModelError> { Ok(c.f64_or(k, 1.0)? as f32) };
    let (attn_in, attn_out, key_mult) = (
        m("attention_in_multiplier")?,
        m("attention_out_multiplier")?,
        m("key_multiplier")?,
    );
    let (ssm_in, ssm_out) = (m("ssm_in_multiplier")?, m("ssm_out_multiplier")?);
    let ssm_mult = f32_list(c, "ssm_multipliers", &[1.0; 5])?;
    let mlp_mult = f32_list(c, "mlp_multipliers", &[1.0; 2])?;

    let d_inner = match c.opt_usize("mamba_d_ssm")? {
        Some(d) => d,
        None => (c.f64_or("mamba_expand", 2.0)? * hidden as f64) as usize,
    };
    let mamba = mamba_keyed_spec(c, hidden, d_inner, 256, eps)?;
    let (groups, state) = (mamba.shape.groups, mamba.shape.state_size);
    let out_norm = match (
        c.bool_or("mamba_rms_norm", false)?,
        c.bool_or("mamba_norm_before_gate", true)?,
    ) {
        (false, _) => OutNormKind::GateOnly,
        (true, true) => OutNormKind::NormThenGate,
        (true, false) => OutNormKind::GateThenNorm,
    };
    let out_bias = c.bool_or("projectors_bias", false)?;
    // The µP vector over in_proj's outputs: z | x | B | C | dt.
    let gs = groups * state;
    let mup = |row: usize| -> f32 {
        let bounds = [d_inner, 2 * d_inner, 2 * d_inner + gs, 2 * d_inner + 2 * gs];
        ssm_mult[bounds.iter().take_while(|&&b| row >= b).count()]
    };
    let rope = rope::build(&c.rope_settings()?, head_dim)?;

    let mut subs = Vec::with_capacity(2 * layers);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mut mx = Mamba2Mixer::load_with_norm(
            l,
            &format!("{p}.mamba"),
            Mamba2Spec { cache: i, ..mamba },
            out_norm,
        )?;
        if out_bias != mamba.proj_bias {
            mx.out_proj = l.linear(&format!("{p}.mamba.out_proj"), hidden, d_inner, out_bias)?;
        }
        mx.in_proj = mx.in_proj.scaled(l, ssm_in, mup)?;
        mx.out_proj = mx.out_proj.scaled(l, 1.0, |_| ssm_out)?;
        let mut a = Attention::load(
            l,
            &format!("{p}.self_attn"),
            AttentionSpec {
                hidden,
                heads,
                kv_heads,
                head_dim,
                bias: attn_bias,
                out_bias: attn_bias,
                rope: Some(rope.clone()),
                cache: i,
            },
        )?;
        a.q = a.q.scaled(l, attn_in, |_| 1.0)?;
        a.k = a.k.scaled(l, attn_in, |_| key_mult)?;
        a.v = a.v.scaled(l, attn_in, |_| 1.0)?;
        a.o = a.o.scaled(l, 1.0, |_| attn_out)?;
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Parallel(vec![Mixer::Mamba2(mx), Mixer::Attention(a)]),
        });
        let mut mlp = Mlp::load_gated(
            l,
            &format!("{p}.feed_forward"),
            hidden,
            c.usize("intermediate_size")?,
            mlp_bias,
            Activation::Silu,
        )?;
        if let Some(gate) = mlp.gate.take() {
            mlp.gate = Some(gate.scaled(l, 1.0, |_| mlp_mult[0])?);
        }
        mlp.down = mlp.down.scaled(l, 1.0, |_| mlp_mult[1])?;
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.pre_ff_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Mlp(mlp),
        });
    }
    let mut model = Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: c.usize_or("max_position_embeddings", 8192)?,
        embed: l.tensor("model.embed_tokens.weight", &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm("model.final_layernorm.weight", hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: (kv_heads, head_dim),
        attn_layers: layers,
        mamba: Some(mamba),
        ssm_layers: layers,
    }
    .finish(c, l)?;
    model.embed_scale = m("embedding_multiplier")?;
    model.logits_scale = m("lm_head_multiplier")?;
    Ok(model)
}
