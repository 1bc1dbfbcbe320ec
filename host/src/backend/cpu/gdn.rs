//! The gated delta rule (Gated DeltaNet layers: Qwen3-Next, Qwen3.5) on the CPU.
//!
//! Per value head the state is `S [k_dim, v_dim]`; each token decays it by `exp(g)` and writes
//! the delta `β(v − Sᵀk)` along `k`, and the output reads `Sᵀq`. Like the Mamba2 scan it
//! continues from a sequence's live state slot, leaves the updated state there, and copies the
//! state at each snapshot point into the snapshot's slot (the chunk is split at those points;
//! the math is the same however a sequence is split).
//!
//! Two forms with identical results up to rounding, both public so tests can hold one against
//! the other: the recurrent step (single tokens) and the chunked form (prompts), which solves
//! each chunk's deltas by forward substitution and carries the state between chunks.

use rayon::prelude::*;

use super::ssm::{LayerState, segment_ends};
use super::{CpuBackend, CpuStep, CpuTensor};
use crate::backend::{BackendError, GdnOperands, GdnShape, Result, SeqChunk, SsmPools, StepPlan};

/// `−exp(a_log)·softplus(a + dt_bias)`, the log-decay of one token.
#[inline]
fn log_decay(a: f32, a_log: f32, dt_bias: f32) -> f32 {
    let x = a + dt_bias;
    let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
    -a_log.exp() * sp
}

/// `x / sqrt(Σx² + 1e-6)`, in place.
fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// One value head's inputs over `len` tokens: `q`/`k` `[len, dk]` (normalised, `q` scaled),
/// `v` `[len, dv]`, `g` (log-decay) and `beta` `[len]`.
#[derive(Clone, Copy)]
pub struct GdnHeadSeq<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub dk: usize,
    pub dv: usize,
}

impl<'a> GdnHeadSeq<'a> {
    /// Tokens `from..to`.
    pub fn tokens(&self, from: usize, to: usize) -> Self {
        let (dk, dv) = (self.dk, self.dv);
        Self {
            q: &self.q[from * dk..to * dk],
            k: &self.k[from * dk..to * dk],
            v: &self.v[from * dv..to * dv],
            g: &self.g[from..to],
            beta: &self.beta[from..to],
            dk,
            dv,
        }
    }
}

/// One value head's recurrence over its tokens from `state [dk, dv]`; writes `o [len, dv]`.
pub fn gdn_recurrent_head(seq: &GdnHeadSeq<'_>, state: &mut [f32], o: &mut [f32]) {
    let GdnHeadSeq {
        q,
        k,
        v,
        g,
        beta,
        dk,
        dv,
    } = *seq;
    let mut delta = vec![0.0f32; dv];
    for t in 0..g.len() {
        let decay = g[t].exp();
        for s in state.iter_mut() {
            *s *= decay;
        }
        let (qt, kt, vt) = (
            &q[t * dk..(t + 1) * dk],
            &k[t * dk..(t + 1) * dk],
            &v[t * dv..(t + 1) * dv],
        );
        // delta = β(v − Sᵀk)
        delta.copy_from_slice(vt);
        for (i, &ki) in kt.iter().enumerate() {
            for (d, s) in delta.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
                *d -= s * ki;
            }
        }
        for d in delta.iter_mut() {
            *d *= beta[t];
        }
        for (i, &ki) in kt.iter().enumerate() {
            for (s, d) in state[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                *s += ki * d;
            }
        }
        let ot = &mut o[t * dv..(t + 1) * dv];
        ot.fill(0.0);
        for (i, &qi) in qt.iter().enumerate() {
            for (y, s) in ot.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
                *y += s * qi;
            }
        }
    }
}

/// The same result as [`gdn_recurrent_head`], chunk by chunk. Within a chunk starting from
/// state `S₀`, with `G_t` the cumulative log-decay: the deltas solve
/// `u_t = β_t (v_t − e^{G_t} S₀ᵀk_t − Σ_{s<t} e^{G_t−G_s} (k_t·k_s) u_s)` (forward
/// substitution), the outputs are `o_t = e^{G_t} S₀ᵀq_t + Σ_{s≤t} e^{G_t−G_s} (q_t·k_s) u_s`,
/// and the state leaves as `S = e^{G_L} S₀ + Σ_s e^{G_L−G_s} k_s u_sᵀ`.
pub fn gdn_chunked_head(seq: &GdnHeadSeq<'_>, chunk: usize, state: &mut [f32], o: &mut [f32]) {
    let GdnHeadSeq {
        q,
        k,
        v,
        g,
        beta,
        dk,
        dv,
    } = *seq;
    let len = g.len();
    let chunk = chunk.max(1);
    let mut cum = vec![0.0f32; chunk];
    let mut u = vec![0.0f32; chunk * dv];
    let mut kk = vec![0.0f32; chunk];
    let mut read = vec![0.0f32; dv];
    let mut start = 0;
    while start < len {
        let end = (start + chunk).min(len);
        let n = end - start;
        let mut run = 0.0f32;
        for (l, c) in cum.iter_mut().enumerate().take(n) {
            run += g[start + l];
            *c = run;
        }
        // Deltas by forward substitution.
        for t in 0..n {
            let kt = &k[(start + t) * dk..(start + t + 1) * dk];
            state_read(state, kt, dv, &mut read);
            let decay_in = cum[t].exp();
            for s in 0..t {
                let ks = &k[(start + s) * dk..(start + s + 1) * dk];
                kk[s] = dot(kt, ks) * (cum[t] - cum[s]).exp();
            }
            let vt = &v[(start + t) * dv..(start + t + 1) * dv];
            let (done, rest) = u.split_at_mut(t * dv);
            let ut = &mut rest[..dv];
            for j in 0..dv {
                let mut acc = vt[j] - decay_in * read[j];
                for s in 0..t {
                    acc -= kk[s] * done[s * dv + j];
                }
                ut[j] = beta[start + t] * acc;
            }
        }
        // Outputs.
        for t in 0..n {
            let qt = &q[(start + t) * dk..(start + t + 1) * dk];
            state_read(state, qt, dv, &mut read);
            let decay_in = cum[t].exp();
            for s in 0..=t {
                let ks = &k[(start + s) * dk..(start + s + 1) * dk];
                kk[s] = dot(qt, ks) * (cum[t] - cum[s]).exp();
            }
            let ot = &mut o[(start + t) * dv..(start + t + 1) * dv];
            for j in 0..dv {
                let mut acc = decay_in * read[j];
                for s in 0..=t {
                    acc += kk[s] * u[s * dv + j];
                }
                ot[j] = acc;
            }
        }
        // Carry the state to the end of the chunk.
        carry_state(state, k, &u, &cum, start, n, (dk, dv));
        start = end;
    }
}

/// Carries a head's state over the chunk of `n` tokens from `start` (cumulative log-decays
/// `cum`, deltas `u`): `S = e^{G_L} S₀ + Σ_s e^{G_L−G_s} k_s u_sᵀ`.
fn carry_state(
    state: &mut [f32],
    k: &[f32],
    u: &[f32],
    cum: &[f32],
    start: usize,
    n: usize,
    (dk, dv): (usize, usize),
) {
    let last = cum[n - 1];
    let total = last.exp();
    for s in state.iter_mut() {
        *s *= total;
    }
    for s in 0..n {
        let w = (last - cum[s]).exp();
        let ks = &k[(start + s) * dk..(start + s + 1) * dk];
        let us = &u[s * dv..(s + 1) * dv];
        for (i, &ki) in ks.iter().enumerate() {
            let wk = w * ki;
            for (st, &uj) in state[i * dv..(i + 1) * dv].iter_mut().zip(us) {
                *st += wk * uj;
            }
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `out = Sᵀx` for `S [dk, dv]`.
fn state_read(state: &[f32], x: &[f32], dv: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (i, &xi) in x.iter().enumerate() {
        for (o, s) in out.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
            *o += s * xi;
        }
    }
}

/// One value head's inputs for one sequence chunk, gathered and prepared (normalised q/k,
/// decays, betas).
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl GdnOperands<'_, CpuTensor> {
    fn check(&self, s: &GdnShape, state_per: usize, out: &CpuTensor) -> Result<usize> {
        let (rows, qcols) = self.q.rows_cols();
        let ok = s.k_heads > 0
            && s.v_heads.is_multiple_of(s.k_heads)
            && qcols == s.key_dim()
            && self.k.rows_cols() == (rows, s.key_dim())
            && self.v.rows_cols() == (rows, s.value_dim())
            && self.a.rows_cols() == (rows, s.v_heads)
            && self.b.rows_cols() == (rows, s.v_heads)
            && self.a_log.data.len() == s.v_heads
            && self.dt_bias.data.len() == s.v_heads
            && state_per == s.state_elems()
            && out.data.len() == rows * s.value_dim();
        if !ok {
            return Err(BackendError::Invalid(format!(
                "gated_delta_rule: q {:?} k {:?} v {:?} a {:?} b {:?}, state of {state_per} \
                 values for {s:?}",
                self.q.shape, self.k.shape, self.v.shape, self.a.shape, self.b.shape
            )));
        }
        Ok(rows)
    }

    fn gather(&self, s: &GdnShape, seq: &SeqChunk, h: usize) -> HeadInputs {
        let (dk, dv) = (s.k_dim, s.v_dim);
        let kh = h / (s.v_heads / s.k_heads);
        let (kcols, vcols) = (s.key_dim(), s.value_dim());
        let scale = 1.0 / (dk as f32).sqrt();
        let mut out = HeadInputs {
            q: Vec::with_capacity(seq.len * dk),
            k: Vec::with_capacity(seq.len * dk),
            v: Vec::with_capacity(seq.len * dv),
            g: Vec::with_capacity(seq.len),
            beta: Vec::with_capacity(seq.len),
        };
        for i in 0..seq.len {
            let r = seq.offset + i;
            let qr = &self.q.data[r * kcols + kh * dk..r * kcols + (kh + 1) * dk];
            let kr = &self.k.data[r * kcols + kh * dk..r * kcols + (kh + 1) * dk];
            let at = out.q.len();
            out.q.extend_from_slice(qr);
            l2_normalize(&mut out.q[at..]);
            for x in &mut out.q[at..] {
                *x *= scale;
            }
            out.k.extend_from_slice(kr);
            l2_normalize(&mut out.k[at..]);
            out.v
                .extend_from_slice(&self.v.data[r * vcols + h * dv..r * vcols + (h + 1) * dv]);
            let a = self.a.data[r * s.v_heads + h];
            out.g
                .push(log_decay(a, self.a_log.data[h], self.dt_bias.data[h]));
            let b = self.b.data[r * s.v_heads + h];
            out.beta.push(1.0 / (1.0 + (-b).exp()));
        }
        out
    }
}

/// One value head's result over one sequence chunk.
struct HeadResult {
    o: Vec<f32>,
    state: Vec<f32>,
    snaps: Vec<Vec<f32>>,
}

pub(super) fn gated_delta_rule(
    inp: &GdnOperands<'_, CpuTensor>,
    shape: GdnShape,
    mut state: LayerState<'_>,
    plan: &StepPlan,
    out: &mut CpuTensor,
) -> Result<()> {
    let per = state.per_layer();
    inp.check(&shape, per, out)?;
    let (dk, dv) = (shape.k_dim, shape.v_dim);
    let head_state = dk * dv;
    let vcols = shape.value_dim();
    for (si, seq) in plan.seqs.iter().enumerate() {
        let live_base = state.slot_base(seq.ssm_slot)?;
        let targets = plan.snapshots_of(si);
        let ends = segment_ends(seq.len, targets)?;
        let snap_bases = targets
            .iter()
            .map(|t| state.slot_base(t.slot))
            .collect::<Result<Vec<_>>>()?;
        let live = &state.data()[live_base..live_base + per];
        let results: Vec<HeadResult> = (0..shape.v_heads)
            .into_par_iter()
            .map(|h| {
                let x = inp.gather(&shape, seq, h);
                let head = GdnHeadSeq {
                    q: &x.q,
                    k: &x.k,
                    v: &x.v,
                    g: &x.g,
                    beta: &x.beta,
                    dk,
                    dv,
                };
                let mut s = live[h * head_state..(h + 1) * head_state].to_vec();
                let mut o = vec![0.0f32; seq.len * dv];
                let mut snaps = Vec::with_capacity(ends.len());
                let mut from = 0;
                for &to in &ends {
                    let part = head.tokens(from, to);
                    let os = &mut o[from * dv..to * dv];
                    if to - from == 1 {
                        gdn_recurrent_head(&part, &mut s, os);
                    } else {
                        gdn_chunked_head(&part, shape.chunk_size, &mut s, os);
                    }
                    snaps.push(s.clone());
                    from = to;
                }
                HeadResult { o, state: s, snaps }
            })
            .collect();
        let data = state.data_mut();
        for (h, r) in results.into_iter().enumerate() {
            for i in 0..seq.len {
                let row = (seq.offset + i) * vcols + h * dv;
                out.data[row..row + dv].copy_from_slice(&r.o[i * dv..(i + 1) * dv]);
            }
            for (t, &base) in targets.iter().zip(&snap_bases) {
                let idx = ends
                    .iter()
                    .position(|&e| e == t.after as usize)
                    .unwrap_or(0);
                let dst = base + h * head_state;
                data[dst..dst + head_state].copy_from_slice(&r.snaps[idx]);
            }
            let dst = live_base + h * head_state;
            data[dst..dst + head_state].copy_from_slice(&r.state);
        }
    }
    Ok(())
}

impl CpuBackend {
    pub(super) fn delta_rule_layer(
        &self,
        x: &GdnOperands<'_, CpuTensor>,
        shape: GdnShape,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        let rows = x.q.rows_cols().0;
        let mut out = self.tmp(&[rows, shape.value_dim()]);
        let state = LayerState::new(&mut pools.ssm, layer)?;
        gated_delta_rule(x, shape, state, &step.plan, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::backend::cpu::test_rng::lcg;

    fn head<'a>(
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        (g, beta): (&'a [f32], &'a [f32]),
        (dk, dv): (usize, usize),
    ) -> GdnHeadSeq<'a> {
        GdnHeadSeq {
            q,
            k,
            v,
            g,
            beta,
            dk,
            dv,
        }
    }

    fn unit(seed: &mut u64, n: usize, rows: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n * rows).map(|_| lcg(seed)).collect();
        for r in x.chunks_mut(n) {
            l2_normalize(r);
        }
        x
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(u, v)| (u - v).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn chunked_delta_rule_equals_recurrence() {
        let (dk, dv) = (16, 8);
        let cases = [
            (1usize, 4usize),
            (2, 64),
            (7, 4),
            (33, 8),
            (64, 64),
            (100, 16),
            (131, 64),
            (131, 5),
        ];
        for &(len, chunk) in &cases {
            let mut seed = len as u64 * 131 + chunk as u64;
            let q = unit(&mut seed, dk, len);
            let k = unit(&mut seed, dk, len);
            let v: Vec<f32> = (0..len * dv).map(|_| 2.0 * lcg(&mut seed)).collect();
            let g: Vec<f32> = (0..len)
                .map(|_| log_decay(4.0 * lcg(&mut seed), 0.5, 0.1))
                .collect();
            let beta: Vec<f32> = (0..len).map(|_| 0.5 + lcg(&mut seed)).collect();
            let init: Vec<f32> = (0..dk * dv).map(|_| lcg(&mut seed)).collect();
            let (mut s1, mut s2) = (init.clone(), init.clone());
            let (mut o1, mut o2) = (vec![f32::NAN; len * dv], vec![f32::NAN; len * dv]);
            let seq = head(&q, &k, &v, (&g, &beta), (dk, dv));
            gdn_recurrent_head(&seq, &mut s1, &mut o1);
            gdn_chunked_head(&seq, chunk, &mut s2, &mut o2);
            let (d_o, d_s) = (max_diff(&o1, &o2), max_diff(&s1, &s2));
            assert!(
                o2.iter().all(|x| x.is_finite()),
                "len {len}: unwritten output"
            );
            assert!(
                d_o < 1e-4 && d_s < 1e-4,
                "len {len} chunk {chunk}: output diff {d_o}, state diff {d_s}"
            );
            // The state moved away from its start (the comparison above is not between two
            // untouched states).
            assert!(max_diff(&s1, &init) > 1e-3, "len {len}");
        }
    }

    #[test]
    fn splitting_a_sequence_gives_the_same_state() {
        let (dk, dv, len) = (8, 8, 40);
        let mut seed = 7;
        let q = unit(&mut seed, dk, len);
        let k = unit(&mut seed, dk, len);
        let v: Vec<f32> = (0..len * dv).map(|_| lcg(&mut seed)).collect();
        let g: Vec<f32> = (0..len).map(|_| -0.2 + 0.1 * lcg(&mut seed)).collect();
        let beta = vec![0.7f32; len];
        let mut whole = vec![0.0; dk * dv];
        let mut o = vec![0.0; len * dv];
        let seq = head(&q, &k, &v, (&g, &beta), (dk, dv));
        gdn_chunked_head(&seq, 16, &mut whole, &mut o);
        let mut split = vec![0.0; dk * dv];
        let mut o2 = vec![0.0; len * dv];
        let cut = 13;
        gdn_chunked_head(&seq.tokens(0, cut), 16, &mut split, &mut o2[..cut * dv]);
        gdn_chunked_head(&seq.tokens(cut, len), 16, &mut split, &mut o2[cut * dv..]);
        assert!(max_diff(&whole, &split) < 1e-5);
        assert!(max_diff(&o, &o2) < 1e-5);
    }
}
