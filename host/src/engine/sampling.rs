//! The engine's sampling stage: logits rows → one token per request.
//!
//! Per row: apply repetition / presence / frequency penalties from the request's token history,
//! take the top-K candidates (K from `engine.sampler_candidates`, the whole vocabulary if
//! smaller; best first, ties to the lower token id), hand all rows to the [`Sampler`] policy as
//! one [`SamplerBatch`] of columns, and validate its answer: every chosen token must be one of
//! its row's candidates, otherwise the built-in fallback sampler decides (and, should that
//! fail too, the best candidate). Logprobs are log-softmax over the full penalised row; the
//! top-N alternatives come from the candidates (N ≤ K).
//!
//! The penalties, top-K and log-sum-exp run on the backend (its sampling tail, described to it
//! by [`SamplingStage::sample_rows`]); [`SamplingStage::sample_candidates`] starts from the
//! candidate columns it returns ([`SampleOut`]). The full-row host path (`sample`, test builds
//! only) is the reference the candidate path is checked against.
//!
//! It owns no request state and knows nothing of caches or scheduling.

use super::api::{SamplingParams, TokenLogprob};
#[cfg(test)]
use super::executor::Logits;
use crate::backend::cpu::sample::{best_keys, log_sum_exp};
use crate::backend::sample::{Penalties, SampleOut, SampleRows};
use crate::policy::{Decision, Sampler, SamplerBatch};

/// Candidate columns whose lengths do not fit the rows being sampled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "candidate columns ({tokens} tokens, {logits} logits, {lse} lse) do not fit {rows} rows of {k}"
)]
pub struct CandidateShapeError {
    pub rows: usize,
    pub k: usize,
    pub tokens: usize,
    pub logits: usize,
    pub lse: usize,
}

/// What the stage needs to know about the request behind one logits row.
#[derive(Clone, Copy)]
pub struct RowInfo<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    /// Drafts before this row's position in a verify chunk: part of its history, as if they
    /// were output (empty for any other row).
    pub drafts: &'a [u32],
    pub seed: u64,
    /// Tokens masked out of this row (`min_tokens` not reached yet), sorted.
    pub banned: &'a [u32],
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

pub struct SamplingStage {
    k: usize,
    batch: SamplerBatch,
    /// Scratch of the full-row reference path.
    #[cfg(test)]
    lse: Vec<f32>,
    #[cfg(test)]
    scratch: Vec<u32>,
    #[cfg(test)]
    cand: Vec<u64>,
    /// Answers rejected (invalid or `UseDefault`) from the configured sampler.
    pub fallbacks: u64,
}

impl SamplingStage {
    pub fn new(k: usize) -> Self {
        Self {
            k: k.max(1),
            batch: SamplerBatch::default(),
            #[cfg(test)]
            lse: Vec::new(),
            #[cfg(test)]
            scratch: Vec::new(),
            #[cfg(test)]
            cand: Vec::new(),
            fallbacks: 0,
        }
    }

    /// Samples one token per row of `logits` (rows are modified by the penalties).
    #[cfg(test)]
    pub fn sample(
        &mut self,
        logits: &mut Logits,
        rows: &[RowInfo<'_>],
        sampler: &mut dyn Sampler,
        fallback: &mut dyn Sampler,
        out: &mut Vec<Sampled>,
    ) {
        out.clear();
        let k = self.k.min(logits.vocab).max(1);
        self.reset_batch(k);
        self.lse.clear();
        for (i, info) in rows.iter().enumerate() {
            let row = logits.row_mut(i);
            self.apply_penalties(row, info);
            self.top_k(row, k);
            self.push_params(info);
            self.lse.push(if info.params.logprobs.is_some() {
                log_sum_exp(row)
            } else {
                0.0
            });
        }
        let chosen = self.decide(sampler, fallback);
        for (i, (&token, info)) in chosen.iter().zip(rows).enumerate() {
            let logprob = info.params.logprobs.map(|n| {
                let lse = self.lse[i];
                let top = (0..(n as usize).min(k))
                    .map(|j| {
                        (
                            self.batch.cand_tokens[i * k + j],
                            self.batch.cand_logits[i * k + j] - lse,
                        )
                    })
                    .collect();
                TokenLogprob {
                    token,
                    logprob: logits.row(i)[token as usize] - lse,
                    top,
                    rank: None,
                }
            });
            out.push(Sampled { token, logprob });
        }
    }

    /// Describes `rows` for the backend's sampling tail ([`crate::backend::cpu::sample`] on
    /// the CPU): this stage's K, each row's penalties, whether it needs its log-sum-exp, and
    /// its history (prompt and output) as distinct tokens with output counts.
    pub fn sample_rows(&self, rows: &[RowInfo<'_>], out: &mut SampleRows) {
        out.clear(self.k);
        for info in rows {
            Self::push_sample_row(out, info);
        }
    }

    /// Appends one row's sampling inputs to `out` (after `out.clear(k)` with this stage's K,
    /// see [`Self::k`]).
    pub fn push_sample_row(out: &mut SampleRows, info: &RowInfo<'_>) {
        let p = info.params;
        let pen = Penalties {
            repetition: p.repetition_penalty,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
        };
        out.push_row_after(
            pen,
            p.logprobs.is_some(),
            info.prompt,
            info.output,
            info.drafts,
        );
        if !p.logit_bias.is_empty() || !info.banned.is_empty() {
            out.bias_last_row(&p.logit_bias, info.banned);
        }
    }

    /// Candidates per row this stage asks the backend for.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Samples one token per row from the candidate columns the backend's sampling tail
    /// produced for `rows` (see [`Self::sample_rows`]): the same [`SamplerBatch`], the same
    /// validation and fallback, and the same logprobs as [`Self::sample`] over full rows
    /// (the chosen token is always a candidate, so its logit is among them).
    /// `rows` is walked once, and again for the logprobs when a row asks for them, so it is a
    /// cloneable iterator.
    ///
    /// The candidate columns are taken, not copied, when no logit is NaN (nothing to map):
    /// `cands.cand_tokens` and `cands.cand_logits` then come back holding this stage's spare
    /// buffers of an earlier batch (the backend reshapes and overwrites them on its next read-back),
    /// which saves copying `rows × k` tokens and logits between the read-back and the next step.
    pub fn sample_candidates<'r>(
        &mut self,
        cands: &mut SampleOut,
        rows: impl Iterator<Item = RowInfo<'r>> + Clone,
        sampler: &mut dyn Sampler,
        fallback: &mut dyn Sampler,
        out: &mut Vec<Sampled>,
    ) -> Result<(), CandidateShapeError> {
        out.clear();
        let k = cands.k;
        self.reset_batch(k);
        let mut logprobs = false;
        for info in rows.clone() {
            logprobs |= info.params.logprobs.is_some();
            self.push_params(&info);
        }
        let n = self.batch.temperature.len();
        if k == 0
            || cands.cand_tokens.len() != n * k
            || cands.cand_logits.len() != n * k
            || cands.lse.len() != n
        {
            return Err(CandidateShapeError {
                rows: n,
                k,
                tokens: cands.cand_tokens.len(),
                logits: cands.cand_logits.len(),
                lse: cands.lse.len(),
            });
        }
        // The sampler sees NaN as negative infinity; without a NaN the columns are taken as
        // they are (the logprobs below read the unmapped logits either way).
        let taken = !any_nan(&cands.cand_logits);
        if taken {
            std::mem::swap(&mut self.batch.cand_tokens, &mut cands.cand_tokens);
            std::mem::swap(&mut self.batch.cand_logits, &mut cands.cand_logits);
        } else {
            self.batch.cand_tokens.extend_from_slice(&cands.cand_tokens);
            self.batch.cand_logits.extend(
                cands
                    .cand_logits
                    .iter()
                    .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x }),
            );
        }
        let chosen = self.decide(sampler, fallback);
        if !logprobs {
            out.extend(chosen.iter().map(|&token| Sampled {
                token,
                logprob: None,
            }));
            return Ok(());
        }
        let raw_logits = if taken {
            &self.batch.cand_logits
        } else {
            &cands.cand_logits
        };
        for (i, (&token, info)) in chosen.iter().zip(rows).enumerate() {
            let logprob = info.params.logprobs.map(|top| {
                let lse = cands.lse[i];
                let row = i * k..(i + 1) * k;
                let at = self.batch.cand_tokens[row.clone()]
                    .iter()
                    .position(|&t| t == token)
                    .unwrap_or(0);
                TokenLogprob {
                    token,
                    logprob: raw_logits[row.start + at] - lse,
                    top: (row.start..row.start + (top as usize).min(k))
                        .map(|j| (self.batch.cand_tokens[j], self.batch.cand_logits[j] - lse))
                        .collect(),
                    rank: None,
                }
            });
            out.push(Sampled { token, logprob });
        }
        Ok(())
    }

    /// Appends one row's sampler parameters to the batch.
    fn push_params(&mut self, info: &RowInfo<'_>) {
        let p = info.params;
        self.batch.temperature.push(p.temperature);
        self.batch.top_k.push(p.top_k);
        self.batch.top_p.push(p.top_p);
        self.batch.min_p.push(p.min_p);
        self.batch.seed.push(info.seed);
        self.batch
            .counter
            .push((info.output.len() + info.drafts.len()) as u64);
    }

    /// The sampler's validated answer for the batch, else the fallback's, else the best
    /// candidate of every row.
    fn decide(&mut self, sampler: &mut dyn Sampler, fallback: &mut dyn Sampler) -> Vec<u32> {
        if let Some(v) = self.validated(sampler.sample(&self.batch)) {
            return v;
        }
        self.fallbacks += 1;
        tracing::debug!("sampler answer rejected; using the fallback sampler");
        self.validated(fallback.sample(&self.batch))
            .unwrap_or_else(|| {
                let k = self.batch.k as usize;
                (0..self.batch.len())
                    .map(|i| self.batch.cand_tokens[i * k])
                    .collect()
            })
    }

    fn reset_batch(&mut self, k: usize) {
        let b = &mut self.batch;
        b.k = k as u32;
        b.temperature.clear();
        b.top_k.clear();
        b.top_p.clear();
        b.min_p.clear();
        b.seed.clear();
        b.counter.clear();
        b.cand_tokens.clear();
        b.cand_logits.clear();
    }

    /// Checks a policy answer: one token per row, each among its row's candidates and not one
    /// with probability zero (a banned token's logit is negative infinity) unless the whole
    /// row is.
    fn validated(&self, d: Decision<Vec<u32>>) -> Option<Vec<u32>> {
        let Decision::Use(v) = d else { return None };
        let k = self.batch.k as usize;
        let ok = v.len() == self.batch.len()
            && v.iter().enumerate().all(|(i, t)| {
                let row = i * k..(i + 1) * k;
                let Some(j) = self.batch.cand_tokens[row.clone()]
                    .iter()
                    .position(|c| c == t)
                else {
                    return false;
                };
                let logits = &self.batch.cand_logits[row];
                logits[j] != f32::NEG_INFINITY || logits[0] == f32::NEG_INFINITY
            });
        ok.then_some(v)
    }

    #[cfg(test)]
    fn apply_penalties(&mut self, row: &mut [f32], info: &RowInfo<'_>) {
        let p = info.params;
        let vocab = row.len();
        if p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0 {
            self.scratch.clear();
            self.scratch
                .extend(info.prompt.iter().chain(info.output).chain(info.drafts));
            self.scratch.sort_unstable();
            self.scratch.dedup();
            for &t in &self.scratch {
                if let Some(x) = row.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            self.scratch.clear();
            self.scratch
                .extend((info.output.iter().chain(info.drafts)).filter(|&&t| (t as usize) < vocab));
            self.scratch.sort_unstable();
            for run in self.scratch.chunk_by(|a, b| a == b) {
                let x = &mut row[run[0] as usize];
                *x -= p.frequency_penalty * run.len() as f32 + p.presence_penalty;
            }
        }
        // A zero bias is no bias (the tail's entries default to 0 and are skipped; adding
        // 0.0 would turn -0.0 into +0.0).
        for &(t, b) in p.logit_bias.iter().filter(|(_, b)| *b != 0.0) {
            if let Some(x) = row.get_mut(t as usize) {
                *x += b;
            }
        }
        for &t in info.banned {
            if let Some(x) = row.get_mut(t as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
    }

    /// Appends the `k` best (logit, token) of `row` to the batch, best first.
    #[cfg(test)]
    fn top_k(&mut self, row: &[f32], k: usize) {
        best_keys(row, k, &mut self.cand);
        for &c in &self.cand {
            let t = c as u32;
            let x = row[t as usize];
            self.batch.cand_tokens.push(t);
            self.batch
                .cand_logits
                .push(if x.is_nan() { f32::NEG_INFINITY } else { x });
        }
    }
}

/// Whether any of `xs` is NaN. Blocks are folded without an early exit so the compiler
/// vectorises them (an `any` over the elements is a scalar loop); at batch 256 this scans the
/// step's 256 × 64 candidate logits on the critical path between two device steps.
fn any_nan(xs: &[f32]) -> bool {
    xs.chunks(512)
        .any(|block| block.iter().fold(false, |seen, x| seen | x.is_nan()))
}

/// The logprob of `token` under the logits `row`, with the `top` best alternatives (ties to
/// the lower token id), for prompt logprobs.
pub fn token_logprob(row: &[f32], token: u32, top: usize) -> TokenLogprob {
    let lse = log_sum_exp(row);
    let mut best = Vec::with_capacity(top);
    best_keys(row, top, &mut best);
    let logprob = |t: u32| row.get(t as usize).map_or(f32::NEG_INFINITY, |&x| x - lse);
    // Rank in the candidate order (higher logit first, ties to the lower id, NaN last).
    let rank = row.get(token as usize).map(|&x| {
        let key = crate::backend::cpu::sample::order_key(x, token);
        1 + row
            .iter()
            .enumerate()
            .filter(|&(t, &y)| crate::backend::cpu::sample::order_key(y, t as u32) < key)
            .count() as u32
    });
    TokenLogprob {
        token,
        logprob: logprob(token),
        top: best
            .into_iter()
            .map(|c| (c as u32, logprob(c as u32)))
            .collect(),
        rank,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "sampling_tests.rs"]
mod tests;
