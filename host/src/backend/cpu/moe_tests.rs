use proptest::prelude::*;

use super::*;

/// Uniform in [-1, 1).
fn lcg(seed: &mut u64) -> f32 {
    crate::backend::cpu::test_rng::lcg(seed) * 2.0
}

fn routing(experts: usize, n_group: usize, topk_group: usize, top_k: usize) -> MoeRouting {
    MoeRouting {
        experts,
        n_group,
        topk_group,
        top_k,
        norm_topk_prob: true,
        scaling: 2.5,
        softmax: false,
    }
}

/// The routing algorithm as `Moe::route` wrote it before the kernel (sort-based), the oracle.
fn reference_route(logits: &[f32], bias: &[f32], r: &MoeRouting) -> Vec<(usize, f32)> {
    let e = logits.len();
    let scores: Vec<f32> = logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per_group = e / r.n_group;
    let mut groups: Vec<(usize, f32)> = (0..r.n_group)
        .map(|g| {
            let mut v: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (g, v.iter().take(2).sum())
        })
        .collect();
    groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut allowed = vec![false; r.n_group];
    for (g, _) in groups.iter().take(r.topk_group) {
        allowed[*g] = true;
    }
    let mut cand: Vec<(usize, f32)> = (0..e)
        .filter(|i| allowed[i / per_group])
        .map(|i| (i, choice[i]))
        .collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    cand.truncate(r.top_k);
    let mut picked: Vec<(usize, f32)> = cand.iter().map(|&(i, _)| (i, scores[i])).collect();
    if r.norm_topk_prob {
        let sum: f32 = picked.iter().map(|p| p.1).sum::<f32>() + 1e-20;
        for p in &mut picked {
            p.1 /= sum;
        }
    }
    for p in &mut picked {
        p.1 *= r.scaling;
    }
    picked
}

fn route(logits: &[f32], bias: &[f32], r: &MoeRouting) -> (Vec<u32>, Vec<f32>) {
    let tokens = logits.len() / r.experts;
    let mut ids = vec![u32::MAX; tokens * r.top_k];
    let mut w = vec![f32::NAN; tokens * r.top_k];
    moe_route(logits, tokens, r, bias, &mut ids, &mut w).unwrap();
    (ids, w)
}

fn assert_route_eq(
    logits: &[f32],
    bias: &[f32],
    r: &MoeRouting,
    want: impl Fn(&[f32]) -> Vec<(usize, f32)>,
) {
    let (ids, w) = route(logits, bias, r);
    for (t, row) in logits.chunks(r.experts).enumerate() {
        let want = want(row);
        let got: Vec<(usize, f32)> = (0..r.top_k)
            .map(|j| (ids[t * r.top_k + j] as usize, w[t * r.top_k + j]))
            .collect();
        assert_eq!(got.len(), want.len());
        for (g, x) in got.iter().zip(&want) {
            assert_eq!(g.0, x.0, "token {t}: ids {got:?} vs {want:?}");
            assert_eq!(
                g.1.to_bits(),
                x.1.to_bits(),
                "token {t}: {got:?} vs {want:?}"
            );
        }
    }
}

/// Group configurations `(experts, n_group, topk_group, top_k)`, including groups of one and
/// picking every allowed expert.
const CONFIGS: [(usize, usize, usize, usize); 7] = [
    (8, 1, 1, 2),
    (8, 4, 2, 3),
    (16, 4, 1, 4),
    (6, 6, 3, 3),
    (12, 3, 3, 12),
    (16, 8, 4, 6),
    (128, 8, 4, 8),
];

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => (-4i8..=4).prop_map(|v| f32::from(v) * 0.5),
        2 => -8.0f32..8.0,
        1 => Just(-0.0f32),
    ]
}

proptest! {
    #[test]
    fn route_matches_the_reference_with_ties(
        cfg in 0..CONFIGS.len(),
        tokens in 1usize..6,
        seed in any::<u64>(),
        tied_bias in any::<bool>(),
        norm in any::<bool>(),
        pool in proptest::collection::vec(value(), 64),
    ) {
        let (e, g, tg, k) = CONFIGS[cfg];
        let mut s = seed;
        let mut pick = || pool[(lcg(&mut s).abs() * 63.0) as usize];
        let logits: Vec<f32> = (0..tokens * e).map(|_| pick()).collect();
        let bias: Vec<f32> = (0..e)
            .map(|_| if tied_bias { pick() * 0.25 } else { 0.0 })
            .collect();
        let r = MoeRouting { norm_topk_prob: norm, ..routing(e, g, tg, k) };
        assert_route_eq(&logits, &bias, &r, |row| reference_route(row, &bias, &r));
    }
}

#[test]
fn route_breaks_exact_ties_towards_the_lower_id() {
    // All experts equal: groups 0 and 1 win, then experts 0, 1, 2 in order.
    let r = routing(8, 4, 2, 3);
    let (ids, w) = route(&[0.5; 8], &[0.0; 8], &r);
    assert_eq!(ids, [0, 1, 2]);
    let s = 1.0 / (1.0 + (-0.5f32).exp());
    assert_eq!(w[0].to_bits(), (s / (s + s + s + 1e-20) * 2.5).to_bits());
    // The bias steers the choice but not the weight.
    let mut bias = [0.0; 8];
    bias[7] = 1.0;
    let (ids, w) = route(
        &[0.5; 8],
        &bias,
        &MoeRouting {
            norm_topk_prob: false,
            ..r
        },
    );
    assert_eq!(ids, [7, 0, 1]);
    assert_eq!(w, [s * 2.5; 3]);
}

#[test]
fn route_writes_every_slot_and_rejects_impossible_configs() {
    let mut seed = 7;
    let r = routing(16, 4, 2, 5);
    let logits: Vec<f32> = (0..3 * 16).map(|_| lcg(&mut seed) * 4.0).collect();
    let (ids, w) = route(&logits, &[0.0; 16], &r);
    assert!(ids.iter().all(|&i| i < 16));
    assert!(w.iter().all(|x| x.is_finite()));
    let mut ids = vec![0; 3 * 5];
    let mut w = vec![0.0; 3 * 5];
    // top_k larger than the allowed groups hold, groups that do not divide, short outputs.
    for bad in [
        routing(16, 4, 1, 5),
        routing(16, 3, 1, 2),
        routing(16, 4, 5, 2),
    ] {
        let n = 3 * bad.top_k;
        let (mut ids, mut w) = (vec![0; n], vec![0.0; n]);
        assert!(moe_route(&logits, 3, &bad, &[0.0; 16], &mut ids, &mut w).is_err());
    }
    assert!(moe_route(&logits, 3, &r, &[0.0; 16], &mut ids[1..], &mut w).is_err());
    assert!(moe_route(&logits, 3, &r, &[0.0; 15], &mut ids, &mut w).is_err());
    assert!(moe_route(&logits[1..], 3, &r, &[0.0; 16], &mut ids, &mut w).is_err());
}

struct Experts {
    shape: ExpertShape,
    up: Vec<f32>,
    down: Vec<f32>,
}

fn experts(seed: &mut u64, shape: ExpertShape) -> Experts {
    let (e, h, i) = (shape.experts, shape.hidden, shape.inter);
    Experts {
        shape,
        up: (0..e * i * h).map(|_| lcg(seed) * 0.5).collect(),
        down: (0..e * h * i).map(|_| lcg(seed) * 0.5).collect(),
    }
}

/// `out[t] += Σ_j w · down(act(up(x[t])))` with plain loops, token by token.
fn plain_experts(x: &[f32], ids: &[u32], w: &[f32], ex: &Experts, out: &mut [f32]) {
    let ExpertShape {
        hidden: h,
        inter: i,
        top_k,
        act,
        ..
    } = ex.shape;
    for (t, xt) in x.chunks(h).enumerate() {
        for j in 0..top_k {
            let e = ids[t * top_k + j] as usize;
            let mid: Vec<f32> = (0..i)
                .map(|r| {
                    let row = &ex.up[(e * i + r) * h..(e * i + r + 1) * h];
                    apply_act(row.iter().zip(xt).map(|(a, b)| a * b).sum(), act)
                })
                .collect();
            for c in 0..h {
                let row = &ex.down[(e * h + c) * i..(e * h + c + 1) * i];
                let y: f32 = row.iter().zip(&mid).map(|(a, b)| a * b).sum();
                out[t * h + c] += w[t * top_k + j] * y;
            }
        }
    }
}

#[test]
fn experts_match_plain_loops() {
    let mut seed = 11;
    for act in [Activation::Relu2, Activation::Silu, Activation::Gelu] {
        let shape = ExpertShape {
            experts: 6,
            hidden: 24,
            inter: 40,
            top_k: 2,
            act,
        };
        let ex = experts(&mut seed, shape);
        let tokens = 9;
        let x: Vec<f32> = (0..tokens * 24).map(|_| lcg(&mut seed)).collect();
        let logits: Vec<f32> = (0..tokens * 6).map(|_| lcg(&mut seed) * 3.0).collect();
        let (ids, w) = route(&logits, &[0.0; 6], &routing(6, 3, 2, 2));
        // Accumulates into what is there.
        let base: Vec<f32> = (0..tokens * 24).map(|_| lcg(&mut seed)).collect();
        let mut got = base.clone();
        moe_experts(&x, &ids, &w, &ex.up, &ex.down, &shape, &mut got).unwrap();
        let mut want = base.clone();
        plain_experts(&x, &ids, &w, &ex, &mut want);
        for (k, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * e.abs().max(1.0),
                "{act:?} element {k}: {g} vs {e}"
            );
        }
        assert!(got.iter().zip(&base).any(|(g, b)| g != b));
    }
}

/// A gated MoE case: experts of `shape` with a random gate, 7 tokens routed by `routing`
/// (top-k of `shape`), `moe_experts_gated`'s output checked against plain loops. Returns the
/// inputs and the output for the caller's further checks.
struct GatedCase {
    ex: Experts,
    gate: Vec<f32>,
    x: Vec<f32>,
    ids: Vec<u32>,
    w: Vec<f32>,
    got: Vec<f32>,
}

fn gated_case(seed: u64, shape: ExpertShape, routing: &MoeRouting) -> GatedCase {
    let mut seed = seed;
    let (e, h, i, k) = (shape.experts, shape.hidden, shape.inter, shape.top_k);
    let ex = experts(&mut seed, shape);
    let gate: Vec<f32> = (0..e * i * h).map(|_| lcg(&mut seed) * 0.5).collect();
    let tokens = 7;
    let x: Vec<f32> = (0..tokens * h).map(|_| lcg(&mut seed)).collect();
    let logits: Vec<f32> = (0..tokens * e).map(|_| lcg(&mut seed) * 3.0).collect();
    let (ids, w) = route(&logits, &vec![0.0; e], routing);
    let mut got = vec![0.0f32; tokens * h];
    moe_experts_gated(
        &x,
        &ids,
        &w,
        Some(&gate),
        &ex.up,
        &ex.down,
        &shape,
        &mut got,
    )
    .unwrap();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
    for (t, xt) in x.chunks(h).enumerate() {
        let mut want = vec![0.0f32; h];
        for j in 0..k {
            let ex_id = ids[t * k + j] as usize;
            let mid: Vec<f32> = (0..i)
                .map(|r| {
                    let at = (ex_id * i + r) * h..(ex_id * i + r + 1) * h;
                    apply_act(dot(&gate[at.clone()], xt), shape.act) * dot(&ex.up[at], xt)
                })
                .collect();
            for (c, o) in want.iter_mut().enumerate() {
                let row = &ex.down[(ex_id * h + c) * i..(ex_id * h + c + 1) * i];
                *o += w[t * k + j] * dot(row, &mid);
            }
        }
        for (c, (g, wv)) in got[t * h..(t + 1) * h].iter().zip(&want).enumerate() {
            assert!(
                (g - wv).abs() <= 1e-5 * wv.abs().max(1.0),
                "token {t} col {c}: {g} vs {wv}"
            );
        }
    }
    GatedCase {
        ex,
        gate,
        x,
        ids,
        w,
        got,
    }
}

/// `moe_experts_gated` with a gate one element short is an error.
fn short_gate_is_refused(case: &GatedCase, shape: &ExpertShape) {
    let mut out = vec![0.0f32; case.got.len()];
    assert!(
        moe_experts_gated(
            &case.x,
            &case.ids,
            &case.w,
            Some(&case.gate[1..]),
            &case.ex.up,
            &case.ex.down,
            shape,
            &mut out
        )
        .is_err()
    );
}

#[test]
fn gated_experts_match_plain_loops() {
    let shape = ExpertShape {
        experts: 6,
        hidden: 24,
        inter: 40,
        top_k: 3,
        act: Activation::Silu,
    };
    let case = gated_case(5, shape, &routing(6, 3, 2, 3));
    // The gate matters: without it the result differs.
    let mut plain = vec![0.0f32; case.got.len()];
    moe_experts(
        &case.x,
        &case.ids,
        &case.w,
        &case.ex.up,
        &case.ex.down,
        &shape,
        &mut plain,
    )
    .unwrap();
    assert!(
        plain
            .iter()
            .zip(&case.got)
            .any(|(a, b)| (a - b).abs() > 1e-3)
    );
    short_gate_is_refused(&case, &shape);
}

#[test]
fn gated_experts_of_another_shape_match_plain_loops() {
    let shape = ExpertShape {
        experts: 5,
        hidden: 12,
        inter: 20,
        top_k: 2,
        act: Activation::Silu,
    };
    let case = gated_case(17, shape, &routing(5, 1, 1, 2));
    short_gate_is_refused(&case, &shape);
}

#[test]
fn experts_reject_bad_shapes_and_ids() {
    let shape = ExpertShape {
        experts: 2,
        hidden: 4,
        inter: 3,
        top_k: 1,
        act: Activation::Relu2,
    };
    let ex = experts(&mut 3, shape);
    let x = [0.5f32; 8];
    let mut out = [0.0f32; 8];
    assert!(moe_experts(&x, &[0, 2], &[1.0; 2], &ex.up, &ex.down, &shape, &mut out).is_err());
    assert!(moe_experts(&x, &[0], &[1.0], &ex.up, &ex.down, &shape, &mut out).is_err());
    assert!(
        moe_experts(
            &x,
            &[0, 1],
            &[1.0; 2],
            &ex.up[1..],
            &ex.down,
            &shape,
            &mut out
        )
        .is_err()
    );
    assert!(
        moe_experts(
            &x,
            &[0, 1],
            &[1.0; 2],
            &ex.up,
            &ex.down,
            &shape,
            &mut out[1..]
        )
        .is_err()
    );
    assert!(moe_experts(&x, &[1, 1], &[1.0; 2], &ex.up, &ex.down, &shape, &mut out).is_ok());
}

// ---- softmax routing and gated experts (Granite 4.0) ----

/// Granite's router as transformers writes it: the `top_k` largest logits (ties to the lower
/// id), weights = softmax over those logits alone.
fn reference_softmax_route(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let max = logits[order[0]];
    let exps: Vec<f32> = order.iter().map(|&e| (logits[e] - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    order
        .into_iter()
        .zip(exps)
        .map(|(e, v)| (e, v / sum))
        .collect()
}

#[test]
fn softmax_routing_picks_the_largest_logits_and_normalises_over_them() {
    let mut seed = 5;
    for (experts, top_k) in [(8, 2), (6, 1), (16, 5), (4, 4)] {
        let tokens = 11;
        // Values on a coarse grid, so ties happen and must go to the lower id.
        let logits: Vec<f32> = (0..tokens * experts)
            .map(|_| (lcg(&mut seed) * 6.0).round() / 2.0)
            .collect();
        let r = MoeRouting {
            scaling: 1.0,
            ..routing(experts, 1, 1, top_k)
        };
        let mut ids = vec![u32::MAX; tokens * top_k];
        let mut w = vec![f32::NAN; tokens * top_k];
        moe_route_softmax(&logits, tokens, &r, &mut ids, &mut w).unwrap();
        for (t, row) in logits.chunks(experts).enumerate() {
            let want = reference_softmax_route(row, top_k);
            for (j, (e, wt)) in want.iter().enumerate() {
                assert_eq!(ids[t * top_k + j] as usize, *e, "token {t} slot {j}");
                let got = w[t * top_k + j];
                assert!(
                    (got - wt).abs() <= 1e-6,
                    "token {t} slot {j}: {got} vs {wt}"
                );
            }
            let sum: f32 = w[t * top_k..(t + 1) * top_k].iter().sum();
            assert!((sum - 1.0).abs() <= 1e-6, "token {t}: weights sum to {sum}");
        }
    }
    // Without renormalisation the weights are the softmax over all experts.
    let logits = [0.0f32, 1.0, 2.0, 3.0];
    let r = MoeRouting {
        norm_topk_prob: false,
        scaling: 2.0,
        ..routing(4, 1, 1, 2)
    };
    let (mut ids, mut w) = (vec![0u32; 2], vec![0f32; 2]);
    moe_route_softmax(&logits, 1, &r, &mut ids, &mut w).unwrap();
    let z: f32 = logits.iter().map(|v| (v - 3.0).exp()).sum();
    assert_eq!(ids, [3, 2]);
    assert!((w[0] - 2.0 / z).abs() <= 1e-6 && (w[1] - 2.0 * (-1.0f32).exp() / z).abs() <= 1e-6);
    assert!(moe_route_softmax(&logits, 1, &routing(4, 1, 1, 5), &mut ids, &mut w).is_err());
}
