//! An f64 emulation of the kernels' maths over the plan's columns, against the CPU
//! reference's token-by-token recurrence.

use super::*;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) - 0.5
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

const H: usize = 2;
const P: usize = 3;
const N: usize = 4;
const G: usize = 1;
const CH: usize = 5;
const K: usize = 4;

struct Inputs {
    x: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
    dt: Vec<f64>,
    a: [f64; H],
    d: [f64; H],
    cx: Vec<f64>,
    w: Vec<f64>,
}

fn softplus(v: f64) -> f64 {
    if v > 20.0 { v } else { v.exp().ln_1p() }
}

fn inputs(tokens: usize, seed: u64) -> Inputs {
    let mut r = Lcg(seed);
    Inputs {
        x: r.vec(tokens * H * P, 2.0),
        b: r.vec(tokens * G * N, 2.0),
        c: r.vec(tokens * G * N, 2.0),
        dt: r.vec(tokens * H, 4.0).into_iter().map(softplus).collect(),
        a: [-0.7, -0.2],
        d: [0.3, -0.5],
        cx: r.vec(tokens * CH, 2.0),
        w: r.vec(CH * K, 1.0),
    }
}

type Pools = HashMap<u32, Vec<f64>>;

/// The CPU reference's semantics, token by token: for each chunk, the recurrence from its
/// live state, snapshots after `after` tokens; conv likewise.
fn reference(
    lens: &[u32],
    snaps: &[Snapshot],
    inp: &Inputs,
    ssm0: &Pools,
    conv0: &Pools,
) -> (Vec<f64>, Vec<f64>, Pools, Pools) {
    let cu = cu_of(lens);
    let tokens = *cu.last().unwrap_or(&0) as usize;
    let (mut y, mut co) = (vec![0.0; tokens * H * P], vec![0.0; tokens * CH]);
    let (mut ssm, mut conv) = (ssm0.clone(), conv0.clone());
    for (s, &len) in lens.iter().enumerate() {
        let slot = 100 + s as u32;
        let mut st = ssm0[&slot].clone();
        let mut win: Vec<f64> = conv0[&slot].clone(); // [CH][K-1]
        let t0 = cu[s] as usize;
        for i in 0..len as usize {
            let t = t0 + i;
            for h in 0..H {
                let decay = (inp.dt[t * H + h] * inp.a[h]).exp();
                for q in 0..P {
                    let xv = inp.x[(t * H + h) * P + q];
                    let mut acc = 0.0;
                    for n in 0..N {
                        let v = &mut st[(h * P + q) * N + n];
                        *v = *v * decay + inp.dt[t * H + h] * xv * inp.b[t * G * N + n];
                        acc += *v * inp.c[t * G * N + n];
                    }
                    y[(t * H + h) * P + q] = acc + inp.d[h] * xv;
                }
            }
            for ch in 0..CH {
                let hist = &mut win[ch * (K - 1)..(ch + 1) * (K - 1)];
                let xin = inp.cx[t * CH + ch];
                let mut acc = 0.0;
                for (j, wj) in inp.w[ch * K..(ch + 1) * K].iter().enumerate() {
                    acc += wj * if j < K - 1 { hist[j] } else { xin };
                }
                co[t * CH + ch] = acc / (1.0 + (-acc).exp());
                hist.rotate_left(1);
                hist[K - 2] = xin;
            }
            for sn in snaps
                .iter()
                .filter(|sn| sn.seq as usize == s && sn.after as usize == i + 1)
            {
                ssm.insert(sn.slot, st.clone());
                conv.insert(sn.slot, win.clone());
            }
        }
        ssm.insert(slot, st);
        conv.insert(slot, win);
    }
    (y, co, ssm, conv)
}

/// The kernels' maths (the ssm/*.cu files) over the plan's columns, in f64, step by step.
fn emulate(
    p: &SsmPlan,
    inp: &Inputs,
    ssm0: &Pools,
    conv0: &Pools,
) -> (Vec<f64>, Vec<f64>, Pools, Pools) {
    let col = |c: WorkCol, i: usize| p.column(c)[i] as usize;
    let tokens = p.tokens() as usize;
    let (mut y, mut co) = (vec![f64::NAN; tokens * H * P], vec![f64::NAN; tokens * CH]);
    let (mut ssm, mut conv) = (ssm0.clone(), conv0.clone());
    // Conv, chunks: windows from x, or the (old) live state before the sequence start.
    let conv_in = |e: usize, q: isize, ch: usize| -> f64 {
        if q >= 0 {
            inp.cx[(col(WorkCol::SeqTok, e) + q as usize) * CH + ch]
        } else {
            conv0[&p.column(WorkCol::SeqSlot)[e]][ch * (K - 1) + (K as isize - 1 + q) as usize]
        }
    };
    let silu = |v: f64| v / (1.0 + (-v).exp());
    for ck in 0..p.chunks() {
        let e = col(WorkCol::CkSeq, ck);
        let q0 = (col(WorkCol::CkTok, ck) - col(WorkCol::SeqTok, e)) as isize;
        let len = col(WorkCol::CkLen, ck) as isize;
        for ch in 0..CH {
            for r in 0..len {
                let acc: f64 = (0..K)
                    .map(|j| {
                        inp.w[ch * K + j] * conv_in(e, q0 + r - (K as isize - 1) + j as isize, ch)
                    })
                    .sum();
                co[(col(WorkCol::CkTok, ck) + r as usize) * CH + ch] = silu(acc);
            }
            for k in col(WorkCol::CkSnap, ck)..col(WorkCol::CkSnap, ck) + col(WorkCol::CkSnaps, ck)
            {
                let dst = conv
                    .entry(p.column(WorkCol::SnapSlot)[k])
                    .or_insert_with(|| vec![f64::NAN; CH * (K - 1)]);
                for j in 0..K - 1 {
                    dst[ch * (K - 1) + j] =
                        conv_in(e, q0 + len - (K as isize - 1) + j as isize, ch);
                }
            }
        }
    }
    // Conv, update.
    for e in 0..p.seqs() {
        let slot = p.column(WorkCol::SeqSlot)[e];
        let len = col(WorkCol::SeqLen, e) as isize;
        let mut nw = vec![0.0; CH * (K - 1)];
        for ch in 0..CH {
            for j in 0..K - 1 {
                nw[ch * (K - 1) + j] = conv_in(e, len - (K as isize - 1) + j as isize, ch);
            }
            if e < p.decodes() {
                let acc: f64 = (0..K)
                    .map(|j| inp.w[ch * K + j] * conv_in(e, j as isize - (K as isize - 1), ch))
                    .sum();
                co[col(WorkCol::SeqTok, e) * CH + ch] = silu(acc);
            }
        }
        if e < p.decodes() {
            for k in col(WorkCol::SeqSnap, e)..col(WorkCol::SeqSnap, e) + col(WorkCol::SeqSnaps, e)
            {
                conv.insert(p.column(WorkCol::SnapSlot)[k], nw.clone());
            }
        }
        conv.insert(slot, nw);
    }
    // Scan, decodes: the recurrent step.
    for e in 0..p.decodes() {
        let slot = p.column(WorkCol::SeqSlot)[e];
        let t = col(WorkCol::SeqTok, e);
        let mut st = ssm0[&slot].clone();
        for h in 0..H {
            let decay = (inp.dt[t * H + h] * inp.a[h]).exp();
            for q in 0..P {
                let xv = inp.x[(t * H + h) * P + q];
                let mut acc = 0.0;
                for n in 0..N {
                    let v = &mut st[(h * P + q) * N + n];
                    *v = *v * decay + inp.dt[t * H + h] * xv * inp.b[t * G * N + n];
                    acc += *v * inp.c[t * G * N + n];
                }
                y[(t * H + h) * P + q] = acc + inp.d[h] * xv;
            }
        }
        for k in col(WorkCol::SeqSnap, e)..col(WorkCol::SeqSnap, e) + col(WorkCol::SeqSnaps, e) {
            ssm.insert(p.column(WorkCol::SnapSlot)[k], st.clone());
        }
        ssm.insert(slot, st);
    }
    // SSD: dt/cumsum, chunk states, passing, chunk scan.
    let mut acum = vec![0.0; tokens * H];
    let mut states = vec![0.0; p.chunks() * H * P * N];
    for ck in 0..p.chunks() {
        let (t0, len) = (col(WorkCol::CkTok, ck), col(WorkCol::CkLen, ck));
        for h in 0..H {
            let mut run = 0.0;
            for t in t0..t0 + len {
                run += inp.dt[t * H + h] * inp.a[h];
                acum[t * H + h] = run;
            }
            let a_end = acum[(t0 + len - 1) * H + h];
            for q in 0..P {
                for n in 0..N {
                    states[((ck * H + h) * P + q) * N + n] = (t0..t0 + len)
                        .map(|t| {
                            (a_end - acum[t * H + h]).exp()
                                * inp.dt[t * H + h]
                                * inp.x[(t * H + h) * P + q]
                                * inp.b[t * G * N + n]
                        })
                        .sum();
                }
            }
        }
    }
    for e in p.decodes()..p.seqs() {
        let slot = p.column(WorkCol::SeqSlot)[e];
        let mut hv = ssm0[&slot].clone();
        for ck in col(WorkCol::SeqChunk, e)..col(WorkCol::SeqChunk, e) + col(WorkCol::SeqChunks, e)
        {
            let end = col(WorkCol::CkTok, ck) + col(WorkCol::CkLen, ck) - 1;
            for h in 0..H {
                let decay = acum[end * H + h].exp();
                for i in 0..P * N {
                    let sp = &mut states[(ck * H + h) * P * N + i];
                    let s = *sp;
                    *sp = hv[h * P * N + i];
                    hv[h * P * N + i] = decay * hv[h * P * N + i] + s;
                }
            }
            for k in col(WorkCol::CkSnap, ck)..col(WorkCol::CkSnap, ck) + col(WorkCol::CkSnaps, ck)
            {
                ssm.insert(p.column(WorkCol::SnapSlot)[k], hv.clone());
            }
        }
        ssm.insert(slot, hv);
    }
    for ck in 0..p.chunks() {
        let (t0, len) = (col(WorkCol::CkTok, ck), col(WorkCol::CkLen, ck));
        for h in 0..H {
            for l in t0..t0 + len {
                for q in 0..P {
                    let hc =
                        &states[(ck * H + h) * P * N + q * N..(ck * H + h) * P * N + (q + 1) * N];
                    let from_state: f64 = (0..N).map(|n| inp.c[l * G * N + n] * hc[n]).sum();
                    let mut acc = acum[l * H + h].exp() * from_state;
                    for s in t0..=l {
                        let cb: f64 = (0..N)
                            .map(|n| inp.c[l * G * N + n] * inp.b[s * G * N + n])
                            .sum();
                        acc += cb
                            * (acum[l * H + h] - acum[s * H + h]).exp()
                            * inp.dt[s * H + h]
                            * inp.x[(s * H + h) * P + q];
                    }
                    y[(l * H + h) * P + q] = acc + inp.d[h] * inp.x[(l * H + h) * P + q];
                }
            }
        }
    }
    (y, co, ssm, conv)
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-9 * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// The plan's columns drive the kernels' maths to the CPU reference's results: outputs,
/// live states, and every snapshot equal to the state after `after` tokens.
pub(super) fn check_maths(lens: &[u32], snaps: &[Snapshot], chunk: u32, seed: u64) {
    let (_, p) = build(lens, snaps, chunk);
    let inp = inputs(p.tokens() as usize, seed);
    let mut r = Lcg(seed ^ 0x5eed);
    let (mut ssm0, mut conv0) = (Pools::new(), Pools::new());
    for s in 0..lens.len() as u32 {
        ssm0.insert(100 + s, r.vec(H * P * N, 1.0));
        conv0.insert(100 + s, r.vec(CH * (K - 1), 1.0));
    }
    let (y0, c0, s0, v0) = reference(lens, snaps, &inp, &ssm0, &conv0);
    let (y1, c1, s1, v1) = emulate(&p, &inp, &ssm0, &conv0);
    assert_close("y", &y1, &y0);
    assert_close("conv out", &c1, &c0);
    let mut slots: Vec<u32> = s0.keys().copied().collect();
    slots.sort_unstable();
    let mut slots1: Vec<u32> = s1.keys().copied().collect();
    slots1.sort_unstable();
    assert_eq!(slots, slots1);
    for s in slots {
        assert_close(&format!("ssm slot {s}"), &s1[&s], &s0[&s]);
        assert_close(&format!("conv slot {s}"), &v1[&s], &v0[&s]);
    }
}
