//! The default sampler: greedy, temperature, top-k, min-p, top-p, drawn with a seeded RNG.
//!
//! Input per request: `k` candidates best first (logits after the host applied penalties).
//! Steps, in order: temperature scaling (0 or less, or NaN, means greedy argmax); top-k keeps
//! the first `top_k` candidates (0 disables); min-p drops candidates whose probability is below
//! `min_p` times the best one's (0 disables); top-p keeps the shortest prefix whose mass
//! reaches `top_p` of what is left (1 disables); one draw from `Rng::new(seed, counter)` picks
//! among the survivors. NaN logits count as −∞; a request whose logits are all −∞ gets its
//! first candidate.
//!
//! Candidates whose probability is below e^-16 of the best one's count as impossible. Because
//! candidates come best first, the weights are computed in blocks of [`BLOCK`] and the scan
//! stops after the first block that ends with an impossible candidate: everything after it is
//! impossible too. Every sum has a fixed order (four interleaved partial sums for the total,
//! candidate order for the prefix scans), so the result is the same bit for bit in every build,
//! scalar or vectorised, native or Wasm.

use alloc::vec::Vec;

use crate::columns::SamplerBatchView;
use crate::math;
use crate::rng::Rng;

/// Scaled logits below this (probability under e^-16 ≈ 1e-7 of the best) are treated as 0.
const NEGLIGIBLE: f32 = -16.0;

/// Candidates weighed at a time.
const BLOCK: usize = 8;

/// Per-request knobs, as in one row of the batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub counter: u64,
}

/// Samples every request of `batch` into `out` (cleared first). Returns `false`, leaving `out`
/// empty, when the batch's columns are inconsistent.
pub fn sample_batch(
    batch: &SamplerBatchView<'_>,
    scratch: &mut Vec<f32>,
    out: &mut Vec<u32>,
) -> bool {
    out.clear();
    if !batch.is_consistent() {
        return false;
    }
    out.reserve(batch.len());
    for i in 0..batch.len() {
        let params = Params {
            temperature: batch.temperature[i],
            top_k: batch.top_k[i],
            top_p: batch.top_p[i],
            min_p: batch.min_p[i],
            seed: batch.seed[i],
            counter: batch.counter[i],
        };
        let idx = sample_index(&params, batch.logits_of(i), scratch);
        out.push(batch.tokens_of(i)[idx]);
    }
    true
}

/// Index of the chosen candidate among `logits` (which must not be empty).
pub fn sample_index(p: &Params, logits: &[f32], weights: &mut Vec<f32>) -> usize {
    let n = match p.top_k {
        0 => logits.len(),
        k => logits.len().min(k as usize),
    };
    let Some(best) = argmax(&logits[..n]) else {
        return 0;
    };
    if p.temperature.is_nan() || p.temperature <= 0.0 || n == 1 {
        return best;
    }
    let total = weigh(
        &logits[..n],
        logits[best],
        1.0 / p.temperature,
        p.min_p.max(0.0),
        weights,
    );
    // top-p: the shortest prefix whose mass reaches `top_p` of the total.
    let mut end = weights.len();
    let mut kept = total;
    if p.top_p < 1.0 && p.top_p > 0.0 {
        let cut = p.top_p * total;
        let mut cum = 0.0f32;
        for (i, &w) in weights.iter().enumerate() {
            cum += w;
            if cum >= cut {
                end = i + 1;
                break;
            }
        }
        kept = cum;
    }
    let u = Rng::new(p.seed, p.counter).next_f32() * kept;
    let mut cum = 0.0f32;
    let mut last_kept = best;
    for (i, &w) in weights[..end].iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last_kept = i;
            if u < cum {
                return i;
            }
        }
    }
    last_kept
}

/// Fills `weights` with each candidate's probability relative to the best one (1 for the
/// best; 0 for NaN, negligible and min-p-filtered candidates), stopping after the first block
/// that ends with a 0, and returns their total.
fn weigh(logits: &[f32], max: f32, inv_t: f32, min_p: f32, weights: &mut Vec<f32>) -> f32 {
    weights.clear();
    // One partial sum per position in the block, added up in a fixed order at the end.
    let mut lanes = [0.0f32; BLOCK];
    for block in logits.chunks(BLOCK) {
        // A short last block is padded with impossible candidates.
        let mut l = [f32::NEG_INFINITY; BLOCK];
        l[..block.len()].copy_from_slice(block);
        let mut w = [0.0f32; BLOCK];
        for j in 0..BLOCK {
            let x = (l[j] - max) * inv_t;
            // NaN compares false: impossible.
            let possible = x >= NEGLIGIBLE;
            // Plain selects rather than `min`/`max`, whose NaN rules cost extra instructions.
            let clamped = if x < 0.0 { x } else { 0.0 };
            let q = math::exp_nonpositive(if possible { clamped } else { NEGLIGIBLE });
            w[j] = if possible && q >= min_p { q } else { 0.0 };
            lanes[j] += w[j];
        }
        weights.extend_from_slice(&w[..block.len()]);
        if w[block.len() - 1] == 0.0 {
            break;
        }
    }
    let [a, b, c, d, e, f, g, h] = lanes;
    ((a + b) + (c + d)) + ((e + f) + (g + h))
}

/// First index of the largest non-NaN value, `None` if all are NaN or −∞.
fn argmax(logits: &[f32]) -> Option<usize> {
    // The maximum in eight independent lanes (NaN never wins a `>`), then its first position.
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut blocks = logits.chunks_exact(8);
    for block in &mut blocks {
        for (m, &l) in lanes.iter_mut().zip(block) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = blocks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    if max == f32::NEG_INFINITY {
        return None;
    }
    logits.iter().position(|&l| l == max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn params(temperature: f32) -> Params {
        Params {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
            counter: 0,
        }
    }

    #[test]
    fn greedy_takes_argmax_and_skips_nan() {
        let mut s = Vec::new();
        assert_eq!(sample_index(&params(0.0), &[1.0, 3.0, 2.0], &mut s), 1);
        assert_eq!(sample_index(&params(0.0), &[f32::NAN, 0.5, 0.5], &mut s), 1);
        assert_eq!(sample_index(&params(0.7), &[f32::NAN, f32::NAN], &mut s), 0);
        assert_eq!(sample_index(&params(f32::NAN), &[0.0, 2.0], &mut s), 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let mut s = Vec::new();
        let logits = [5.0, 4.9, 4.8, 4.7];
        for counter in 0..50 {
            let p = Params {
                top_k: 1,
                counter,
                ..params(1.0)
            };
            assert_eq!(sample_index(&p, &logits, &mut s), 0);
            let p = Params {
                top_p: 0.01,
                counter,
                ..params(1.0)
            };
            assert_eq!(sample_index(&p, &logits, &mut s), 0);
        }
    }

    #[test]
    fn min_p_removes_unlikely_candidates() {
        let mut s = Vec::new();
        // exp(-5) ≈ 0.0067 < 0.1: candidate 2 can never be drawn.
        let logits = [0.0, -0.1, -5.0];
        for counter in 0..500 {
            let p = Params {
                min_p: 0.1,
                counter,
                ..params(1.0)
            };
            assert_ne!(sample_index(&p, &logits, &mut s), 2);
        }
    }

    #[test]
    fn draws_follow_the_distribution_and_repeat_per_seed() {
        let mut s = Vec::new();
        // Probabilities ∝ (1, e^-1, e^-2) = (0.665, 0.245, 0.090).
        let logits = [0.0, -1.0, -2.0];
        let mut counts = [0u32; 3];
        for counter in 0..20_000 {
            let p = Params {
                counter,
                ..params(1.0)
            };
            let i = sample_index(&p, &logits, &mut s);
            assert_eq!(i, sample_index(&p, &logits, &mut s));
            counts[i] += 1;
        }
        let f: Vec<f32> = counts.iter().map(|&c| c as f32 / 20_000.0).collect();
        assert!(
            (f[0] - 0.665).abs() < 0.02 && (f[1] - 0.245).abs() < 0.02,
            "{f:?}"
        );
        // A high temperature flattens the distribution.
        let mut hot = [0u32; 3];
        for counter in 0..20_000 {
            hot[sample_index(
                &Params {
                    counter,
                    ..params(100.0)
                },
                &logits,
                &mut s,
            )] += 1;
        }
        assert!(hot[2] > 6_000, "{hot:?}");
    }

    #[test]
    fn batch_checks_columns_and_maps_to_tokens() {
        let tokens = vec![10, 11, 20, 21];
        let logits = vec![0.0, 1.0, 3.0, 2.0];
        let batch = SamplerBatchView {
            k: 2,
            temperature: &[0.0, 0.0],
            top_k: &[0, 0],
            top_p: &[1.0, 1.0],
            min_p: &[0.0, 0.0],
            seed: &[0, 0],
            counter: &[0, 0],
            cand_tokens: &tokens,
            cand_logits: &logits,
        };
        let (mut s, mut out) = (Vec::new(), Vec::new());
        assert!(sample_batch(&batch, &mut s, &mut out));
        assert_eq!(out, vec![11, 20]);
        let bad = SamplerBatchView {
            cand_logits: &logits[..3],
            ..batch
        };
        assert!(!sample_batch(&bad, &mut s, &mut out));
        assert!(out.is_empty());
    }
}
