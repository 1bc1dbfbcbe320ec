//! Tests of the SSM planner and launches: the plan against the CPU reference's cuts, a
//! replay of every kernel's grid decomposition (each output, live state and snapshot written
//! once), an f64 emulation of the kernels' maths over the plan against the token-by-token
//! recurrence, slot-op waves, the PTX ABI, and the GPU harness's case dump.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn cu_of(lens: &[u32]) -> Vec<u32> {
    let mut cu = vec![0];
    for &l in lens {
        cu.push(cu.last().copied().unwrap_or(0) + l);
    }
    cu
}

fn snap(seq: u32, after: u32, slot: u32) -> Snapshot {
    Snapshot { seq, after, slot }
}

/// Live slot of chunk i: 100 + i (snapshot slots are below 100).
fn build(lens: &[u32], snaps: &[Snapshot], chunk: u32) -> (Vec<u32>, SsmPlan) {
    let cu = cu_of(lens);
    let slots: Vec<u32> = (0..lens.len() as u32).map(|i| 100 + i).collect();
    let mut p = SsmPlan::new();
    plan(
        SsmStepInputs {
            cu_seqlens: &cu,
            slots: &slots,
            snapshots: snaps,
            slot_ops: &[],
            chunk_size: chunk,
        },
        &mut p,
    )
    .expect("valid plan");
    (cu, p)
}

/// The CPU reference's cuts of one chunk: segment ends at the snapshot offsets, then
/// `chunk`-token pieces from each segment start (host backend/cpu/ssm.rs).
fn cpu_pieces(len: u32, afters: &[u32], chunk: u32) -> Vec<(u32, u32)> {
    let mut ends: Vec<u32> = afters.to_vec();
    ends.push(len);
    ends.sort_unstable();
    ends.dedup();
    let mut out = Vec::new();
    let mut from = 0;
    for e in ends {
        while from < e {
            let to = (from + chunk).min(e);
            out.push((from, to));
            from = to;
        }
    }
    out
}

/// The plan's structure: token coverage, cuts, snapshot placement, column lengths.
fn check_plan(lens: &[u32], snaps: &[Snapshot], chunk: u32) -> SsmPlan {
    let (cu, p) = build(lens, snaps, chunk);
    let col = |c: WorkCol| p.column(c);
    for c in &WorkCol::ALL[..7] {
        assert_eq!(col(*c).len(), p.seqs(), "{c:?}");
    }
    for c in &WorkCol::ALL[7..12] {
        assert_eq!(col(*c).len(), p.chunks(), "{c:?}");
    }
    assert_eq!(p.snapshots(), snaps.len());
    let tokens = *cu.last().unwrap_or(&0) as usize;
    let mut seen = vec![0u32; tokens];
    // (seq, after, slot) as the columns record them.
    let mut got: Vec<(u32, u32, u32)> = Vec::new();
    let chunk = chunk.clamp(1, MAX_CHUNK);
    let nonempty: Vec<usize> = (0..lens.len()).filter(|&s| lens[s] > 0).collect();
    let want_decodes: Vec<usize> = nonempty.iter().copied().filter(|&s| lens[s] == 1).collect();
    let want_prompts: Vec<usize> = nonempty.iter().copied().filter(|&s| lens[s] > 1).collect();
    assert_eq!(p.decodes(), want_decodes.len());
    assert_eq!(p.prompts(), want_prompts.len());
    for (e, &s) in want_decodes.iter().chain(&want_prompts).enumerate() {
        let tok = col(WorkCol::SeqTok)[e];
        assert_eq!(tok, cu[s], "entry {e} is chunk {s}");
        assert_eq!(col(WorkCol::SeqLen)[e], lens[s]);
        assert_eq!(col(WorkCol::SeqSlot)[e], 100 + s as u32);
        let (k0, nk) = (
            col(WorkCol::SeqSnap)[e] as usize,
            col(WorkCol::SeqSnaps)[e] as usize,
        );
        let afters: Vec<u32> = snaps
            .iter()
            .filter(|t| t.seq as usize == s)
            .map(|t| t.after)
            .collect();
        assert_eq!(nk, afters.len(), "entry {e}: its snapshots");
        if e < p.decodes() {
            seen[tok as usize] += 1;
            assert_eq!(col(WorkCol::SeqChunks)[e], 0);
            for k in k0..k0 + nk {
                got.push((s as u32, 1, col(WorkCol::SnapSlot)[k]));
            }
            continue;
        }
        let (c0, nc) = (
            col(WorkCol::SeqChunk)[e] as usize,
            col(WorkCol::SeqChunks)[e] as usize,
        );
        let pieces: Vec<(u32, u32)> = (c0..c0 + nc)
            .map(|c| {
                assert_eq!(col(WorkCol::CkSeq)[c] as usize, e);
                let from = col(WorkCol::CkTok)[c] - tok;
                (from, from + col(WorkCol::CkLen)[c])
            })
            .collect();
        assert_eq!(
            pieces,
            cpu_pieces(lens[s], &afters, chunk),
            "chunk {s} cuts"
        );
        for c in c0..c0 + nc {
            let (t0, l) = (col(WorkCol::CkTok)[c], col(WorkCol::CkLen)[c]);
            assert!(l >= 1 && l <= chunk);
            for t in t0..t0 + l {
                seen[t as usize] += 1;
            }
            let (a, n) = (
                col(WorkCol::CkSnap)[c] as usize,
                col(WorkCol::CkSnaps)[c] as usize,
            );
            assert!(
                a >= k0 && a + n <= k0 + nk,
                "chunk {c} snapshots inside its entry's"
            );
            for k in a..a + n {
                got.push((s as u32, t0 + l - tok, col(WorkCol::SnapSlot)[k]));
            }
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "every token once: {seen:?}");
    let mut want: Vec<(u32, u32, u32)> = snaps.iter().map(|t| (t.seq, t.after, t.slot)).collect();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "every snapshot at its offset, once");
    p
}

fn conv_dims(channels: u32, kernel: u32) -> ConvDims {
    ConvDims {
        channels,
        kernel,
        layer: 1,
        layers: 3,
        slots: 200,
        x_ld: channels,
        out_ld: channels,
    }
}

fn scan_dims(heads: u32, head_dim: u32, groups: u32, state: u32) -> ScanDims {
    ScanDims {
        layer: 1,
        layers: 3,
        slots: 200,
        ..ScanDims::packed(heads, head_dim, groups, state)
    }
}

fn u32_arg(l: &Launch<SsmArg>, i: usize) -> u32 {
    match l.args[i] {
        SsmArg::U32(v) => v,
        other => panic!("{}: argument {i} is {other:?}", l.entry),
    }
}

fn check_kinds(l: &Launch<SsmArg>) {
    let (_, entry) = crate::entry(l.entry).unwrap_or_else(|| panic!("{:?} undeclared", l.entry));
    let kinds: Vec<Param> = l.args.iter().map(SsmArg::param).collect();
    assert_eq!(kinds, entry.params, "{} arguments", l.entry);
    assert_eq!((l.grid.1, l.grid.2), (1, 1), "{}", l.entry);
    // Only the tensor-core kernels take dynamic shared memory: exactly their layout's size,
    // and the device raises the limit of every kernel launched above the default.
    let chunk_pass = |half: u32| 3 * (128 * 72 + 128 * (half + 8)) * 2 + (3 * 260 + 128 + 24) * 4;
    let group_scan =
        |ldn: u32| (128 * ldn + 2 * (128 * 72 + 64 * ldn + 512)) * 2 + 36 * 1024 + 36 * 512;
    let want = match l.entry {
        "ssd_scan_mma_p64n64_bf16" => (128 * 72 + 64 * 72 + 128 * 72 + 128 * 72) * 2 + 1536,
        "ssd_scan_mma_p64n128_bf16" => (128 * 136 + 64 * 136 + 128 * 136 + 128 * 72) * 2 + 1536,
        "ssd_chunk_pass_mma_p64n64_bf16" | "ssd_chunk_pass_mma_p64n64_bf16_sbf16" => chunk_pass(32),
        "ssd_chunk_pass_mma_p64n128_bf16" | "ssd_chunk_pass_mma_p64n128_bf16_sbf16" => {
            chunk_pass(64)
        }
        "ssd_scan_group_mma_p64n64_bf16" => group_scan(72),
        "ssd_scan_group_mma_p64n128_bf16" => group_scan(136),
        _ => 0,
    };
    assert_eq!(l.smem, want, "{} shared memory", l.entry);
    if l.smem > crate::attention::DEFAULT_SMEM_LIMIT {
        assert!(smem_opt_in().any(|(name, bytes)| name == l.entry && bytes >= l.smem));
    }
}

/// Replays the conv kernels' grid decomposition (ssm.cu conv_chunks, conv_update):
/// every (token, channel block) output written once, every live state once, every
/// snapshot once, and the prompt chunks before the update.
fn replay_conv(p: &SsmPlan, dims: ConvDims, bf16: bool) {
    let launches = launches_conv(p, dims, bf16).expect("conv shape");
    let col = |c: WorkCol, i: usize| p.column(c)[i] as usize;
    let mut out: HashMap<(usize, u32), u32> = HashMap::new();
    let mut live = vec![0u32; p.seqs()];
    let mut snaps = vec![0u32; p.snapshots()];
    let names: Vec<&str> = launches.iter().map(|l| l.entry).collect();
    let ty = suffix(bf16);
    let mut want = Vec::new();
    if p.chunks() > 0 {
        want.push(format!("ssm_conv_chunks_{ty}"));
    }
    if p.seqs() > 0 {
        want.push(format!("ssm_conv_update_{ty}"));
    }
    assert_eq!(names, want);
    for l in &launches {
        check_kinds(l);
        assert_eq!(l.block.0, CONV_THREADS);
        let ch_blocks = u32_arg(
            l,
            if l.args.len() == CONV_CHUNKS.len() {
                20
            } else {
                19
            },
        );
        let update = l.args.len() != CONV_CHUNKS.len();
        // Channels a thread covers (conv_update takes four of a 4-wide conv).
        let cpt = if update && dims.kernel == 4 && dims.channels.is_multiple_of(4) {
            4
        } else {
            1
        };
        assert!(ch_blocks * CONV_THREADS * cpt >= dims.channels);
        assert!(
            (ch_blocks - 1) * CONV_THREADS * cpt < dims.channels,
            "no idle block"
        );
        for bid in 0..l.grid.0 {
            let cb = bid % ch_blocks;
            let span = CONV_THREADS * cpt;
            let chans = cb * span..((cb + 1) * span).min(dims.channels);
            if l.args.len() == CONV_CHUNKS.len() {
                let row_blocks = u32_arg(l, 21);
                let rest = bid / ch_blocks;
                let (rb, ck) = ((rest % row_blocks) as usize, (rest / row_blocks) as usize);
                let len = col(WorkCol::CkLen, ck);
                let r0 = rb * CONV_ROWS as usize;
                if r0 >= len {
                    continue;
                }
                let r1 = len.min(r0 + CONV_ROWS as usize);
                for r in r0..r1 {
                    for c in chans.clone() {
                        *out.entry((col(WorkCol::CkTok, ck) + r, c)).or_default() += 1;
                    }
                }
                if r1 == len && cb == 0 {
                    let k0 = col(WorkCol::CkSnap, ck);
                    for n in &mut snaps[k0..k0 + col(WorkCol::CkSnaps, ck)] {
                        *n += 1;
                    }
                }
            } else {
                let e = (bid / ch_blocks) as usize;
                if e < p.decodes() {
                    for c in chans.clone() {
                        *out.entry((col(WorkCol::SeqTok, e), c)).or_default() += 1;
                    }
                    if cb == 0 {
                        let k0 = col(WorkCol::SeqSnap, e);
                        for n in &mut snaps[k0..k0 + col(WorkCol::SeqSnaps, e)] {
                            *n += 1;
                        }
                    }
                }
                if cb == 0 {
                    live[e] += 1;
                }
            }
        }
    }
    assert_eq!(
        out.len(),
        p.tokens() as usize * dims.channels as usize,
        "conv rows covered"
    );
    assert!(out.values().all(|&n| n == 1), "conv rows written once");
    assert!(live.iter().all(|&n| n == 1), "live conv states once");
    assert!(
        snaps.iter().all(|&n| n == 1),
        "conv snapshots once: {snaps:?}"
    );
}

/// Replays the scan kernels' grid decomposition: (token, head) outputs once; chunk
/// states and dt rows once; live states and snapshots once per (entry or slot, head,
/// element).
fn replay_scan(p: &SsmPlan, dims: ScanDims, bf16: bool) {
    let launches = launches_scan(p, dims, bf16).expect("scan shape");
    let col = |c: WorkCol, i: usize| p.column(c)[i] as usize;
    let heads = dims.heads as usize;
    let (pd, nd) = (dims.head_dim as usize, dims.state as usize);
    let pn = pd * nd;
    let mut out: HashMap<(usize, usize, usize), u32> = HashMap::new();
    let mut dt_rows: HashMap<(usize, usize), u32> = HashMap::new();
    // Element counts per (chunk, head), (entry, head), (snapshot, head): each must reach
    // pn, from distinct tiles.
    let mut states = vec![0usize; p.chunks() * heads];
    let mut live = vec![0usize; p.seqs() * heads];
    let mut snaps = vec![0usize; p.snapshots() * heads];
    let mut tiles_seen: HashMap<(&str, usize, usize, usize), u32> = HashMap::new();
    let mma = dims.mma(bf16);
    let mut order = Vec::new();
    for l in &launches {
        check_kinds(l);
        let name = l.entry;
        if name.starts_with("ssm_decode") {
            order.push("decode");
            assert_eq!(l.block.0, DEC_THREADS);
            // CTA (entry, head, slice of `slice_rows` rows of p).
            let rows = u32_arg(l, 25) as usize;
            assert!(rows >= 1);
            let slices = pd.div_ceil(rows);
            for bid in 0..l.grid.0 as usize {
                let (slice, r) = (bid % slices, bid / slices);
                let (h, e) = (r % heads, r / heads);
                assert!(e < p.decodes());
                let (p0, p1) = (slice * rows, ((slice + 1) * rows).min(pd));
                for q in p0..p1 {
                    *out.entry((col(WorkCol::SeqTok, e), h, q)).or_default() += 1;
                }
                let elems = (p1 - p0) * (pn / pd);
                live[e * heads + h] += elems;
                let k0 = col(WorkCol::SeqSnap, e);
                for k in k0..k0 + col(WorkCol::SeqSnaps, e) {
                    snaps[k * heads + h] += elems;
                }
            }
        } else if name.starts_with("ssd_dt") {
            order.push("dt");
            let hb = u32_arg(l, 11) as usize;
            assert_eq!(u32_arg(l, 12), rec_rows(p));
            assert!(rec_rows(p) >= p.chunk_size() && rec_rows(p).is_multiple_of(4));
            for bid in 0..l.grid.0 as usize {
                let (ck, h0) = (bid / hb, (bid % hb) * DT_HEADS as usize);
                for h in h0..(h0 + DT_HEADS as usize).min(heads) {
                    for r in 0..col(WorkCol::CkLen, ck) {
                        *dt_rows.entry((col(WorkCol::CkTok, ck) + r, h)).or_default() += 1;
                    }
                }
            }
        } else if name.starts_with("ssd_states") {
            order.push("states");
            assert!(mma.is_none(), "{name}");
            let (pt_n, nt_n) = (u32_arg(l, 13) as usize, u32_arg(l, 14) as usize);
            let (tm, tn) = (32, 64);
            for bid in 0..l.grid.0 as usize {
                let h = bid % heads;
                let r = bid / heads;
                let nt = r % nt_n;
                let r = r / nt_n;
                let (pt, ck) = (r % pt_n, r / pt_n);
                let rows = (pt * tm + tm).min(pd).saturating_sub(pt * tm);
                let cols = (nt * tn + tn).min(nd).saturating_sub(nt * tn);
                states[ck * heads + h] += rows * cols;
                *tiles_seen
                    .entry(("states", ck, h, pt * nt_n + nt))
                    .or_default() += 1;
            }
        } else if name.starts_with("ssd_chunk_pass") {
            // CTA (prompt entry, head, half of the state columns): the entering state of
            // each of the entry's chunks, its snapshots and its live state, half each.
            order.push("chunk_pass");
            assert!(mma.is_some(), "{name}");
            assert_eq!(name.ends_with("_sbf16"), dims.state_bf16, "{name}");
            let base = u32_arg(l, 14) as usize;
            assert_eq!(base, p.decodes());
            let split = CHUNK_PASS_SPLIT as usize;
            let elems = pn / split;
            for bid in 0..l.grid.0 as usize {
                let half = bid % split;
                let r = bid / split;
                let (h, e) = (r % heads, base + r / heads);
                assert!(e < p.seqs());
                *tiles_seen.entry(("chunk_pass", e, h, half)).or_default() += 1;
                live[e * heads + h] += elems;
                let c0 = col(WorkCol::SeqChunk, e);
                for c in c0..c0 + col(WorkCol::SeqChunks, e) {
                    assert_eq!(col(WorkCol::CkSeq, c), e);
                    states[c * heads + h] += elems;
                    let k0 = col(WorkCol::CkSnap, c);
                    for k in k0..k0 + col(WorkCol::CkSnaps, c) {
                        snaps[k * heads + h] += elems;
                    }
                }
            }
        } else if name.starts_with("ssd_scan_group") {
            // CTA (chunk, group, block of head_block heads of the group): every row of the
            // chunk (at most 128), every column, for each of its heads.
            order.push("scan");
            assert!(mma.is_some(), "{name}");
            assert!(p.chunk_size() <= SCAN_ROWS);
            let groups = dims.groups as usize;
            let per_group = heads / groups;
            let (hb, hbs) = (u32_arg(l, 15) as usize, u32_arg(l, 16) as usize);
            assert!(hb >= 1 && hbs == per_group.div_ceil(hb));
            for bid in 0..l.grid.0 as usize {
                let blk = bid % hbs;
                let r = bid / hbs;
                let (g, ck) = (r % groups, r / groups);
                let len = col(WorkCol::CkLen, ck);
                assert!(len <= SCAN_ROWS as usize);
                for h in (g * per_group + blk * hb..g * per_group + (blk + 1) * hb)
                    .filter(|&h| h < (g + 1) * per_group)
                {
                    for i in 0..len {
                        for q in 0..pd {
                            *out.entry((col(WorkCol::CkTok, ck) + i, h, q)).or_default() += 1;
                        }
                    }
                }
            }
        } else if name == "ssd_pass" || name == "ssd_pass_sbf16" {
            order.push("pass");
            assert!(mma.is_none(), "{name}");
            assert_eq!(name.ends_with("_sbf16"), dims.state_bf16, "{name}");
            let base = u32_arg(l, 11) as usize;
            assert_eq!(base, p.decodes());
            let tiles = u32_arg(l, 17) as usize;
            let per_tile = (PASS_THREADS * PASS_PER) as usize;
            for bid in 0..l.grid.0 as usize {
                let h = bid % heads;
                let r = bid / heads;
                let (tile, e) = (r % tiles, base + r / tiles);
                let c0 = col(WorkCol::SeqChunk, e);
                let elems = ((tile + 1) * per_tile)
                    .min(pn)
                    .saturating_sub(tile * per_tile);
                *tiles_seen.entry(("pass", e, h, tile)).or_default() += 1;
                live[e * heads + h] += elems;
                for c in c0..c0 + col(WorkCol::SeqChunks, e) {
                    let k0 = col(WorkCol::CkSnap, c);
                    for k in k0..k0 + col(WorkCol::CkSnaps, c) {
                        snaps[k * heads + h] += elems;
                    }
                }
            }
        } else if name.starts_with("ssd_scan") {
            order.push("scan");
            assert_eq!(name.contains("_mma_"), mma.is_some(), "{name}");
            let (lt_n, pt_n) = (u32_arg(l, 17) as usize, u32_arg(l, 18) as usize);
            let (tl, tp) = if mma.is_some() {
                (SCAN_ROWS as usize, pd)
            } else {
                (SIMT_TM as usize, SIMT_TN as usize)
            };
            for bid in 0..l.grid.0 as usize {
                let h = bid % heads;
                let r = bid / heads;
                let pt = r % pt_n;
                let r = r / pt_n;
                let (lt, ck) = (r % lt_n, r / lt_n);
                let len = col(WorkCol::CkLen, ck);
                for i in lt * tl..(lt * tl + tl).min(len) {
                    for q in pt * tp..(pt * tp + tp).min(pd) {
                        *out.entry((col(WorkCol::CkTok, ck) + i, h, q)).or_default() += 1;
                    }
                }
            }
        } else {
            panic!("unexpected launch {name}");
        }
    }
    let mut want = Vec::new();
    if p.decodes() > 0 {
        want.push("decode");
    }
    if p.chunks() > 0 && mma.is_some() {
        want.extend(["dt", "chunk_pass", "scan"]);
    } else if p.chunks() > 0 {
        want.extend(["dt", "states", "pass", "scan"]);
    }
    assert_eq!(order, want);
    assert_eq!(
        out.len(),
        p.tokens() as usize * heads * pd,
        "outputs covered"
    );
    assert!(out.values().all(|&n| n == 1), "outputs written once");
    let prompt_tokens: usize = (0..p.chunks()).map(|c| col(WorkCol::CkLen, c)).sum();
    assert_eq!(dt_rows.len(), prompt_tokens * heads);
    assert!(dt_rows.values().all(|&n| n == 1));
    assert!(tiles_seen.values().all(|&n| n == 1), "tiles once");
    assert!(states.iter().all(|&n| n == pn), "chunk states once");
    assert!(live.iter().all(|&n| n == pn), "live states once");
    assert!(snaps.iter().all(|&n| n == pn), "snapshots once");
    let sb = scratch_bytes(p, dims, bf16);
    if p.chunks() > 0 {
        let elem = if mma.is_some() { 2 } else { 4 };
        let recs = p.chunks() * heads * rec_rows(p) as usize * 4;
        assert_eq!(
            sb,
            [
                p.tokens() as usize * heads * 4,
                p.tokens() as usize * heads * 4,
                p.chunks() * heads * pn * elem,
                recs,
                recs
            ]
        );
    } else {
        assert_eq!(sb, [0; 5]);
    }
}

// ---- an f64 emulation of the kernels' maths over the plan, against the recurrence ----

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

/// The kernels' maths (ssm.cu) over the plan's columns, in f64, step by step.
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
fn check_maths(lens: &[u32], snaps: &[Snapshot], chunk: u32, seed: u64) {
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

#[test]
fn a_mixed_step_is_planned_as_the_cpu_cuts_it() {
    // Decodes (one with a snapshot), a fresh prompt with block-boundary snapshots, a
    // prompt shorter than the conv window with a snapshot after 1, a one-token prompt.
    let lens = [1, 131, 1, 3, 40, 1];
    let snaps = [
        snap(1, 16, 7),
        snap(1, 64, 8),
        snap(1, 131, 9),
        snap(2, 1, 10),
        snap(3, 1, 11),
        snap(3, 2, 12),
        snap(4, 16, 13),
        snap(4, 16, 14),
    ];
    for chunk in [8, 29, 128, 256, 1000] {
        let p = check_plan(&lens, &snaps, chunk);
        replay_conv(&p, conv_dims(300, 4), true);
        replay_scan(&p, scan_dims(8, 64, 2, 128), true);
        replay_scan(&p, scan_dims(4, 24, 4, 16), false);
        check_maths(&lens, &snaps, chunk, chunk as u64);
    }
    let (_, p) = build(&lens, &snaps, 128);
    assert_eq!(p.decodes(), 3);
    // Chunk 1 (131 tokens) is cut at 16, 64, 128 (16 + 112 would pass 128? no: segments
    // [0,16), [16,64), [64,131) → [64,131) is one piece of 67).
    let ck_len: Vec<u32> = p.column(WorkCol::CkLen).to_vec();
    assert_eq!(&ck_len[..3], &[16, 48, 67]);
    assert_eq!(&p.column(WorkCol::CkSnaps)[..3], &[1, 1, 1]);
}

#[test]
fn snapshots_at_every_block_boundary_of_a_131_token_chunk() {
    let snaps: Vec<Snapshot> = (1..=8).map(|b| snap(0, 16 * b, b)).collect();
    for chunk in [8, 29, 128] {
        let p = check_plan(&[131], &snaps, chunk);
        replay_scan(&p, scan_dims(4, 64, 1, 64), true);
        check_maths(&[131], &snaps, chunk, 7);
    }
}

#[test]
fn the_kernels_follow_dtype_and_shape() {
    let (_, p) = build(&[1, 200], &[], 128);
    let names = |d: ScanDims, bf16| -> Vec<&str> {
        launches_scan(&p, d, bf16)
            .expect("shape")
            .iter()
            .map(|l| l.entry)
            .collect()
    };
    assert_eq!(
        names(scan_dims(128, 64, 8, 128), true),
        [
            "ssm_decode_bf16",
            "ssd_dt_bf16",
            "ssd_chunk_pass_mma_p64n128_bf16",
            "ssd_scan_group_mma_p64n128_bf16"
        ]
    );
    assert_eq!(
        names(scan_dims(8, 64, 8, 64), true)[2..],
        [
            "ssd_chunk_pass_mma_p64n64_bf16",
            "ssd_scan_group_mma_p64n64_bf16"
        ]
    );
    let bf16_state = ScanDims {
        state_bf16: true,
        ..scan_dims(8, 64, 8, 128)
    };
    assert_eq!(
        names(bf16_state, true)[2..],
        [
            "ssd_chunk_pass_mma_p64n128_bf16_sbf16",
            "ssd_scan_group_mma_p64n128_bf16"
        ]
    );
    // Chunks over 128 tokens: the per-head scan, which walks 128-row blocks.
    let (_, wide) = build(&[1, 300], &[], 256);
    let l = launches_scan(&wide, scan_dims(8, 64, 8, 128), true).expect("shape");
    assert_eq!(l[3].entry, "ssd_scan_mma_p64n128_bf16");
    replay_scan(&wide, scan_dims(8, 64, 8, 128), true);
    let odd_out = ScanDims {
        out_ld: 64 * 8 + 2,
        ..scan_dims(8, 64, 8, 128)
    };
    assert_eq!(names(odd_out, true)[4], "ssd_scan_simt_bf16");
    assert_eq!(
        names(scan_dims(128, 64, 8, 128), false),
        [
            "ssm_decode_f32",
            "ssd_dt_f32",
            "ssd_states_simt_f32",
            "ssd_pass",
            "ssd_scan_simt_f32"
        ]
    );
    assert_eq!(
        names(scan_dims(8, 32, 8, 128), true)[2],
        "ssd_states_simt_bf16"
    );
    let odd_stride = ScanDims {
        x_ld: 64 * 8 + 4,
        ..scan_dims(8, 64, 8, 128)
    };
    assert_eq!(names(odd_stride, true)[4], "ssd_scan_simt_bf16");
    let unaligned = ScanDims {
        aligned16: false,
        ..scan_dims(8, 64, 8, 128)
    };
    assert_eq!(names(unaligned, true)[2], "ssd_states_simt_bf16");
    assert_eq!(names(unaligned, true)[4], "ssd_scan_simt_bf16");
    // T = 8192, 128 heads × 64, state 128, chunk 128: grids of the big shape.
    let (_, big) = build(&[8192], &[], 128);
    let l = launches_scan(&big, scan_dims(128, 64, 8, 128), true).expect("shape");
    let grids: Vec<u32> = l.iter().map(|l| l.grid.0).collect();
    // dt; chunk pass: (entry, head, column half); group scan: (chunk, group), 16 heads a CTA.
    assert_eq!(grids, [64 * 4, 128 * 2, 64 * 8]);
    assert_eq!(u32_arg(&l[2], 15), 16);
    let recs = 64 * 128 * 128 * 4;
    assert_eq!(
        scratch_bytes(&big, scan_dims(128, 64, 8, 128), true),
        [
            8192 * 128 * 4,
            8192 * 128 * 4,
            64 * 128 * 64 * 128 * 2,
            recs,
            recs
        ]
    );
    assert_eq!(
        scratch_bytes(&big, scan_dims(128, 64, 8, 128), false),
        [
            8192 * 128 * 4,
            8192 * 128 * 4,
            64 * 128 * 64 * 128 * 4,
            recs,
            recs
        ]
    );
    // A 1024-token prompt: 64 (chunk, group) pairs, so 2 heads a CTA (512 CTAs).
    let (_, short) = build(&[1024], &[], 128);
    let l = launches_scan(&short, scan_dims(128, 64, 8, 128), true).expect("shape");
    assert_eq!((l[2].grid.0, u32_arg(&l[2], 15)), (512, 2));
    replay_scan(&short, scan_dims(128, 64, 8, 128), true);
    // The knob: 4 heads a CTA (4 CTAs a (chunk, group)), and more than a group's, clamped.
    for (knob, want) in [(4, 4), (40, 16)] {
        let d = ScanDims {
            group_scan_heads: knob,
            ..scan_dims(128, 64, 8, 128)
        };
        let l = launches_scan(&short, d, true).expect("shape");
        assert_eq!(u32_arg(&l[2], 15), want);
        assert_eq!(l[2].grid.0, 8 * 8 * (16 / want));
        replay_scan(&short, d, true);
    }
}

#[test]
fn bad_inputs_are_refused() {
    let cu = [0, 3, 4];
    let inp = |snaps: &'static [Snapshot], slots: &'static [u32]| SsmStepInputs {
        cu_seqlens: &[0, 3, 4],
        slots,
        snapshots: snaps,
        slot_ops: &[],
        chunk_size: 4,
    };
    let mut p = SsmPlan::new();
    assert_eq!(
        plan(inp(&[], &[0]), &mut p),
        Err(SsmError::Slots {
            chunks: 2,
            slots: 1
        })
    );
    const PAST: &[Snapshot] = &[Snapshot {
        seq: 0,
        after: 4,
        slot: 3,
    }];
    assert_eq!(
        plan(inp(PAST, &[0, 1]), &mut p),
        Err(SsmError::Snapshot {
            seq: 0,
            after: 4,
            len: 3
        })
    );
    const ZERO: &[Snapshot] = &[Snapshot {
        seq: 1,
        after: 0,
        slot: 3,
    }];
    assert_eq!(
        plan(inp(ZERO, &[0, 1]), &mut p),
        Err(SsmError::Snapshot {
            seq: 1,
            after: 0,
            len: 1
        })
    );
    const NOSEQ: &[Snapshot] = &[Snapshot {
        seq: 2,
        after: 1,
        slot: 3,
    }];
    assert_eq!(
        plan(inp(NOSEQ, &[0, 1]), &mut p),
        Err(SsmError::Snapshot {
            seq: 2,
            after: 1,
            len: 0
        })
    );
    let down = SsmStepInputs {
        cu_seqlens: &[0, 3, 2],
        ..inp(&[], &[0, 1])
    };
    assert_eq!(plan(down, &mut p), Err(SsmError::CuSeqlens(1)));
    assert!(plan(inp(&[], &[0, 1]), &mut p).is_ok());
    assert_eq!(p.tokens(), cu[2]);
    let bad = ScanDims {
        groups: 3,
        ..scan_dims(8, 64, 2, 128)
    };
    assert!(matches!(
        launches_scan(&p, bad, true),
        Err(SsmError::Shape { .. })
    ));
    for kernel in [1, 9] {
        assert_eq!(
            launches_conv(&p, conv_dims(16, kernel), false),
            Err(SsmError::Conv {
                kernel,
                channels: 16
            })
        );
    }
}

#[test]
fn an_empty_step_launches_nothing() {
    let (_, p) = build(&[0, 0], &[], 128);
    assert_eq!(p.seqs(), 0);
    assert_eq!(launches_conv(&p, conv_dims(16, 4), true), Ok(vec![]));
    assert_eq!(
        launches_scan(&p, scan_dims(4, 64, 1, 128), true),
        Ok(vec![])
    );
    let pools = PoolDims {
        slots: 4,
        conv_per_slot: 12,
        ssm_per_slot: 64,
    };
    assert!(launches_slot_ops(&p, pools).is_empty());
}

/// Applies ops wave by wave as the kernel does (every op of a wave reads before any
/// writes) and checks the result equals applying them one after another.
fn check_waves(ops: &[SlotOp], slots: u32) {
    let mut p = SsmPlan::new();
    let inp = SsmStepInputs {
        cu_seqlens: &[0],
        slots: &[],
        snapshots: &[],
        slot_ops: ops,
        chunk_size: 8,
    };
    plan(inp, &mut p).expect("plan");
    let mut seq: Vec<i64> = (0..slots as i64).collect();
    for op in ops {
        match *op {
            SlotOp::Copy { from, to } => seq[to as usize] = seq[from as usize],
            SlotOp::Zero { slot } => seq[slot as usize] = -1,
        }
    }
    let mut par: Vec<i64> = (0..slots as i64).collect();
    let (from, to) = (p.column(WorkCol::OpFrom), p.column(WorkCol::OpTo));
    let mut next = 0;
    for &(a, b) in p.waves() {
        assert_eq!(a, next, "waves are contiguous");
        next = b;
        let reads: Vec<i64> = (a..b)
            .map(|i| {
                if from[i] == ZERO_OP {
                    -1
                } else {
                    par[from[i] as usize]
                }
            })
            .collect();
        let mut dsts: Vec<u32> = to[a..b].to_vec();
        dsts.sort_unstable();
        dsts.dedup();
        assert_eq!(dsts.len(), b - a, "a wave writes each slot once");
        for f in &from[a..b] {
            assert!(!to[a..b].contains(f), "a wave reads no slot it writes");
        }
        for (i, v) in (a..b).zip(reads) {
            par[to[i] as usize] = v;
        }
    }
    assert_eq!(next, p.ops());
    assert_eq!(par, seq);
    let pools = PoolDims {
        slots,
        conv_per_slot: 3 * 7,
        ssm_per_slot: 3 * 64,
    };
    let launches = launches_slot_ops(&p, pools);
    assert_eq!(launches.len(), p.waves().len());
    for (l, &(a, b)) in launches.iter().zip(p.waves()) {
        let (_, entry) = crate::entry(l.entry).expect("declared");
        let kinds: Vec<Param> = l.args.iter().map(SsmArg::param).collect();
        assert_eq!(kinds, entry.params);
        assert_eq!(
            l.entry, "ssm_slot_ops",
            "21 conv values per slot are not float4s"
        );
        assert_eq!((l.grid.1 as usize, u32_arg(l, 4) as usize), (b - a, a));
    }
}

#[test]
fn slot_ops_keep_their_order() {
    use SlotOp::*;
    check_waves(
        &[
            Zero { slot: 1 },
            Copy { from: 5, to: 2 },
            Copy { from: 5, to: 3 },
        ],
        8,
    );
    check_waves(
        &[
            Copy { from: 1, to: 2 },
            Copy { from: 2, to: 3 },
            Zero { slot: 1 },
            Copy { from: 4, to: 4 },
        ],
        8,
    );
    let mut p = SsmPlan::new();
    let ops = [
        Zero { slot: 1 },
        Copy { from: 5, to: 2 },
        Copy { from: 2, to: 3 },
    ];
    plan(
        SsmStepInputs {
            cu_seqlens: &[0],
            slots: &[],
            snapshots: &[],
            slot_ops: &ops,
            chunk_size: 8,
        },
        &mut p,
    )
    .expect("plan");
    assert_eq!(p.waves(), [(0, 2), (2, 3)]);
    assert_eq!(p.column(WorkCol::OpFrom), [ZERO_OP, 5, 2]);
    let big = PoolDims {
        slots: 8,
        conv_per_slot: 24 * 10240 * 3,
        ssm_per_slot: 24 * 128 * 64 * 128,
    };
    let l = launches_slot_ops(&p, big);
    assert_eq!(l[0].entry, "ssm_slot_ops_v4");
    assert_eq!(l[0].grid, (1024, 2, 1));
}

#[test]
fn a_warm_plan_does_not_allocate() {
    let lens = [1, 1, 300, 5, 1];
    let snaps = [snap(2, 16, 1), snap(2, 32, 2), snap(1, 1, 3)];
    let cu = cu_of(&lens);
    let slots = [9, 8, 7, 6, 5];
    let ops = [SlotOp::Zero { slot: 7 }, SlotOp::Copy { from: 1, to: 6 }];
    let inp = SsmStepInputs {
        cu_seqlens: &cu,
        slots: &slots,
        snapshots: &snaps,
        slot_ops: &ops,
        chunk_size: 64,
    };
    let mut p = SsmPlan::new();
    plan(inp, &mut p).expect("plan");
    let ptrs = |p: &SsmPlan| -> Vec<(*const u32, usize)> {
        p.cols.iter().map(|c| (c.as_ptr(), c.capacity())).collect()
    };
    let before = (ptrs(&p), p.order.capacity(), p.waves.capacity());
    let first = p.clone();
    plan(inp, &mut p).expect("plan");
    assert_eq!((ptrs(&p), p.order.capacity(), p.waves.capacity()), before);
    assert_eq!(first.cols, p.cols);
}

// ---- GPU harness feed ----

fn json_launches(ls: &[Launch<SsmArg>]) -> String {
    let items: Vec<String> = ls
        .iter()
        .map(|l| {
            let args: Vec<String> = l.args.iter().map(|a| format!("\"{a:?}\"")).collect();
            format!(
                "{{\"entry\": \"{}\", \"grid\": [{}, {}, {}], \"block\": [{}, {}, {}], \"smem\": {}, \"args\": [{}]}}",
                l.entry, l.grid.0, l.grid.1, l.grid.2, l.block.0, l.block.1, l.block.2, l.smem, args.join(", ")
            )
        })
        .collect();
    format!("[{}]", items.join(",\n  "))
}

fn json_u32(v: &[u32]) -> String {
    let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", s.join(", "))
}

/// One GPU case: the plan's columns and every launch, for `kernels/tools`-style harnesses
/// that execute exactly what the backend will (kept outside the repository).
#[allow(clippy::too_many_arguments)]
fn gpu_case(
    name: &str,
    lens: &[u32],
    snaps: &[Snapshot],
    ops: &[SlotOp],
    chunk: u32,
    (heads, head_dim, groups, state): (u32, u32, u32, u32),
    slots: u32,
    layers: u32,
    check: bool,
) -> String {
    let cu = cu_of(lens);
    let live: Vec<u32> = (0..lens.len() as u32).collect();
    let mut p = SsmPlan::new();
    plan(
        SsmStepInputs {
            cu_seqlens: &cu,
            slots: &live,
            snapshots: snaps,
            slot_ops: ops,
            chunk_size: chunk,
        },
        &mut p,
    )
    .expect("plan");
    let layer = layers - 1;
    let channels = heads * head_dim + 2 * groups * state;
    let conv = ConvDims {
        channels,
        kernel: 4,
        layer,
        layers,
        slots,
        x_ld: channels,
        out_ld: channels,
    };
    let scan = ScanDims {
        layer,
        layers,
        slots,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        ..ScanDims::packed(heads, head_dim, groups, state)
    };
    let pools = PoolDims {
        slots,
        conv_per_slot: u64::from(layers * channels * 3),
        ssm_per_slot: u64::from(layers * heads * head_dim * state),
    };
    let cols: Vec<String> = WorkCol::ALL
        .iter()
        .map(|c| format!("\"{c:?}\": {}", json_u32(p.column(*c))))
        .collect();
    let snaps_s: Vec<String> = snaps
        .iter()
        .map(|t| format!("[{}, {}, {}]", t.seq, t.after, t.slot))
        .collect();
    let ops_s: Vec<String> = ops
        .iter()
        .map(|o| match *o {
            SlotOp::Copy { from, to } => format!("[{from}, {to}]"),
            SlotOp::Zero { slot } => format!("[-1, {slot}]"),
        })
        .collect();
    let mut parts = vec![
        format!("\"name\": \"{name}\""),
        format!("\"check\": {check}"),
        format!("\"cu\": {}", json_u32(&cu)),
        format!("\"live\": {}", json_u32(&live)),
        format!("\"snaps\": [{}]", snaps_s.join(", ")),
        format!("\"ops\": [{}]", ops_s.join(", ")),
        format!("\"shape\": [{heads}, {head_dim}, {groups}, {state}]"),
        format!(
            "\"channels\": {channels}, \"kernel\": 4, \"slots\": {slots}, \"layers\": {layers}, \"layer\": {layer}"
        ),
        format!("\"cols\": {{{}}}", cols.join(", ")),
        format!(
            "\"scratch\": {}",
            json_u32(
                // The f32 sizes: the larger, enough for both dtypes' launches.
                &scratch_bytes(&p, scan, false)
                    .iter()
                    .map(|&b| b as u32)
                    .collect::<Vec<_>>()
            )
        ),
        format!(
            "\"slot_ops\": {}",
            json_launches(&launches_slot_ops(&p, pools))
        ),
    ];
    for bf16 in [false, true] {
        let t = suffix(bf16);
        parts.push(format!(
            "\"conv_{t}\": {}",
            json_launches(&launches_conv(&p, conv, bf16).expect("conv"))
        ));
        parts.push(format!(
            "\"scan_{t}\": {}",
            json_launches(&launches_scan(&p, scan, bf16).expect("scan"))
        ));
    }
    format!("{{{}}}", parts.join(",\n "))
}

/// Writes `$SSM_DEV_DIR/cases.json` for the GPU harness.
#[test]
#[ignore = "writes the GPU harness's cases; run with SSM_DEV_DIR set"]
fn dump_gpu_cases() {
    let Ok(dir) = std::env::var("SSM_DEV_DIR") else {
        {
            use std::io::Write;
            // Straight to stderr: the harness hides `eprintln!` of passing tests.
            let _ = writeln!(std::io::stderr(), "skipped: SSM_DEV_DIR not set");
        }
        return;
    };
    let mixed = [1, 131, 1, 3, 40, 1, 300, 2];
    let mixed_snaps = [
        snap(1, 16, 8),
        snap(1, 64, 9),
        snap(1, 131, 10),
        snap(2, 1, 11),
        snap(3, 1, 12),
        snap(3, 2, 13),
        snap(4, 16, 14),
        snap(4, 16, 15),
        snap(6, 250, 16),
        snap(7, 1, 17),
    ];
    let ops = [
        SlotOp::Zero { slot: 18 },
        SlotOp::Copy { from: 3, to: 19 },
        SlotOp::Copy { from: 19, to: 18 },
        SlotOp::Copy { from: 5, to: 20 },
    ];
    let blocks: Vec<Snapshot> = (1..=8).map(|b| snap(1, 16 * b, 3 + b)).collect();
    let cases = [
        gpu_case(
            "mixed_h8_p64_n128_c128",
            &mixed,
            &mixed_snaps,
            &ops,
            128,
            (8, 64, 2, 128),
            22,
            2,
            true,
        ),
        gpu_case(
            "blocks_h4_p64_n64_c29",
            &[1, 131, 7],
            &blocks,
            &[],
            29,
            (4, 64, 1, 64),
            12,
            2,
            true,
        ),
        gpu_case(
            "odd_h6_p24_n16_c8",
            &[5, 1, 33, 1000, 1],
            &[snap(3, 999, 6), snap(0, 2, 7)],
            &[],
            8,
            (6, 24, 3, 16),
            9,
            1,
            true,
        ),
        gpu_case(
            "long_h4_p32_n64_c256",
            &[1000, 1, 7, 33],
            &[snap(0, 512, 5), snap(2, 7, 6)],
            &[],
            256,
            (4, 32, 2, 64),
            8,
            1,
            true,
        ),
        gpu_case(
            "prefill_t8192_h128",
            &[8192],
            &[snap(0, 2048, 1), snap(0, 4096, 2), snap(0, 8000, 3)],
            &[],
            128,
            (128, 64, 8, 128),
            4,
            1,
            false,
        ),
        gpu_case(
            "decode_bs256_h128",
            &[1; 256],
            &[],
            &[],
            128,
            (128, 64, 8, 128),
            256,
            1,
            false,
        ),
    ];
    let path = std::path::Path::new(&dir).join("cases.json");
    std::fs::write(&path, format!("[\n{}\n]\n", cases.join(",\n"))).expect("write cases");
    eprintln!("wrote {}", path.display());
}

fn chunk_len() -> impl Strategy<Value = u32> {
    prop_oneof![Just(1u32), 2u32..40, 100u32..300]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_mixes_cover_everything_once(
        lens in prop::collection::vec(chunk_len(), 1..8),
        picks in prop::collection::vec((0usize..8, 1u32..300, 0u32..2), 0..10),
        chunk in prop::sample::select(vec![1u32, 8, 29, 128, 256, 300]),
        bf16 in any::<bool>(),
        shape in prop::sample::select(vec![(8u32, 64u32, 2u32, 128u32), (4, 64, 4, 64), (6, 24, 3, 16), (2, 3, 1, 4)]),
    ) {
        // Snapshots at random offsets (and some at the chunk end), distinct slots.
        let mut snaps = Vec::new();
        for (i, &(s, after, end)) in picks.iter().enumerate() {
            let s = s % lens.len();
            let after = if end == 1 { lens[s] } else { 1 + (after - 1) % lens[s] };
            snaps.push(snap(s as u32, after, i as u32));
        }
        let p = check_plan(&lens, &snaps, chunk);
        replay_conv(&p, conv_dims(200, 4), bf16);
        replay_scan(&p, scan_dims(shape.0, shape.1, shape.2, shape.3), bf16);
        if p.tokens() <= 400 {
            check_maths(&lens, &snaps, chunk, p.tokens() as u64);
        }
    }

    #[test]
    fn random_slot_ops_keep_their_order(
        ops in prop::collection::vec((0u32..6, 0u32..6, any::<bool>()), 0..12),
    ) {
        let ops: Vec<SlotOp> = ops
            .into_iter()
            .map(|(a, b, z)| if z { SlotOp::Zero { slot: b } } else { SlotOp::Copy { from: a, to: b } })
            .collect();
        check_waves(&ops, 6);
    }
}

/// Pads `lens`' plan (live slots 100 + i) to `caps`.
fn padded(lens: &[u32], snaps: &[Snapshot], chunk: u32, caps: FixedCaps) -> (SsmPlan, SsmPlan) {
    let (_, p) = build(lens, snaps, chunk);
    let mut q = p.clone();
    assert!(q.pad_to(caps), "{lens:?} fits {caps:?}");
    (p, q)
}

#[test]
fn a_padded_plan_keeps_its_work_and_launches_by_capacity_only() {
    let caps = FixedCaps {
        decodes: 8,
        prompts: 4,
        chunks: 12,
        snapshots: 10,
        rows: 400 + 8,
    };
    let mixes: [(&[u32], Vec<Snapshot>); 3] = [
        (
            &[1, 131, 1, 3, 40, 1],
            vec![snap(0, 1, 1), snap(1, 64, 2), snap(1, 128, 3)],
        ),
        (&[1, 1, 1, 1, 1, 1, 1, 1], vec![snap(5, 1, 7)]),
        (
            &[300, 2],
            vec![snap(0, 256, 4), snap(0, 300, 5), snap(1, 2, 6)],
        ),
    ];
    let mut seen: Option<Vec<String>> = None;
    for (lens, snaps) in &mixes {
        let (p, q) = padded(lens, snaps, 128, caps);
        let col = |plan: &SsmPlan, c: WorkCol| plan.column(c).to_vec();
        let (d, shift) = (p.decodes(), caps.decodes - p.decodes());
        assert_eq!((q.decodes(), q.prompts()), (caps.decodes, caps.prompts));
        assert_eq!(
            (q.chunks(), q.snapshots(), q.tokens()),
            (caps.chunks, caps.snapshots, caps.rows)
        );
        for c in &WorkCol::ALL[..7] {
            let (a, b) = (col(&p, *c), col(&q, *c));
            // Real decodes, then padding decodes, then the real prompts unchanged.
            assert_eq!(a[..d], b[..d], "{c:?}");
            assert_eq!(a[d..], b[caps.decodes..caps.decodes + p.prompts()], "{c:?}");
        }
        for e in d..caps.decodes {
            assert_eq!(col(&q, WorkCol::SeqSlot)[e], PAD_SLOT);
            assert_eq!(col(&q, WorkCol::SeqLen)[e], 1);
            assert_eq!(col(&q, WorkCol::SeqSnaps)[e], 0);
            // Spread over the padding rows.
            let spare = caps.rows - p.tokens();
            assert_eq!(
                col(&q, WorkCol::SeqTok)[e],
                p.tokens() + (e - d) as u32 % spare
            );
        }
        for e in caps.decodes + p.prompts()..q.seqs() {
            assert_eq!(col(&q, WorkCol::SeqSlot)[e], PAD_SLOT);
            assert_eq!(col(&q, WorkCol::SeqChunks)[e], 0);
        }
        for ck in 0..caps.chunks {
            let real = ck < p.chunks();
            assert_eq!(col(&q, WorkCol::CkLen)[ck] > 0, real, "chunk {ck}");
            if real {
                assert_eq!(
                    col(&q, WorkCol::CkSeq)[ck],
                    col(&p, WorkCol::CkSeq)[ck] + shift as u32
                );
                assert_eq!(col(&q, WorkCol::CkTok)[ck], col(&p, WorkCol::CkTok)[ck]);
            } else {
                assert_eq!(col(&q, WorkCol::CkSnaps)[ck], 0);
            }
        }
        let slots = col(&q, WorkCol::SnapSlot);
        assert_eq!(slots[..p.snapshots()], col(&p, WorkCol::SnapSlot)[..]);
        assert!(slots[p.snapshots()..].iter().all(|&s| s == PAD_SLOT));
        // The launches depend on the capacities only.
        let mut l = launches_conv(&q, conv_dims(200, 4), true).expect("conv");
        l.extend(launches_scan(&q, scan_dims(8, 64, 2, 128), true).expect("scan"));
        l.extend(launches_scan(&q, scan_dims(6, 24, 3, 16), false).expect("scan"));
        let shapes: Vec<String> = l
            .iter()
            .map(|l| format!("{} {:?} {} {:?}", l.entry, l.grid, l.smem, l.args))
            .collect();
        assert_eq!(seen.get_or_insert(shapes.clone()), &shapes, "{lens:?}");
        assert_eq!(scratch_bytes(&q, scan_dims(8, 64, 2, 128), true), {
            let (_, r) = padded(mixes[0].0, &mixes[0].1, 128, caps);
            scratch_bytes(&r, scan_dims(8, 64, 2, 128), true)
        });
    }
}

#[test]
fn a_plan_over_a_capacity_is_not_padded() {
    let caps = FixedCaps {
        decodes: 2,
        prompts: 1,
        chunks: 3,
        snapshots: 1,
        rows: 140,
    };
    for (lens, snaps) in [
        (vec![1u32, 1, 1], vec![]),                           // decodes
        (vec![5u32, 5], vec![]),                              // prompts
        (vec![130u32], vec![snap(0, 1, 1)]),                  // chunks: 1, 64, 64, 1
        (vec![1u32, 10], vec![snap(0, 1, 1), snap(1, 4, 2)]), // snapshots
        (vec![139u32], vec![]), // 3 chunks, 2 padding decodes on the one spare row: fits
        (vec![140u32], vec![]), // 2 padding decodes, no spare row
    ] {
        let (_, p) = build(&lens, &snaps, 64);
        let mut q = p.clone();
        let fits = q.pad_to(caps);
        assert_eq!(fits, lens == [139], "{lens:?}");
        if !fits {
            assert_eq!(q.column(WorkCol::SeqTok), p.column(WorkCol::SeqTok));
            assert_eq!(q.tokens(), p.tokens());
        }
    }
}
