//! Mixture of experts with shared experts and sigmoid top-k routing with grouped selection
//! and a score-correction bias (NemotronH; the DeepSeek-V3 routing as transformers runs it).
//!
//! Routing is computed on the host from the router logits (a small `[tokens, experts]`
//! matrix); each selected expert then runs on the rows routed to it.

use super::{Linear, Loader, Mlp};
use crate::backend::{Activation, Backend};
use crate::model::ModelError;

pub struct Moe<B: Backend> {
    pub router: B::Tensor,
    pub correction_bias: Vec<f32>,
    pub experts: Vec<Mlp<B>>,
    pub shared: Option<Mlp<B>>,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
}

#[derive(Debug, Clone, Copy)]
pub struct MoeSpec {
    pub hidden: usize,
    pub experts: usize,
    pub expert_inter: usize,
    pub shared_inter: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f64,
    pub bias: bool,
    pub act: Activation,
}

impl<B: Backend> Moe<B> {
    pub fn load(l: &Loader<'_, B>, prefix: &str, s: MoeSpec) -> Result<Self, ModelError> {
        if s.n_group == 0
            || s.experts % s.n_group != 0
            || s.topk_group > s.n_group
            || s.top_k > s.experts
            || s.top_k == 0
        {
            return Err(ModelError::Unsupported(format!(
                "MoE routing with {} experts, {} groups, top-{} of {} groups",
                s.experts, s.n_group, s.top_k, s.topk_group
            )));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let router = l.tensor(&p("gate.weight"), &[s.experts, s.hidden])?;
        let correction_bias = match l.store.has(&p("gate.e_score_correction_bias")) {
            true => l.store.read_f32(&p("gate.e_score_correction_bias"))?.0,
            false => vec![0.0; s.experts],
        };
        if correction_bias.len() != s.experts {
            return Err(ModelError::TensorShape {
                path: "".into(),
                tensor: p("gate.e_score_correction_bias"),
                got: vec![correction_bias.len()],
                expected: vec![s.experts],
            });
        }
        let experts = if l.store.has(&p("experts.up_proj")) {
            stacked_experts(l, prefix, s)?
        } else {
            (0..s.experts)
                .map(|i| {
                    Mlp::load_plain(
                        l,
                        &p(&format!("experts.{i}")),
                        s.hidden,
                        s.expert_inter,
                        s.bias,
                        s.act,
                    )
                })
                .collect::<Result<_, _>>()?
        };
        let shared = if s.shared_inter > 0 {
            Some(Mlp::load_plain(
                l,
                &p("shared_experts"),
                s.hidden,
                s.shared_inter,
                s.bias,
                s.act,
            )?)
        } else {
            None
        };
        Ok(Self {
            router,
            correction_bias,
            experts,
            shared,
            top_k: s.top_k,
            n_group: s.n_group,
            topk_group: s.topk_group,
            norm_topk_prob: s.norm_topk_prob,
            scaling: s.scaling as f32,
        })
    }

    /// Picks `(expert, weight)` pairs for one token from its router logits.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let e = logits.len();
        let scores: Vec<f32> = logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        let choice: Vec<f32> = scores
            .iter()
            .zip(&self.correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        let per_group = e / self.n_group;
        // Group score = sum of its two best choice scores (or the one, for single-expert groups).
        let mut groups: Vec<(usize, f32)> = (0..self.n_group)
            .map(|g| {
                let mut v: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                (g, v.iter().take(2).sum())
            })
            .collect();
        groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut allowed = vec![false; self.n_group];
        for (g, _) in groups.iter().take(self.topk_group) {
            allowed[*g] = true;
        }
        let mut cand: Vec<(usize, f32)> = (0..e)
            .filter(|i| allowed[i / per_group])
            .map(|i| (i, choice[i]))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        cand.truncate(self.top_k);
        let mut picked: Vec<(usize, f32)> = cand.iter().map(|&(i, _)| (i, scores[i])).collect();
        if self.norm_topk_prob {
            let sum: f32 = picked.iter().map(|p| p.1).sum::<f32>() + 1e-20;
            for p in &mut picked {
                p.1 /= sum;
            }
        }
        for p in &mut picked {
            p.1 *= self.scaling;
        }
        picked
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let logits = b.to_host(&b.linear(x, &self.router, None)?);
        let e = self.experts.len();
        let tokens = logits.len() / e.max(1);
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); e];
        for t in 0..tokens {
            for (ex, w) in self.route(&logits[t * e..(t + 1) * e]) {
                rows[ex].push(t as u32);
                weights[ex].push(w);
            }
        }
        let mut out = match &self.shared {
            Some(shared) => shared.forward(b, x)?,
            None => b.zeros(b.shape(x)),
        };
        for (ex, expert) in self.experts.iter().enumerate() {
            if rows[ex].is_empty() {
                continue;
            }
            let xi = b.gather_rows(x, &rows[ex])?;
            let yi = expert.forward(b, &xi)?;
            b.scatter_add_rows(&mut out, &yi, &rows[ex], &weights[ex])?;
        }
        Ok(out)
    }
}

/// Experts stored as stacked 3-D tensors `experts.up_proj [E, I, H]`, `experts.down_proj [E, H, I]`.
fn stacked_experts<B: Backend>(
    l: &Loader<'_, B>,
    prefix: &str,
    s: MoeSpec,
) -> Result<Vec<Mlp<B>>, ModelError> {
    let up_name = format!("{prefix}.experts.up_proj");
    let down_name = format!("{prefix}.experts.down_proj");
    let (up, up_shape) = l.store.read_f32(&up_name)?;
    let (down, down_shape) = l.store.read_f32(&down_name)?;
    let (e, i, h) = (s.experts, s.expert_inter, s.hidden);
    for (name, got, want) in [
        (&up_name, &up_shape, vec![e, i, h]),
        (&down_name, &down_shape, vec![e, h, i]),
    ] {
        if *got != want {
            return Err(ModelError::TensorShape {
                path: "".into(),
                tensor: name.clone(),
                got: got.clone(),
                expected: want,
            });
        }
    }
    let be = |e: crate::backend::BackendError| ModelError::Backend(e.to_string());
    (0..e)
        .map(|x| {
            Ok(Mlp {
                gate: None,
                up: Linear {
                    w: l.backend
                        .from_host(up[x * i * h..(x + 1) * i * h].to_vec(), &[i, h])
                        .map_err(be)?,
                    b: None,
                },
                down: Linear {
                    w: l.backend
                        .from_host(down[x * h * i..(x + 1) * h * i].to_vec(), &[h, i])
                        .map_err(be)?,
                    b: None,
                },
                act: s.act,
            })
        })
        .collect()
}
