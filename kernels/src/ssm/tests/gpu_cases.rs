//! The GPU harness's feed: each case's plan columns and every launch, as JSON.

use super::*;

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
        recurrent_tokens: RECURRENT_TOKENS,
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
