//! Rotary position embedding tables from config: default, `llama3` scaling, `linear` scaling,
//! partial rotary (`partial_rotary_factor`), and explicit per-frequency divisors
//! (`freq_factors`, as a GGUF file's `rope_freqs` tensor gives them).

use crate::backend::Rope;
use crate::model::ModelError;
use crate::model::config::RopeSettings;

/// Builds the inverse frequencies the way transformers does (in f32), then applies scaling.
pub fn build(settings: &RopeSettings, head_dim: usize) -> Result<Rope, ModelError> {
    let rotary_dim = ((head_dim as f64) * settings.partial_rotary_factor) as usize;
    let rotary_dim = rotary_dim - rotary_dim % 2;
    let base = settings.theta as f32;
    let mut inv_freq: Vec<f32> = (0..rotary_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / rotary_dim as f32;
            1.0 / base.powf(exponent)
        })
        .collect();
    match settings.rope_type.as_str() {
        "default" => {}
        "linear" => {
            let factor = settings.factor.unwrap_or(1.0) as f32;
            for f in &mut inv_freq {
                *f /= factor;
            }
        }
        "llama3" => {
            let (Some(factor), Some(low), Some(high), Some(old_ctx)) = (
                settings.factor,
                settings.low_freq_factor,
                settings.high_freq_factor,
                settings.original_max_position_embeddings,
            ) else {
                return Err(ModelError::Unsupported(
                    "llama3 rope scaling needs factor, low_freq_factor, high_freq_factor and \
                     original_max_position_embeddings"
                        .into(),
                ));
            };
            let (factor, low, high, old_ctx) =
                (factor as f32, low as f32, high as f32, old_ctx as f32);
            let low_wavelen = old_ctx / low;
            let high_wavelen = old_ctx / high;
            for f in &mut inv_freq {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_wavelen {
                    *f / factor
                } else {
                    *f
                };
                let smooth = (old_ctx / wavelen - low) / (high - low);
                let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                *f = if medium { smoothed } else { scaled };
            }
        }
        other => {
            return Err(ModelError::Unsupported(format!(
                "rope_type `{other}` (supported: default, linear, llama3)"
            )));
        }
    }
    if let Some(factors) = &settings.freq_factors {
        if factors.len() != inv_freq.len() {
            return Err(ModelError::Unsupported(format!(
                "{} RoPE frequency factors for {} rotary frequencies",
                factors.len(),
                inv_freq.len()
            )));
        }
        for (f, d) in inv_freq.iter_mut().zip(factors) {
            *f /= *d as f32;
        }
    }
    Ok(Rope {
        inv_freq,
        rotary_dim,
        attention_scaling: 1.0,
    })
}
