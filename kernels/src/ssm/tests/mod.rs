//! Tests of the SSM planner and launches: the plan against the CPU reference's cuts, a
//! replay of every kernel's grid decomposition (each output, live state and snapshot written
//! once; `replay.rs`), an f64 emulation of the kernels' maths over the plan against the
//! token-by-token recurrence (`maths.rs`), slot-op waves, the PTX ABI, and the GPU harness's
//! case dump (`gpu_cases.rs`).

use super::conv::{CONV_ROWS, CONV_THREADS};
use super::ssd::{CHUNK_PASS_SPLIT, DT_HEADS, PASS_PER, PASS_THREADS, SCAN_ROWS, SIMT_TM, SIMT_TN};
use super::state_update::{DEC_THREADS, REC_ROWS};
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

mod gpu_cases;
mod maths;
mod replay;

use maths::check_maths;
use replay::{replay_conv, replay_scan};

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
        recurrent_tokens: RECURRENT_TOKENS,
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

/// [`ENTRIES`], where the launches find their entries, holds exactly the tables the SSM
/// sources are compiled and checked with, in their order.
#[test]
fn the_entry_table_is_the_ssm_sources_tables() {
    let of = |e: &Entry| (e.name, e.params.to_vec());
    let sources: Vec<_> = crate::sources()
        .iter()
        .filter(|s| s.name.starts_with("ssm/"))
        .flat_map(|s| s.entries.iter().map(of))
        .collect();
    let table: Vec<_> = ENTRIES.iter().map(of).collect();
    assert_eq!(table, sources);
    assert_eq!(
        table.len(),
        110,
        "2 slot ops, 6 conv, 4 decode, 4 recurrent, 10 SSD state, 6 SSD scan, 2 GDN prep, 32 GDN scan, \
         28 GDN prompt, 16 GDN decode"
    );
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

/// A verify step (decodes, and requests of k + 1 tokens with a state after every position)
/// scans its prompts token by token: `ssm_recurrent` in place of the SSD's kernels, no
/// scratch; a step with a longer prompt, a padded plan, a state too wide for the kernel or the
/// knob at 0 keep the SSD.
#[test]
fn a_verify_step_scans_its_prompts_token_by_token() {
    let lens = [1, 5, 5, 1, 3];
    let mut snaps = Vec::new();
    for (seq, len) in [(1u32, 5u32), (2, 5), (4, 3)] {
        for after in 1..=len {
            snaps.push(snap(seq, after, 10 * seq + after));
        }
    }
    let (_, p) = build(&lens, &snaps, 128);
    let dims = scan_dims(128, 64, 8, 128);
    for bf16 in [false, true] {
        let names: Vec<_> = launches_scan(&p, dims, bf16)
            .expect("shape")
            .iter()
            .map(|l| l.entry)
            .collect();
        let ty = if bf16 { "bf16" } else { "f32" };
        assert_eq!(
            names,
            [format!("ssm_decode_{ty}"), format!("ssm_recurrent_{ty}")]
        );
        replay_scan(&p, dims, bf16);
        assert_eq!(scratch_bytes(&p, dims, bf16), [0; 5]);
        let conv: Vec<_> = launches_conv(&p, conv_dims(200, 4), bf16)
            .expect("conv shape")
            .iter()
            .map(|l| l.entry)
            .collect();
        assert_eq!(
            conv,
            [
                format!("ssm_conv_recurrent_{ty}"),
                format!("ssm_conv_update_{ty}")
            ]
        );
        replay_conv(&p, conv_dims(200, 4), bf16);
        replay_conv(&p, conv_dims(37, 3), bf16);
    }
    // The conv alone: the SSD's fallback, a longer prompt.
    let off = ConvDims {
        recurrent_tokens: 0,
        ..conv_dims(200, 4)
    };
    assert_eq!(
        launches_conv(&p, off, true).expect("conv shape")[0].entry,
        "ssm_conv_chunks_bf16"
    );
    replay_conv(&p, off, true);
    let bf16_state = ScanDims {
        state_bf16: true,
        ..dims
    };
    assert_eq!(
        launches_scan(&p, bf16_state, true).expect("shape")[1].entry,
        "ssm_recurrent_bf16_sbf16"
    );
    replay_scan(&p, bf16_state, true);
    // Odd shapes: rows not a multiple of the CTA's 16, a state narrower than a warp.
    for d in [scan_dims(6, 24, 3, 16), scan_dims(2, 3, 1, 4)] {
        assert!(recurrent_prompts(&p, d));
        replay_scan(&p, d, false);
    }
    let ssd = |p: &SsmPlan, d: ScanDims| {
        assert!(!recurrent_prompts(p, d));
        let l = launches_scan(p, d, true).expect("shape");
        assert_eq!(l[1].entry, "ssd_dt_bf16");
    };
    let long = build(&[1, 5, 17], &[], 128).1;
    ssd(&long, dims);
    replay_scan(&long, dims, true);
    ssd(
        &p,
        ScanDims {
            recurrent_tokens: 0,
            ..dims
        },
    );
    replay_scan(
        &p,
        ScanDims {
            recurrent_tokens: 0,
            ..dims
        },
        true,
    );
    ssd(
        &p,
        ScanDims {
            recurrent_tokens: 4,
            ..dims
        },
    );
    assert!(recurrent_prompts(
        &p,
        ScanDims {
            recurrent_tokens: 5,
            ..dims
        }
    ));
    ssd(&p, scan_dims(8, 64, 2, 512));
    let caps = FixedCaps {
        decodes: 4,
        prompts: 4,
        chunks: 16,
        snapshots: 16,
        rows: 15 + 2, // a padding row for each padding decode
    };
    let mut q = p.clone();
    assert!(q.pad_to(caps));
    ssd(&q, dims); // (the padding chunks belong to no entry: no replay)
    // Decodes only: no prompt launch at all.
    let (_, d) = build(&[1, 1, 1], &[], 128);
    assert!(!recurrent_prompts(&d, dims));
    assert_eq!(launches_scan(&d, dims, true).expect("shape").len(), 1);
    assert_eq!(
        launches_conv(&d, conv_dims(200, 4), true)
            .expect("conv shape")
            .len(),
        1
    );
    // Prompts only: conv_recurrent alone.
    let (_, only) = build(&[5, 3], &[], 128);
    assert_eq!(
        launches_conv(&only, conv_dims(200, 4), true)
            .expect("conv shape")
            .len(),
        1
    );
    replay_conv(&only, conv_dims(200, 4), true);
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

/// The delta rule's launches over a mixed step: every argument of the kind its entry declares,
/// the prep over every token, the decodes in `gdn_decode` (value dim a multiple of the state's
/// 16-byte vector) or in `gdn_scan` with 8 columns a warp (otherwise), the prompts in
/// `gdn_prompt` (key dim ≤ 128: two columns a lane when that grid is wide, else one) or in
/// `gdn_scan` with 2 columns a warp (larger key dims), each grid covering its entries × value
/// heads × column blocks.
#[test]
fn the_delta_rule_launches_cover_every_entry_with_declared_arguments() {
    let lens = [1, 131, 1, 3, 40, 1];
    let snaps = [
        snap(0, 1, 7),
        snap(1, 16, 8),
        snap(1, 131, 9),
        snap(4, 16, 10),
    ];
    let (_, p) = build(&lens, &snaps, 64);
    let (decodes, prompts) = (p.decodes() as u32, p.prompts() as u32);
    assert_eq!((decodes, prompts), (3, 3));
    for (dk, dv, k_heads, v_heads) in [
        (128, 128, 16, 32),
        (40, 24, 2, 6),
        (8, 20, 1, 3),
        (256, 64, 2, 4),
    ] {
        for (bf16, state_bf16) in [(false, false), (true, false), (false, true), (true, true)] {
            let d = GdnDims {
                layer: 1,
                layers: 3,
                slots: 200,
                state_bf16,
                ..GdnDims::packed(k_heads, v_heads, dk, dv)
            };
            let launches = launches_gdn(&p, d, bf16).expect("launches");
            launches.iter().for_each(check_kinds);
            let names: Vec<&str> = launches.iter().map(|l| l.entry).collect();
            let vec = if state_bf16 { 8 } else { 4 };
            let prep = &launches[0];
            assert!(prep.entry.starts_with("gdn_prep_"), "{names:?}");
            assert_eq!(prep.grid.0, p.tokens());
            let decode = &launches[1];
            let prompt = &launches[2];
            assert_eq!(launches.len(), 3, "{names:?}");
            if dv % vec == 0 {
                let warps = if state_bf16 { 8 } else { 4 };
                assert!(decode.entry.starts_with("gdn_decode_"), "{names:?}");
                assert_eq!(decode.block.0, 32 * warps);
                assert_eq!(decode.grid.0, decodes * v_heads * dv.div_ceil(8 * vec));
            } else {
                assert!(decode.entry.contains("_c8_"), "{names:?}");
                assert_eq!(decode.grid.0, decodes * v_heads * dv.div_ceil(32));
            }
            if dk > 128 {
                assert!(prompt.entry.starts_with("gdn_scan_r8_c2_"), "{names:?}");
                assert_eq!(prompt.grid.0, prompts * v_heads * dv.div_ceil(8));
            } else {
                // 4 row lanes of a power of two rows, at least 4.
                let rows = dk.div_ceil(4).next_power_of_two().max(4);
                let wide = prompts * v_heads * dv.div_ceil(64) >= 128;
                let cols = if rows <= 16 && wide { 2 } else { 1 };
                let name = format!("gdn_prompt_r{rows}_c{cols}_");
                assert!(prompt.entry.starts_with(&name), "{name} in {names:?}");
                assert_eq!(prompt.block.0, 128);
                assert_eq!(prompt.grid.0, prompts * v_heads * dv.div_ceil(32 * cols));
            }
            // The prompt launch starts at the first prompt entry.
            let e0_at = prompt.args.len() - 11;
            assert_eq!(u32_arg(prompt, e0_at), decodes);
        }
    }
    // Without staged prompts they take gdn_scan at two columns a warp.
    let d = GdnDims {
        staged_prompts: false,
        ..GdnDims::packed(16, 32, 128, 128)
    };
    let launches = launches_gdn(&p, d, true).expect("launches");
    assert!(
        launches[2].entry.starts_with("gdn_scan_r4_c2_"),
        "{}",
        launches[2].entry
    );
    // A key dim beyond the kernels' rows is refused, not launched.
    assert!(launches_gdn(&p, GdnDims::packed(1, 1, 512, 64), false).is_err());
}
