//! The embedded tiny hybrid model: `chimera` runs with no download.
//!
//! A NemotronH-shaped hybrid (Mamba2, attention, MLP and MoE layers) with a built-in config
//! and weights generated from a fixed seed, so every build produces the same model and the
//! same greedy output. It pairs with the tokenizer shipped in `host/assets/tokenizer/`. The
//! weights are random: the text it writes is gibberish, but every serving path (paged KV,
//! SSM snapshots, MoE routing, sampling) runs for real on it.

use std::collections::HashMap;

use super::config::HfConfig;
use super::weights::WeightStore;
use super::{Model, ModelError};
use crate::backend::LayerOps;

/// Name users give to select this model (`--model builtin:tiny-hybrid`).
pub const NAME: &str = "builtin:tiny-hybrid";
const SEED: u64 = 0x0c41_3e7a_2026_1129;

const HIDDEN: usize = 64;
const PATTERN: &str = "M*M-ME*M";
const M_HEADS: usize = 4;
const M_HEAD_DIM: usize = 32;
const M_GROUPS: usize = 2;
const M_STATE: usize = 16;
const M_CONV: usize = 4;
const A_HEADS: usize = 4;
const A_KV: usize = 2;
const A_HEAD_DIM: usize = 16;
const MLP_INTER: usize = 128;
const EXPERTS: usize = 4;
const EXPERT_INTER: usize = 64;

/// The config.json of the embedded model for a tokenizer of `vocab` tokens.
pub fn config_json(vocab: usize, eos: u32, bos: u32) -> String {
    serde_json::json!({
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "hybrid_override_pattern": PATTERN,
        "num_attention_heads": A_HEADS,
        "num_key_value_heads": A_KV,
        "head_dim": A_HEAD_DIM,
        "intermediate_size": MLP_INTER,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": M_HEADS,
        "mamba_head_dim": M_HEAD_DIM,
        "n_groups": M_GROUPS,
        "ssm_state_size": M_STATE,
        "conv_kernel": M_CONV,
        "chunk_size": 16,
        "expand": 2,
        "use_conv_bias": true,
        "use_bias": false,
        "n_routed_experts": EXPERTS,
        "moe_intermediate_size": EXPERT_INTER,
        "moe_shared_expert_intermediate_size": EXPERT_INTER,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": true,
        "routed_scaling_factor": 1.5,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "max_position_embeddings": 4096,
        "eos_token_id": eos,
        "bos_token_id": bos,
    })
    .to_string()
}

/// splitmix64: a tiny, fixed generator so the weights never depend on a crate's version.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

fn fill(
    rng: &mut Rng,
    shape: &[usize],
    f: impl Fn(&mut Rng, usize) -> f32,
) -> (Vec<f32>, Vec<usize>) {
    let n: usize = shape.iter().product();
    ((0..n).map(|i| f(rng, i)).collect(), shape.to_vec())
}

/// The embedded model's tensors, generated from the fixed seed.
fn tensors(vocab: usize) -> HashMap<String, (Vec<f32>, Vec<usize>)> {
    let mut rng = Rng(SEED);
    let mut t = HashMap::new();
    let mut put = |name: String, v: (Vec<f32>, Vec<usize>)| {
        t.insert(name, v);
    };
    let dense = |rng: &mut Rng, out: usize, inp: usize| {
        let scale = (3.0 / inp as f32).sqrt();
        fill(rng, &[out, inp], |r, _| r.uniform() * scale)
    };
    let norm = |rng: &mut Rng, n: usize| fill(rng, &[n], |r, _| 1.0 + 0.1 * r.uniform());
    put(
        "backbone.embeddings.weight".into(),
        fill(&mut rng, &[vocab, HIDDEN], |r, _| r.uniform() * 1.7),
    );
    put("backbone.norm_f.weight".into(), norm(&mut rng, HIDDEN));
    let d_inner = M_HEADS * M_HEAD_DIM;
    let conv_dim = d_inner + 2 * M_GROUPS * M_STATE;
    for (i, kind) in PATTERN.chars().enumerate() {
        let p = format!("backbone.layers.{i}");
        put(format!("{p}.norm.weight"), norm(&mut rng, HIDDEN));
        let m = format!("{p}.mixer");
        match kind {
            'M' => {
                put(
                    format!("{m}.in_proj.weight"),
                    dense(&mut rng, d_inner + conv_dim + M_HEADS, HIDDEN),
                );
                put(
                    format!("{m}.conv1d.weight"),
                    fill(&mut rng, &[conv_dim, 1, M_CONV], |r, _| r.uniform() * 0.5),
                );
                put(
                    format!("{m}.conv1d.bias"),
                    fill(&mut rng, &[conv_dim], |r, _| r.uniform() * 0.1),
                );
                // dt in [1e-3, 1e-1] log-uniformly, stored as softplus⁻¹(dt).
                put(
                    format!("{m}.dt_bias"),
                    fill(&mut rng, &[M_HEADS], |r, _| {
                        let dt = (0.001f32.ln()
                            + (r.uniform() + 1.0) * 0.5 * (0.1f32.ln() - 0.001f32.ln()))
                        .exp();
                        dt + (-(-dt).exp_m1()).ln()
                    }),
                );
                put(
                    format!("{m}.A_log"),
                    fill(&mut rng, &[M_HEADS], |_, h| ((h + 1) as f32).ln()),
                );
                put(
                    format!("{m}.D"),
                    fill(&mut rng, &[M_HEADS], |r, _| 1.0 + 0.1 * r.uniform()),
                );
                put(format!("{m}.norm.weight"), norm(&mut rng, d_inner));
                put(
                    format!("{m}.out_proj.weight"),
                    dense(&mut rng, HIDDEN, d_inner),
                );
            }
            '*' => {
                put(
                    format!("{m}.q_proj.weight"),
                    dense(&mut rng, A_HEADS * A_HEAD_DIM, HIDDEN),
                );
                put(
                    format!("{m}.k_proj.weight"),
                    dense(&mut rng, A_KV * A_HEAD_DIM, HIDDEN),
                );
                put(
                    format!("{m}.v_proj.weight"),
                    dense(&mut rng, A_KV * A_HEAD_DIM, HIDDEN),
                );
                put(
                    format!("{m}.o_proj.weight"),
                    dense(&mut rng, HIDDEN, A_HEADS * A_HEAD_DIM),
                );
            }
            '-' => {
                put(
                    format!("{m}.up_proj.weight"),
                    dense(&mut rng, MLP_INTER, HIDDEN),
                );
                put(
                    format!("{m}.down_proj.weight"),
                    dense(&mut rng, HIDDEN, MLP_INTER),
                );
            }
            _ => {
                put(format!("{m}.gate.weight"), dense(&mut rng, EXPERTS, HIDDEN));
                put(
                    format!("{m}.gate.e_score_correction_bias"),
                    fill(&mut rng, &[EXPERTS], |r, _| 0.05 * r.uniform()),
                );
                for e in 0..EXPERTS {
                    put(
                        format!("{m}.experts.{e}.up_proj.weight"),
                        dense(&mut rng, EXPERT_INTER, HIDDEN),
                    );
                    put(
                        format!("{m}.experts.{e}.down_proj.weight"),
                        dense(&mut rng, HIDDEN, EXPERT_INTER),
                    );
                }
                put(
                    format!("{m}.shared_experts.up_proj.weight"),
                    dense(&mut rng, EXPERT_INTER, HIDDEN),
                );
                put(
                    format!("{m}.shared_experts.down_proj.weight"),
                    dense(&mut rng, HIDDEN, EXPERT_INTER),
                );
            }
        }
    }
    t
}

/// Builds the embedded model for a tokenizer with `vocab` tokens.
pub fn load<B: LayerOps>(
    backend: &B,
    vocab: usize,
    eos: u32,
    bos: u32,
) -> Result<Model<B>, ModelError> {
    load_with(backend, vocab, eos, bos, super::LoadOptions::default())
}

/// [`load`] with options (online FP8 quantization of the projections).
pub fn load_with<B: LayerOps>(
    backend: &B,
    vocab: usize,
    eos: u32,
    bos: u32,
    options: super::LoadOptions,
) -> Result<Model<B>, ModelError> {
    let config = HfConfig::parse(&config_json(vocab, eos, bos), NAME.into())?;
    let mut store = WeightStore::from_memory(tensors(vocab));
    store.set_quantization(super::quant::Quantization::from_config(
        &config,
        options.fp8,
    )?);
    super::arch::build(&config, &store, backend, options)
}
