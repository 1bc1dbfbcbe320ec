//! The sampling tail on the CPU: penalties, top-K candidates and log-sum-exp per logits row
//! (see [`crate::backend::sample`] for the columns and their invariants).
//!
//! This is the reference the device kernels are checked against, and it reproduces the host
//! sampling stage's arithmetic exactly: the same penalty formulas, the same candidate order
//! (descending logit, then ascending token id, NaN as negative infinity) and the same
//! sequential log-sum-exp, so a step that ends here gives bit-identical tokens and logprobs.
//! Rows are independent and run in parallel. The backend's entry gathers a step's sampled rows
//! first when prompt-logprob rows sit between them.

use rayon::prelude::*;

use super::{CpuBackend, CpuStep, CpuTensor};
use crate::backend::sample::{BIAS_ONLY, NO_MASK, Penalties, SampleOut, SampleRows};
use crate::backend::{BackendError, Result};

/// Logits handled by one parallel task at least.
const MIN_PARALLEL_ELEMS: usize = 1 << 16;

/// Applies each row's penalties to `logits` (`[rows, vocab]`, modified in place), then writes
/// its top-K candidates and, where wanted, its log-sum-exp into `out`.
pub fn sample_tail(
    logits: &mut [f32],
    vocab: usize,
    rows: &SampleRows,
    out: &mut SampleOut,
) -> Result<()> {
    check(logits, vocab, rows)?;
    let n = rows.len();
    let k = rows.k.min(vocab).max(1);
    out.reshape(n, k);
    let SampleOut {
        cand_tokens,
        cand_logits,
        lse,
        ..
    } = out;
    logits
        .par_chunks_mut(vocab)
        .zip(cand_tokens.par_chunks_mut(k))
        .zip(cand_logits.par_chunks_mut(k))
        .zip(lse.par_iter_mut())
        .enumerate()
        // Small rows run together on one thread: waking workers costs more than the work.
        .with_min_len((MIN_PARALLEL_ELEMS / vocab).max(1))
        .for_each_init(
            || Vec::with_capacity(k),
            |keys, (i, (((row, tokens), cand), lse))| {
                let pen = Penalties {
                    repetition: rows.repetition[i],
                    presence: rows.presence[i],
                    frequency: rows.frequency[i],
                };
                if let Some(mask) = rows.mask(i, vocab.div_ceil(32)) {
                    apply_mask(row, mask);
                }
                let (hist, counts) = rows.history(i);
                apply_penalties(row, pen, hist, counts, rows.bias(i));
                best_keys(row, k, keys);
                for ((c, t), x) in keys.iter().zip(tokens.iter_mut()).zip(cand.iter_mut()) {
                    *t = *c as u32;
                    *x = row[*t as usize];
                }
                *lse = if rows.want_lse[i] {
                    log_sum_exp(row)
                } else {
                    0.0
                };
            },
        );
    Ok(())
}

fn check(logits: &[f32], vocab: usize, rows: &SampleRows) -> Result<()> {
    let n = rows.len();
    let bad = |what: String| Err(BackendError::Invalid(format!("sample_tail: {what}")));
    if vocab == 0 || logits.len() != n * vocab {
        return bad(format!(
            "{} logits are not {n} rows of vocabulary {vocab}",
            logits.len()
        ));
    }
    if rows.presence.len() != n || rows.frequency.len() != n || rows.want_lse.len() != n {
        return bad("per-row columns differ in length".into());
    }
    let h = rows.hist_tokens.len();
    let offsets_ok = rows.hist_offsets.len() == n + 1
        && rows.hist_offsets[0] == 0
        && rows.hist_offsets.windows(2).all(|w| w[0] <= w[1])
        && rows.hist_offsets[n] as usize == h
        && rows.hist_counts.len() == h
        && rows.hist_bias.len() == h;
    if !offsets_ok {
        return bad("history offsets do not describe the history columns".into());
    }
    let words = vocab.div_ceil(32);
    let masks_ok = rows.mask_of.len() == n
        && rows.masks.len().is_multiple_of(words)
        && rows
            .mask_of
            .iter()
            .all(|&m| m == NO_MASK || (m as usize + 1) * words <= rows.masks.len());
    if !masks_ok {
        return bad("mask rows do not describe the mask words".into());
    }
    Ok(())
}

/// Sets the logit of every token `mask` does not allow to negative infinity.
fn apply_mask(row: &mut [f32], mask: &[u32]) {
    for (chunk, &word) in row.chunks_mut(32).zip(mask) {
        if word == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// Penalises the logits of the row's history tokens (distinct; ids outside the row are
/// ignored): repetition first, then `frequency · count + presence` for output tokens, then
/// each entry's bias. [`BIAS_ONLY`] entries get only their bias.
fn apply_penalties(row: &mut [f32], pen: Penalties, hist: &[u32], counts: &[u32], bias: &[f32]) {
    let (rep, pf) = (pen.repetition_on(), pen.counts_on());
    for ((&t, &c), &b) in hist.iter().zip(counts).zip(bias) {
        let Some(x) = row.get_mut(t as usize) else {
            continue;
        };
        let seen = c != BIAS_ONLY;
        if rep && seen {
            *x = if *x > 0.0 {
                *x / pen.repetition
            } else {
                *x * pen.repetition
            };
        }
        if pf && seen && c > 0 {
            *x -= pen.frequency * c as f32 + pen.presence;
        }
        if b != 0.0 {
            *x += b;
        }
    }
}

/// The [`order_key`]s of the `k` best entries of `row` into `out`, best first.
pub fn best_keys(row: &[f32], k: usize, out: &mut Vec<u64>) {
    out.clear();
    if k == 0 {
        return;
    }
    let mut worst = 0;
    for (t, &x) in row.iter().enumerate() {
        let c = order_key(x, t as u32);
        if out.len() < k {
            out.push(c);
            if out.len() == k {
                worst = max_at(out);
            }
        } else if c < out[worst] {
            out[worst] = c;
            worst = max_at(out);
        }
    }
    out.sort_unstable();
}

/// A key whose ascending order is descending logit, then ascending token id (NaN ranks as
/// negative infinity); the token id is the low 32 bits.
pub fn order_key(x: f32, t: u32) -> u64 {
    let x = if x.is_nan() { f32::NEG_INFINITY } else { x };
    let b = x.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (u64::from(!ascending) << 32) | u64::from(t)
}

fn max_at(c: &[u64]) -> usize {
    let mut w = 0;
    for i in 1..c.len() {
        if c[i] > c[w] {
            w = i;
        }
    }
    w
}

/// `ln Σ exp(x)` over the row, shifted by its maximum and summed in order (NaN entries make it
/// NaN; an all-`-inf` row gives `-inf`, a row holding `+inf` gives `+inf`).
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    max + sum.ln()
}

impl CpuBackend {
    pub(super) fn sample_rows(
        &self,
        logits: &mut CpuTensor,
        step: &CpuStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        let plan = &step.plan;
        let (rows, vocab) = logits.rows_cols();
        if plan.sampling.len() != plan.sample_rows.len() {
            return Err(BackendError::Invalid(format!(
                "{} sampling rows for {} sampled logits rows",
                plan.sampling.len(),
                plan.sample_rows.len()
            )));
        }
        if plan.sample_rows.len() == rows {
            return sample_tail(&mut logits.data, vocab, &plan.sampling, out);
        }
        // Prompt-logprob rows are interleaved: sample a gathered copy of the sampled rows.
        let mut picked = self.tmp(&[plan.sample_rows.len(), vocab]);
        for (dst, &r) in picked.data.chunks_mut(vocab.max(1)).zip(&plan.sample_rows) {
            if r as usize >= rows {
                return Err(BackendError::Invalid(format!(
                    "logits row {r} out of {rows}"
                )));
            }
            dst.copy_from_slice(logits.row(r as usize));
        }
        sample_tail(&mut picked.data, vocab, &plan.sampling, out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "sample_tests.rs"]
mod tests;
