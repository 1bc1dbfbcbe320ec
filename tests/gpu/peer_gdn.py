#!/usr/bin/env python3
"""The peer of chimera's gated delta rule, measured in the same run: fla's
`chunk_gated_delta_rule` Triton kernel (flash-linear-attention) on the Qwen3.5 layer shape (16
key heads, 32 value heads, 128 x 128, bf16, one 8192-token sequence, final state kept), forward
only, median of CUDA-event timings; and its recurrent decode at batch 256 where fla has one.
fla comes from wheels in --wheels (installed into a temporary folder; the GPU machine has no
internet). Writes rows in chimera-gpu-check's JSON format; a peer that cannot run is a row that
says why."""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from event_timing import median_ms  # tests/gpu/event_timing.py

p = argparse.ArgumentParser()
p.add_argument("--json", required=True)
p.add_argument("--wheels", default=".gpu/whl")
args = p.parse_args()
rows = []


def row(check, measured, value, passed=True):
    rows.append({"suite": "peers", "check": check, "measured": measured, "bound": "reported",
                 "pass": passed, "value": value})



try:
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if wheels:
        site = tempfile.mkdtemp(prefix="fla-")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", site, *wheels], check=True)
        sys.path.insert(0, site)
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    T, HK, HV, D = 8192, 16, 32, 128
    dev, dt = "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, HK, D, device=dev), dim=-1).to(dt)
    k = torch.nn.functional.normalize(torch.randn(1, T, HK, D, device=dev), dim=-1).to(dt)
    v = torch.randn(1, T, HV, D, device=dev, dtype=dt)
    g = -torch.rand(1, T, HV, device=dev, dtype=torch.float32) * 0.1
    beta = torch.rand(1, T, HV, device=dev, dtype=dt)
    try:
        f = lambda: chunk_gated_delta_rule(q, k, v, g.to(dt), beta, output_final_state=True)
        f()
        layout = "GVA 16k/32v"
    except Exception:
        # An fla without grouped value heads: q/k repeated to 32 heads (the same work).
        q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
        f = lambda: chunk_gated_delta_rule(q, k, v, g.to(dt), beta, output_final_state=True)
        f()
        layout = "q/k repeated to 32 heads"
    ms = median_ms(f, warmup=3, reps=20)
    row(f"fla chunk_gated_delta_rule T=8192, 32v x 128 ({layout}), bf16, final state; reported",
        f"{ms:.3f} ms", ms)
except Exception as e:  # the peer cannot run: say why in the table
    row(f"fla chunk_gated_delta_rule T=8192: could not run ({type(e).__name__}: {e})"[:300],
        "-", float("nan"))

with open(args.json, "w") as out:
    json.dump({"device": "", "seed": 0, "rows": rows}, out, indent=1)
