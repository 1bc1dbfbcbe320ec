//! Replays of the kernels' grid decompositions over a plan: every output, live state and
//! snapshot written once, in the launch order the kernels rely on.

use super::*;

/// Replays the conv kernels' grid decomposition (conv.cu conv_chunks, conv_update,
/// conv_recurrent): every (token, channel block) output written once, every live state once,
/// every snapshot once, and the prompt chunks before the update.
pub(super) fn replay_conv(p: &SsmPlan, dims: ConvDims, bf16: bool) {
    let launches = launches_conv(p, dims, bf16).expect("conv shape");
    let col = |c: WorkCol, i: usize| p.column(c)[i] as usize;
    let mut out: HashMap<(usize, u32), u32> = HashMap::new();
    let mut live = vec![0u32; p.seqs()];
    let mut snaps = vec![0u32; p.snapshots()];
    let names: Vec<&str> = launches.iter().map(|l| l.entry).collect();
    let ty = suffix(bf16);
    let recurrent = short_prompts(p, dims.recurrent_tokens);
    let mut want = Vec::new();
    if recurrent {
        want.push(format!("ssm_conv_recurrent_{ty}"));
    } else if p.chunks() > 0 {
        want.push(format!("ssm_conv_chunks_{ty}"));
    }
    if (recurrent && p.decodes() > 0) || (!recurrent && p.seqs() > 0) {
        want.push(format!("ssm_conv_update_{ty}"));
    }
    assert_eq!(names, want);
    for l in &launches {
        check_kinds(l);
        assert_eq!(l.block.0, CONV_THREADS);
        let chunks = l.entry.starts_with("ssm_conv_chunks");
        let update = l.entry.starts_with("ssm_conv_update");
        let ch_blocks = u32_arg(
            l,
            if update {
                19
            } else if chunks {
                20
            } else {
                21
            },
        );
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
            if chunks {
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
            } else if update {
                let e = (bid / ch_blocks) as usize;
                assert!(
                    !recurrent || e < p.decodes(),
                    "prompts left to conv_recurrent"
                );
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
            } else {
                // conv_recurrent: CTA (prompt entry, channel block), every token of the entry.
                let base = u32_arg(l, 13) as usize;
                assert_eq!(base, p.decodes());
                let e = base + (bid / ch_blocks) as usize;
                let c0 = col(WorkCol::SeqChunk, e);
                for ck in c0..c0 + col(WorkCol::SeqChunks, e) {
                    assert_eq!(col(WorkCol::CkSeq, ck), e);
                    for r in 0..col(WorkCol::CkLen, ck) {
                        for c in chans.clone() {
                            *out.entry((col(WorkCol::CkTok, ck) + r, c)).or_default() += 1;
                        }
                    }
                    if cb == 0 {
                        let k0 = col(WorkCol::CkSnap, ck);
                        for n in &mut snaps[k0..k0 + col(WorkCol::CkSnaps, ck)] {
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
pub(super) fn replay_scan(p: &SsmPlan, dims: ScanDims, bf16: bool) {
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
        } else if name.starts_with("ssm_recurrent") {
            // CTA (prompt entry, head, slice of REC_ROWS rows of p): every token of the
            // entry's chunks for those rows, its snapshots and its live state.
            order.push("recurrent");
            assert_eq!(l.block.0, DEC_THREADS);
            assert_eq!(name.ends_with("_sbf16"), dims.state_bf16, "{name}");
            let base = u32_arg(l, 17) as usize;
            assert_eq!(base, p.decodes());
            let rows = REC_ROWS as usize;
            let slices = pd.div_ceil(rows);
            for bid in 0..l.grid.0 as usize {
                let (slice, r) = (bid % slices, bid / slices);
                let (h, e) = (r % heads, base + r / heads);
                assert!(e < p.seqs());
                let (p0, p1) = (slice * rows, ((slice + 1) * rows).min(pd));
                let elems = (p1 - p0) * nd;
                live[e * heads + h] += elems;
                let c0 = col(WorkCol::SeqChunk, e);
                for c in c0..c0 + col(WorkCol::SeqChunks, e) {
                    assert_eq!(col(WorkCol::CkSeq, c), e);
                    for i in 0..col(WorkCol::CkLen, c) {
                        for q in p0..p1 {
                            *out.entry((col(WorkCol::CkTok, c) + i, h, q)).or_default() += 1;
                        }
                    }
                    let k0 = col(WorkCol::CkSnap, c);
                    for k in k0..k0 + col(WorkCol::CkSnaps, c) {
                        snaps[k * heads + h] += elems;
                    }
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
    let recurrent = recurrent_prompts(p, dims);
    if recurrent {
        want.push("recurrent");
    } else if p.chunks() > 0 && mma.is_some() {
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
    assert_eq!(
        dt_rows.len(),
        if recurrent { 0 } else { prompt_tokens * heads }
    );
    assert!(dt_rows.values().all(|&n| n == 1));
    assert!(tiles_seen.values().all(|&n| n == 1), "tiles once");
    // The recurrent step keeps its state in registers: no chunk states.
    let chunk_state = if recurrent { 0 } else { pn };
    assert!(
        states.iter().all(|&n| n == chunk_state),
        "chunk states once"
    );
    assert!(live.iter().all(|&n| n == pn), "live states once");
    assert!(snaps.iter().all(|&n| n == pn), "snapshots once");
    let sb = scratch_bytes(p, dims, bf16);
    if p.chunks() > 0 && !recurrent {
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
