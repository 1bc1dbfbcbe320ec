//! Mamba2 kernels on the CPU: the depthwise causal conv and the selective scan, and the
//! step's slot restores and zeros over the slot-major state pools.
//!
//! Both continue from a per-sequence state slot and leave the updated state there. A sequence
//! chunk may ask for snapshots "after N tokens": the state at that point is copied into the
//! snapshot slot, which is how the engine makes prefix-cache entries for SSM state. The scan
//! splits a chunk at snapshot points; the math is the same whichever way a sequence is split.
//!
//! The scan has two forms with identical results (up to rounding): the chunked SSD form for
//! prompts (quadratic within a chunk, state passing between chunks) and the recurrent step for
//! single tokens. Both are public so tests can check one against the other.

use rayon::prelude::*;

use super::{CpuBackend, CpuStep, CpuTensor, slot_elems};
use crate::backend::{
    BackendError, Result, SeqChunk, SlotOp, SnapshotTarget, SsmOperands, SsmPools, SsmShape,
    StepPlan,
};

/// One SSM layer's state inside a slot-major pool `[slots, layers, per-layer elems]`.
pub(super) struct LayerState<'a> {
    data: &'a mut [f32],
    slots: usize,
    layers: usize,
    layer: usize,
    per: usize,
}

impl<'a> LayerState<'a> {
    pub(super) fn new(pool: &'a mut CpuTensor, layer: usize) -> Result<Self> {
        let slots = pool.shape.first().copied().unwrap_or(0);
        let layers = pool.shape.get(1).copied().unwrap_or(0);
        if layer >= layers {
            return Err(BackendError::Invalid(format!(
                "SSM layer {layer} out of {layers} in a pool of shape {:?}",
                pool.shape
            )));
        }
        let per = pool.shape.iter().skip(2).product();
        Ok(Self {
            data: &mut pool.data,
            slots,
            layers,
            layer,
            per,
        })
    }

    /// Values of one slot's state of this layer.
    pub(super) fn per_layer(&self) -> usize {
        self.per
    }

    pub(super) fn data(&self) -> &[f32] {
        self.data
    }

    pub(super) fn data_mut(&mut self) -> &mut [f32] {
        self.data
    }

    /// Offset of `slot`'s state of this layer.
    pub(super) fn slot_base(&self, slot: u32) -> Result<usize> {
        self.base(slot)
    }

    /// Offset of `slot`'s state of this layer.
    fn base(&self, slot: u32) -> Result<usize> {
        if slot as usize >= self.slots {
            return Err(BackendError::Invalid(format!(
                "SSM slot {slot} out of {}",
                self.slots
            )));
        }
        Ok((slot as usize * self.layers + self.layer) * self.per)
    }
}

/// Sorted, de-duplicated split points strictly inside the chunk, then the chunk end.
pub(super) fn segment_ends(len: usize, snaps: &[SnapshotTarget]) -> Result<Vec<usize>> {
    let mut ends: Vec<usize> = Vec::with_capacity(snaps.len() + 1);
    for s in snaps {
        let after = s.after as usize;
        if after == 0 || after > len {
            return Err(BackendError::Invalid(format!(
                "snapshot after {after} tokens of a {len}-token chunk"
            )));
        }
        ends.push(after);
    }
    ends.push(len);
    ends.sort_unstable();
    ends.dedup();
    Ok(ends)
}

pub(super) fn causal_conv1d(
    x: &CpuTensor,
    weight: &CpuTensor,
    bias: Option<&CpuTensor>,
    state: LayerState<'_>,
    plan: &StepPlan,
    out: &mut CpuTensor,
) -> Result<()> {
    let (n, ch) = x.rows_cols();
    let kernel = weight.shape.last().copied().unwrap_or(0);
    if weight.data.len() != ch * kernel || kernel < 2 || out.data.len() != n * ch {
        return Err(BackendError::Invalid(format!(
            "conv1d weight {:?} for {ch} channels",
            weight.shape
        )));
    }
    let hist = kernel - 1;
    if state.per != ch * hist {
        return Err(BackendError::Invalid(format!(
            "conv state of {} values for {ch} channels, kernel {kernel}",
            state.per
        )));
    }
    let mut window = Vec::new();
    for (si, seq) in plan.seqs.iter().enumerate() {
        let base = state.base(seq.ssm_slot)?;
        let snaps = plan.snapshots_of(si);
        for c in 0..ch {
            window.clear();
            window.extend_from_slice(&state.data[base + c * hist..base + (c + 1) * hist]);
            window.extend((0..seq.len).map(|i| x.data[(seq.offset + i) * ch + c]));
            let w = &weight.data[c * kernel..(c + 1) * kernel];
            let b = bias.map_or(0.0, |b| b.data[c]);
            for i in 0..seq.len {
                let acc: f32 = w
                    .iter()
                    .zip(&window[i..i + kernel])
                    .map(|(a, v)| a * v)
                    .sum();
                out.data[(seq.offset + i) * ch + c] = super::silu(acc + b);
            }
            for snap in snaps {
                let after = snap.after as usize;
                if after == 0 || after > seq.len {
                    return Err(BackendError::Invalid(format!(
                        "snapshot after {after} tokens of a {}-token chunk",
                        seq.len
                    )));
                }
                let sbase = state.base(snap.slot)?;
                state.data[sbase + c * hist..sbase + (c + 1) * hist]
                    .copy_from_slice(&window[after..after + hist]);
            }
            state.data[base + c * hist..base + (c + 1) * hist]
                .copy_from_slice(&window[seq.len..seq.len + hist]);
        }
    }
    Ok(())
}

#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// One head's inputs over `len` tokens: `x` `[len, p]`, `b`/`c` `[len, n]`, `dt` `[len]`,
/// the head's decay `a` and skip `d`.
pub struct HeadSeq<'a> {
    pub x: &'a [f32],
    pub b: &'a [f32],
    pub c: &'a [f32],
    pub dt: &'a [f32],
    pub a: f32,
    pub d: f32,
    pub p: usize,
    pub n: usize,
}

/// One head's recurrence over `len` tokens: `S ← exp(dt·a)·S + dt·x⊗B`, `y = S·C + d·x`;
/// `state` `[p, n]`, `y` `[len, p]`.
pub fn ssm_recurrent_head(seq: &HeadSeq<'_>, state: &mut [f32], y: &mut [f32]) {
    let HeadSeq {
        x,
        b,
        c,
        dt,
        a,
        d,
        p,
        n,
    } = *seq;
    for t in 0..dt.len() {
        let decay = (dt[t] * a).exp();
        let (xt, bt, ct) = (
            &x[t * p..(t + 1) * p],
            &b[t * n..(t + 1) * n],
            &c[t * n..(t + 1) * n],
        );
        for pi in 0..p {
            let row = &mut state[pi * n..(pi + 1) * n];
            let dx = dt[t] * xt[pi];
            let mut acc = 0.0f32;
            for ni in 0..n {
                row[ni] = row[ni] * decay + dx * bt[ni];
                acc += row[ni] * ct[ni];
            }
            y[t * p + pi] = acc + d * xt[pi];
        }
    }
}

/// The same result as [`ssm_recurrent_head`], computed chunk by chunk in the SSD form:
/// within a chunk `y_l = exp(A_l)·C_l·S + Σ_{s≤l} exp(A_l − A_s)·dt_s·(C_l·B_s)·x_s + d·x_l`
/// (A = cumulative `dt·a`), and the state is carried from chunk to chunk.
pub fn ssm_chunked_head(seq: &HeadSeq<'_>, chunk: usize, state: &mut [f32], y: &mut [f32]) {
    let HeadSeq {
        x,
        b,
        c,
        dt,
        a,
        d,
        p,
        n,
    } = *seq;
    let len = dt.len();
    let chunk = chunk.max(1);
    let mut acum = vec![0.0f32; chunk];
    let mut cb = vec![0.0f32; chunk];
    let mut start = 0;
    while start < len {
        let end = (start + chunk).min(len);
        let l_len = end - start;
        let mut run = 0.0f32;
        for l in 0..l_len {
            run += dt[start + l] * a;
            acum[l] = run;
        }
        for l in 0..l_len {
            let t = start + l;
            let ct = &c[t * n..(t + 1) * n];
            // Scores C_l·B_s for s ≤ l, weighted by decay and dt_s.
            for s in 0..=l {
                let bs = &b[(start + s) * n..(start + s + 1) * n];
                let dot: f32 = ct.iter().zip(bs).map(|(u, v)| u * v).sum();
                cb[s] = dot * (acum[l] - acum[s]).exp() * dt[start + s];
            }
            let decay_in = acum[l].exp();
            for pi in 0..p {
                let srow = &state[pi * n..(pi + 1) * n];
                let from_state: f32 = srow.iter().zip(ct).map(|(u, v)| u * v).sum();
                let mut acc = decay_in * from_state;
                for s in 0..=l {
                    acc += cb[s] * x[(start + s) * p + pi];
                }
                y[t * p + pi] = acc + d * x[t * p + pi];
            }
        }
        // Carry the state to the end of the chunk.
        let last = acum[l_len - 1];
        let total = last.exp();
        for v in state.iter_mut() {
            *v *= total;
        }
        for (s, &a) in acum.iter().enumerate().take(l_len) {
            let t = start + s;
            let w = (last - a).exp() * dt[t];
            let bs = &b[t * n..(t + 1) * n];
            for pi in 0..p {
                let wx = w * x[t * p + pi];
                let row = &mut state[pi * n..(pi + 1) * n];
                for (r, bv) in row.iter_mut().zip(bs) {
                    *r += wx * bv;
                }
            }
        }
        start = end;
    }
}

/// One head's scan over one chunk: its output rows, its final state and the state at each
/// segment end (for snapshots).
struct HeadResult {
    y: Vec<f32>,
    state: Vec<f32>,
    snaps: Vec<Vec<f32>>,
}

/// Per-head inputs for one sequence chunk, gathered into contiguous arrays.
struct HeadInputs {
    x: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    dt: Vec<f32>,
}

/// The selective scan of every chunk of `plan` from and into `state` (snapshots where the plan
/// asks), writing `out` like `x`.
pub(super) fn ssm_scan(
    inputs: &SsmOperands<'_, CpuTensor>,
    shape: SsmShape,
    state: LayerState<'_>,
    plan: &StepPlan,
    out: &mut CpuTensor,
) -> Result<()> {
    let SsmShape {
        heads,
        head_dim: p,
        groups,
        state_size: n,
        chunk_size,
        ..
    } = shape;
    let SsmOperands { x, a_log, d, .. } = *inputs;
    let xcols = x.rows_cols().1;
    check_scan(inputs, shape, &state, out)?;
    let heads_per_group = heads / groups;
    let head_state = p * n;
    let y = &mut out.data;
    for (si, seq) in plan.seqs.iter().enumerate() {
        let live_base = state.base(seq.ssm_slot)?;
        let snap_targets = plan.snapshots_of(si);
        let ends = segment_ends(seq.len, snap_targets)?;
        let mut snap_bases = Vec::with_capacity(snap_targets.len());
        for snap in snap_targets {
            snap_bases.push(state.base(snap.slot)?);
        }
        let live = &state.data[live_base..live_base + heads * head_state];
        // Each head runs independently; results are written back below.
        let results: Vec<HeadResult> = (0..heads)
            .into_par_iter()
            .map(|h| {
                let g = h / heads_per_group;
                let inp = gather_head(inputs, &shape, seq, (h, g));
                let a = -a_log.data[h].exp();
                let dh = d.data[h];
                let s = live[h * head_state..(h + 1) * head_state].to_vec();
                scan_segments(&inp, (a, dh), (p, n, chunk_size), s, seq.len, &ends)
            })
            .collect();
        for (h, r) in results.into_iter().enumerate() {
            let HeadResult {
                y: yh,
                state: s,
                snaps,
            } = r;
            for i in 0..seq.len {
                let row = (seq.offset + i) * xcols + h * p;
                y[row..row + p].copy_from_slice(&yh[i * p..(i + 1) * p]);
            }
            for (snap, &sbase) in snap_targets.iter().zip(&snap_bases) {
                let idx = ends
                    .iter()
                    .position(|&e| e == snap.after as usize)
                    .unwrap_or(0);
                let dst = sbase + h * head_state;
                state.data[dst..dst + head_state].copy_from_slice(&snaps[idx]);
            }
            let dst = live_base + h * head_state;
            state.data[dst..dst + head_state].copy_from_slice(&s);
        }
    }
    Ok(())
}

/// Checks the scan's inputs against each other, the shape, the state and the output.
fn check_scan(
    inputs: &SsmOperands<'_, CpuTensor>,
    shape: SsmShape,
    state: &LayerState<'_>,
    out: &CpuTensor,
) -> Result<()> {
    let SsmShape {
        heads,
        head_dim: p,
        groups,
        state_size: n,
        ..
    } = shape;
    let SsmOperands { x, b, c, dt, .. } = *inputs;
    let (rows, xcols) = x.rows_cols();
    let bc_cols = groups * n;
    if xcols != heads * p
        || b.rows_cols() != (rows, bc_cols)
        || c.rows_cols() != (rows, bc_cols)
        || dt.rows_cols() != (rows, heads)
        || groups == 0
        || heads % groups != 0
        || state.per != heads * p * n
        || out.data.len() != rows * xcols
    {
        return Err(BackendError::Invalid(format!(
            "ssm_scan: x {:?} b {:?} c {:?} dt {:?} state of {} values for {shape:?}",
            x.shape, b.shape, c.shape, dt.shape, state.per
        )));
    }
    Ok(())
}

/// One head's scan over one sequence chunk from state `s`: each segment (cut at `ends`) in
/// the recurrent form when it is one token, the chunked form otherwise, keeping the state
/// after each segment (for snapshots). `a` is the head's decay, `dh` its skip; `p` the head
/// dim, `n` the state size.
fn scan_segments(
    inp: &HeadInputs,
    (a, dh): (f32, f32),
    (p, n, chunk_size): (usize, usize, usize),
    mut s: Vec<f32>,
    len: usize,
    ends: &[usize],
) -> HeadResult {
    let mut yh = vec![0.0f32; len * p];
    let mut snaps = Vec::with_capacity(ends.len());
    let mut from = 0;
    for &to in ends {
        let seq = HeadSeq {
            x: &inp.x[from * p..to * p],
            b: &inp.b[from * n..to * n],
            c: &inp.c[from * n..to * n],
            dt: &inp.dt[from..to],
            a,
            d: dh,
            p,
            n,
        };
        let ys = &mut yh[from * p..to * p];
        if to - from == 1 {
            ssm_recurrent_head(&seq, &mut s, ys);
        } else {
            ssm_chunked_head(&seq, chunk_size, &mut s, ys);
        }
        snaps.push(s.clone());
        from = to;
    }
    HeadResult {
        y: yh,
        state: s,
        snaps,
    }
}

/// Head `h`'s (of group `g`) inputs for one sequence chunk, `dt` biased, softplus-ed and
/// clamped.
fn gather_head(
    inputs: &SsmOperands<'_, CpuTensor>,
    shape: &SsmShape,
    seq: &SeqChunk,
    (h, g): (usize, usize),
) -> HeadInputs {
    let SsmOperands {
        x,
        b,
        c,
        dt,
        dt_bias,
        ..
    } = *inputs;
    let SsmShape {
        heads,
        head_dim: p,
        groups,
        state_size: n,
        dt_min,
        dt_max,
        ..
    } = *shape;
    let xcols = heads * p;
    let bc_cols = groups * n;
    let mut out = HeadInputs {
        x: Vec::with_capacity(seq.len * p),
        b: Vec::with_capacity(seq.len * n),
        c: Vec::with_capacity(seq.len * n),
        dt: Vec::with_capacity(seq.len),
    };
    for i in 0..seq.len {
        let r = seq.offset + i;
        out.x
            .extend_from_slice(&x.data[r * xcols + h * p..r * xcols + (h + 1) * p]);
        out.b
            .extend_from_slice(&b.data[r * bc_cols + g * n..r * bc_cols + (g + 1) * n]);
        out.c
            .extend_from_slice(&c.data[r * bc_cols + g * n..r * bc_cols + (g + 1) * n]);
        let v = softplus(dt.data[r * heads + h] + dt_bias.data[h]);
        out.dt.push(v.clamp(dt_min, dt_max));
    }
    out
}

impl CpuBackend {
    pub(super) fn run_slot_ops(
        &self,
        pools: &mut SsmPools<CpuTensor>,
        step: &CpuStep,
    ) -> Result<()> {
        for pool in [&mut pools.conv, &mut pools.ssm] {
            let per = slot_elems(pool);
            let slots = pool.shape.first().copied().unwrap_or(0);
            for op in &step.plan.slot_ops {
                match *op {
                    SlotOp::Copy { from, to } => {
                        let (from, to) = (from as usize, to as usize);
                        if from >= slots || to >= slots {
                            return Err(BackendError::Invalid(format!(
                                "state slot {from} or {to} out of {slots}"
                            )));
                        }
                        if from != to {
                            pool.data
                                .copy_within(from * per..(from + 1) * per, to * per);
                        }
                    }
                    SlotOp::Zero { slot } => {
                        let slot = slot as usize;
                        if slot >= slots {
                            return Err(BackendError::Invalid(format!(
                                "state slot {slot} out of {slots}"
                            )));
                        }
                        pool.data[slot * per..(slot + 1) * per].fill(0.0);
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) fn conv_layer(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        bias: Option<&CpuTensor>,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        let mut out = self.tmp(&x.shape);
        let state = LayerState::new(&mut pools.conv, layer)?;
        causal_conv1d(x, weight, bias, state, &step.plan, &mut out)?;
        Ok(out)
    }

    pub(super) fn scan_layer(
        &self,
        x: &SsmOperands<'_, CpuTensor>,
        shape: SsmShape,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        let mut out = self.tmp(&x.x.shape);
        let state = LayerState::new(&mut pools.ssm, layer)?;
        ssm_scan(x, shape, state, &step.plan, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::backend::cpu::test_rng::lcg;

    #[test]
    fn chunked_scan_equals_recurrence() {
        let (p, n) = (8, 16);
        for &(len, chunk) in &[(1usize, 4usize), (7, 4), (33, 8), (100, 16), (101, 256)] {
            let mut seed = len as u64 * 31 + chunk as u64;
            let x: Vec<f32> = (0..len * p).map(|_| lcg(&mut seed)).collect();
            let b: Vec<f32> = (0..len * n).map(|_| lcg(&mut seed)).collect();
            let c: Vec<f32> = (0..len * n).map(|_| lcg(&mut seed)).collect();
            let dt: Vec<f32> = (0..len).map(|_| softplus(lcg(&mut seed) * 4.0)).collect();
            let init: Vec<f32> = (0..p * n).map(|_| lcg(&mut seed)).collect();
            let (a, d) = (-0.7, 0.3);
            let (mut s1, mut s2) = (init.clone(), init);
            let (mut y1, mut y2) = (vec![0.0; len * p], vec![0.0; len * p]);
            let seq = HeadSeq {
                x: &x,
                b: &b,
                c: &c,
                dt: &dt,
                a,
                d,
                p,
                n,
            };
            ssm_recurrent_head(&seq, &mut s1, &mut y1);
            ssm_chunked_head(&seq, chunk, &mut s2, &mut y2);
            let dy = y1
                .iter()
                .zip(&y2)
                .map(|(u, v)| (u - v).abs())
                .fold(0.0, f32::max);
            let ds = s1
                .iter()
                .zip(&s2)
                .map(|(u, v)| (u - v).abs())
                .fold(0.0, f32::max);
            assert!(
                dy < 1e-4 && ds < 1e-4,
                "len {len} chunk {chunk}: dy {dy} ds {ds}"
            );
        }
    }
}
