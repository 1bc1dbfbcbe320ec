//! Mixture-of-experts kernels on the CPU: sigmoid routing with grouped top-k selection and a
//! score-correction bias (NemotronH; DeepSeek-V3 routing as transformers runs it), softmax
//! top-k routing (Granite 4.0), and the routed experts' MLPs over stacked expert weights,
//! plain or gated.
//!
//! They reproduce the host routing the model layer used before routing moved onto the backend:
//! the same expert ids in the same order, the same weights bit for bit, and per output row the
//! same summation order (experts in ascending id, each expert's tokens in ascending order). Experts are MLPs
//! without biases, plain (`down(act(up(x)))`) or gated (`down(act(gate(x)) · up(x))`), one GEMM pair (or
//! trio) per expert over the tokens routed to it. `moe_forward` is the backend's MoE
//! operation: the layer's routing, then its experts.

use rayon::prelude::*;

use super::{CpuTensor, apply_act, gemm_nt, same_shape};
use crate::backend::{
    Activation, BackendError, MoeRouting as LayerRouting, MoeScoring, Result, StackedExperts,
};

/// Routing constants of one MoE layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    pub experts: usize,
    /// Experts are split into `n_group` equal consecutive groups.
    pub n_group: usize,
    /// Groups allowed per token (the best by the sum of their two best biased scores).
    pub topk_group: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Divide the picked weights by their sum (+1e-20) before scaling.
    pub norm_topk_prob: bool,
    pub scaling: f32,
    /// Scores are the softmax over all experts (Qwen3-Next, Qwen3.5 MoE) instead of
    /// per-expert sigmoids.
    pub softmax: bool,
}

/// Shape of the stacked experts: `up [experts, inter, hidden]`, `down [experts, hidden, inter]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertShape {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
    /// Experts per token (the width of the routing columns).
    pub top_k: usize,
    pub act: Activation,
}

/// Routes every token from its router logits (`[tokens, experts]`): `ids_out` and
/// `weights_out` (`[tokens, top_k]`) get the picked experts, best first (ties to the lower
/// id), and their weights: the sigmoid score (without the correction bias, which only steers
/// the choice), optionally normalised, times `scaling`.
pub fn moe_route(
    router_logits: &[f32],
    tokens: usize,
    r: &MoeRouting,
    correction_bias: &[f32],
    ids_out: &mut [u32],
    weights_out: &mut [f32],
) -> Result<()> {
    check_routing(
        router_logits,
        tokens,
        r,
        correction_bias,
        ids_out,
        weights_out,
    )?;
    route_tokens(
        router_logits,
        r,
        (ids_out, weights_out),
        || RouteScratch::new(r),
        |s, logits, ids, weights| route_token(logits, r, correction_bias, s, ids, weights),
    );
    Ok(())
}

/// Runs `route` on every token's router logits and its `top_k` routing columns, tokens in
/// parallel, each worker with its own scratch value made by `scratch`.
fn route_tokens<S>(
    router_logits: &[f32],
    r: &MoeRouting,
    (ids_out, weights_out): (&mut [u32], &mut [f32]),
    scratch: impl Fn() -> S + Send + Sync,
    route: impl Fn(&mut S, &[f32], &mut [u32], &mut [f32]) + Send + Sync,
) {
    if r.experts == 0 || r.top_k == 0 {
        return;
    }
    router_logits
        .par_chunks(r.experts)
        .zip(ids_out.par_chunks_mut(r.top_k))
        .zip(weights_out.par_chunks_mut(r.top_k))
        .for_each_init(scratch, |s, ((logits, ids), weights)| {
            route(s, logits, ids, weights)
        });
}

fn check_routing(
    logits: &[f32],
    tokens: usize,
    r: &MoeRouting,
    bias: &[f32],
    ids: &[u32],
    weights: &[f32],
) -> Result<()> {
    let groups_ok = r.n_group > 0
        && r.experts.is_multiple_of(r.n_group)
        && r.topk_group <= r.n_group
        && r.top_k > 0
        && r.top_k <= r.topk_group * (r.experts / r.n_group);
    if !groups_ok {
        return Err(BackendError::Invalid(format!(
            "moe_route: top-{} of {} experts in {} groups, {} groups allowed",
            r.top_k, r.experts, r.n_group, r.topk_group
        )));
    }
    let n = tokens * r.top_k;
    if logits.len() != tokens * r.experts
        || bias.len() != r.experts
        || ids.len() != n
        || weights.len() != n
    {
        return Err(BackendError::Invalid(format!(
            "moe_route: {} logits, {} biases, {} ids, {} weights for {tokens} tokens × {} \
             experts, top-{}",
            logits.len(),
            bias.len(),
            ids.len(),
            weights.len(),
            r.experts,
            r.top_k
        )));
    }
    Ok(())
}

/// Per-thread temporaries of the router.
struct RouteScratch {
    scores: Vec<f32>,
    choice: Vec<f32>,
    group_score: Vec<f32>,
    order: Vec<u32>,
    allowed: Vec<bool>,
}

impl RouteScratch {
    fn new(r: &MoeRouting) -> Self {
        Self {
            scores: vec![0.0; r.experts],
            choice: vec![0.0; r.experts],
            group_score: vec![0.0; r.n_group],
            order: Vec::with_capacity(r.experts.max(r.n_group)),
            allowed: vec![false; r.n_group],
        }
    }
}

fn route_token(
    logits: &[f32],
    r: &MoeRouting,
    bias: &[f32],
    s: &mut RouteScratch,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    if r.softmax {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (sc, &v) in s.scores.iter_mut().zip(logits) {
            *sc = (v - max).exp();
            sum += *sc;
        }
        for sc in s.scores.iter_mut() {
            *sc /= sum;
        }
    } else {
        for (sc, &v) in s.scores.iter_mut().zip(logits) {
            *sc = 1.0 / (1.0 + (-v).exp());
        }
    }
    for ((ch, &sc), &b) in s.choice.iter_mut().zip(&s.scores).zip(bias) {
        *ch = sc + b;
    }
    // Group score: the sum of the group's two best choice scores (the one, for groups of one).
    let per_group = r.experts / r.n_group;
    for (g, gs) in s.group_score.iter_mut().enumerate() {
        let group = &s.choice[g * per_group..(g + 1) * per_group];
        let (mut best, mut m) = ([0f32; 2], 0);
        for &v in group {
            if m == 0 {
                (best[0], m) = (v, 1);
            } else if v.total_cmp(&best[0]).is_gt() {
                (best[1], best[0], m) = (best[0], v, 2);
            } else if m == 1 || v.total_cmp(&best[1]).is_gt() {
                (best[1], m) = (v, 2);
            }
        }
        // Summed as `Iterator::sum` over the sorted group would: best first.
        *gs = best[..m].iter().sum();
    }
    // Allowed groups: the `topk_group` best (ties to the lower group).
    s.order.clear();
    s.order.extend(0..r.n_group as u32);
    let gsc = &s.group_score;
    s.order
        .sort_unstable_by(|&x, &y| gsc[y as usize].total_cmp(&gsc[x as usize]).then(x.cmp(&y)));
    s.allowed.fill(false);
    for &g in &s.order[..r.topk_group] {
        s.allowed[g as usize] = true;
    }
    // Experts of the allowed groups by choice score (ties to the lower id), the best `top_k`.
    s.order.clear();
    s.order
        .extend((0..r.experts as u32).filter(|&e| s.allowed[e as usize / per_group]));
    let ch = &s.choice;
    s.order
        .sort_unstable_by(|&x, &y| ch[y as usize].total_cmp(&ch[x as usize]).then(x.cmp(&y)));
    for ((id, w), &e) in ids.iter_mut().zip(weights.iter_mut()).zip(&s.order) {
        *id = e;
        *w = s.scores[e as usize];
    }
    if r.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in weights.iter_mut() {
            *w /= sum;
        }
    }
    for w in weights.iter_mut() {
        *w *= r.scaling;
    }
}

/// Softmax routing (Granite 4.0, Qwen MoE): per token, the `top_k` largest logits (ties to the
/// lower id), best first; their weights are `softmax(logits)` at the picked experts,
/// renormalised over the picked ones when `norm_topk_prob` (the softmax over the picked logits
/// alone, as Granite writes it), times `scaling`. `ids_out`/`weights_out` are `[tokens, top_k]`.
pub fn moe_route_softmax(
    router_logits: &[f32],
    tokens: usize,
    r: &MoeRouting,
    ids_out: &mut [u32],
    weights_out: &mut [f32],
) -> Result<()> {
    let n = tokens * r.top_k;
    if r.top_k == 0
        || r.top_k > r.experts
        || router_logits.len() != tokens * r.experts
        || ids_out.len() != n
        || weights_out.len() != n
    {
        return Err(BackendError::Invalid(format!(
            "moe_route_softmax: {} logits, {} ids, {} weights for {tokens} tokens × {} experts, \
             top-{}",
            router_logits.len(),
            ids_out.len(),
            weights_out.len(),
            r.experts,
            r.top_k
        )));
    }
    route_tokens(
        router_logits,
        r,
        (ids_out, weights_out),
        || Vec::with_capacity(r.experts),
        |order: &mut Vec<u32>, logits, ids, weights| {
            order.clear();
            order.extend(0..r.experts as u32);
            order.sort_unstable_by(|&x, &y| {
                logits[y as usize]
                    .total_cmp(&logits[x as usize])
                    .then(x.cmp(&y))
            });
            let max = logits[order[0] as usize];
            let z: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
            for ((id, w), &e) in ids.iter_mut().zip(weights.iter_mut()).zip(order.iter()) {
                *id = e;
                *w = (logits[e as usize] - max).exp() / z;
            }
            if r.norm_topk_prob {
                let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
                for w in weights.iter_mut() {
                    *w /= sum;
                }
            }
            for w in weights.iter_mut() {
                *w *= r.scaling;
            }
        },
    );
    Ok(())
}

/// The routed entries grouped by expert on the host, a counting sort: each expert's
/// first entry (`n_experts + 1` offsets), and per entry its token row and routing weight,
/// experts in ascending id and each expert's entries in routing order.
pub fn group_by_expert(
    ids: &[u32],
    weights: &[f32],
    n_experts: usize,
    top_k: usize,
) -> (Vec<usize>, Vec<u32>, Vec<f32>) {
    let mut start = vec![0usize; n_experts + 1];
    for &e in ids {
        start[e as usize + 1] += 1;
    }
    for e in 0..n_experts {
        start[e + 1] += start[e];
    }
    let mut fill = start.clone();
    let mut rows = vec![0u32; ids.len()];
    let mut row_w = vec![0f32; ids.len()];
    for (j, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        let at = &mut fill[e as usize];
        rows[*at] = (j / top_k.max(1)) as u32;
        row_w[*at] = w;
        *at += 1;
    }
    (start, rows, row_w)
}

/// Adds every token's routed experts to `out` (`[tokens, hidden]`, accumulated into):
/// `out[t] += weights[t, j] · down_e(act(up_e(x[t])))` for `e = ids[t, j]`, with `x`
/// `[tokens, hidden]` and the stacked expert weights `up [E, inter, hidden]`,
/// `down [E, hidden, inter]`. Tokens are grouped per expert, so each expert is one GEMM pair
/// over its rows; experts run in ascending id, each over its tokens in ascending order.
pub fn moe_experts(
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    up: &[f32],
    down: &[f32],
    s: &ExpertShape,
    out: &mut [f32],
) -> Result<()> {
    moe_experts_gated(x, ids, weights, None, up, down, s, out)
}

/// Checks the experts' inputs against each other and the shape `s`.
fn check_experts(
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    (gate, up, down): (Option<&[f32]>, &[f32], &[f32]),
    s: &ExpertShape,
    out: &[f32],
) -> Result<()> {
    let (h, i) = (s.hidden, s.inter);
    if let Some(g) = gate
        && g.len() != up.len()
    {
        return Err(BackendError::Invalid(format!(
            "moe_experts: gate {} for up {}",
            g.len(),
            up.len()
        )));
    }
    let tokens = x.len().checked_div(h).unwrap_or(0);
    let shapes_ok = h > 0
        && x.len() == tokens * h
        && out.len() == x.len()
        && ids.len() == tokens * s.top_k
        && weights.len() == ids.len()
        && up.len() == s.experts * i * h
        && gate.is_none_or(|g| g.len() == up.len())
        && down.len() == s.experts * h * i;
    if !shapes_ok {
        return Err(BackendError::Invalid(format!(
            "moe_experts: x {}, out {}, ids {}, weights {}, up {}, gate {:?}, down {} for \
             hidden {h}, inter {i}, {} experts, top-{}",
            x.len(),
            out.len(),
            ids.len(),
            weights.len(),
            up.len(),
            gate.map(<[f32]>::len),
            down.len(),
            s.experts,
            s.top_k
        )));
    }
    if let Some(&bad) = ids.iter().find(|&&e| e as usize >= s.experts) {
        return Err(BackendError::Invalid(format!(
            "moe_experts: expert {bad} out of {}",
            s.experts
        )));
    }
    Ok(())
}

/// [`moe_experts`] with optional gate weights `gate [E, inter, hidden]`: gated experts compute
/// `down_e(act(gate_e(x)) · up_e(x))` (SwiGLU when `act` is SiLU).
#[allow(
    clippy::too_many_arguments,
    reason = "the expert weights and the routing columns"
)]
pub fn moe_experts_gated(
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    gate: Option<&[f32]>,
    up: &[f32],
    down: &[f32],
    s: &ExpertShape,
    out: &mut [f32],
) -> Result<()> {
    let (h, i) = (s.hidden, s.inter);
    check_experts(x, ids, weights, (gate, up, down), s, out)?;
    let (start, rows, row_w) = group_by_expert(ids, weights, s.experts, s.top_k);
    let most = (0..s.experts)
        .map(|e| start[e + 1] - start[e])
        .max()
        .unwrap_or(0);
    let mut xs = vec![0f32; most * h];
    let mut mid = vec![0f32; most * i];
    let mut ys = vec![0f32; most * h];
    let mut gs = vec![0f32; if gate.is_some() { most * i } else { 0 }];
    for e in 0..s.experts {
        let (a, b) = (start[e], start[e + 1]);
        let n = b - a;
        if n == 0 {
            continue;
        }
        for (dst, &t) in xs.chunks_exact_mut(h).zip(&rows[a..b]) {
            let t = t as usize;
            dst.copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        let (xs, mid, ys) = (&xs[..n * h], &mut mid[..n * i], &mut ys[..n * h]);
        gemm_nt(xs, &up[e * i * h..(e + 1) * i * h], mid, n, h, i);
        if let Some(gate) = gate {
            let gs = &mut gs[..n * i];
            gemm_nt(xs, &gate[e * i * h..(e + 1) * i * h], gs, n, h, i);
            mid.par_iter_mut()
                .zip(gs.par_iter())
                .for_each(|(v, &g)| *v *= apply_act(g, s.act));
        } else {
            mid.par_iter_mut().for_each(|v| *v = apply_act(*v, s.act));
        }
        gemm_nt(mid, &down[e * h * i..(e + 1) * h * i], ys, n, i, h);
        for ((y, &t), &w) in ys.chunks_exact(h).zip(&rows[a..b]).zip(&row_w[a..b]) {
            let t = t as usize;
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(y) {
                *o += w * v;
            }
        }
    }
    Ok(())
}

/// Routing then expert compute over stacked weights (see the module docs).
pub(super) fn moe_forward(
    x: &CpuTensor,
    router_logits: &CpuTensor,
    routing: &LayerRouting<CpuTensor>,
    experts: &StackedExperts<CpuTensor>,
    out: &mut CpuTensor,
) -> Result<()> {
    let (tokens, hidden) = x.rows_cols();
    let (_, n_experts) = router_logits.rows_cols();
    same_shape("moe output", x, out)?;
    if experts.up.shape.len() != 3
        || experts
            .gate
            .as_ref()
            .is_some_and(|g| g.shape != experts.up.shape)
    {
        return Err(BackendError::Invalid(format!(
            "moe: stacked experts up {:?}, gate {:?}",
            experts.up.shape,
            experts.gate.as_ref().map(|g| &g.shape)
        )));
    }
    let inter = experts.up.shape[1];
    let r = MoeRouting {
        experts: n_experts,
        n_group: routing.n_group,
        topk_group: routing.topk_group,
        top_k: routing.top_k,
        norm_topk_prob: routing.norm_topk_prob,
        scaling: routing.scaling,
        softmax: routing.scoring == MoeScoring::Softmax,
    };
    let n = tokens * routing.top_k;
    let (mut ids, mut weights) = (vec![0u32; n], vec![0f32; n]);
    match routing.scoring {
        MoeScoring::Sigmoid => moe_route(
            &router_logits.data,
            tokens,
            &r,
            &routing.correction_bias.data,
            &mut ids,
            &mut weights,
        )?,
        MoeScoring::Softmax => {
            moe_route_softmax(&router_logits.data, tokens, &r, &mut ids, &mut weights)?
        }
    }
    let shape = ExpertShape {
        experts: n_experts,
        hidden,
        inter,
        top_k: routing.top_k,
        act: experts.act,
    };
    moe_experts_gated(
        &x.data,
        &ids,
        &weights,
        experts.gate.as_ref().map(|g| g.data.as_slice()),
        &experts.up.data,
        &experts.down.data,
        &shape,
        &mut out.data,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "moe_tests.rs"]
mod tests;
