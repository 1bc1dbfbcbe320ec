#!/usr/bin/env python3
"""Peer kernels measured in the same run as chimera's: PyTorch SDPA causal GQA attention
(32 query / 8 KV heads, head_dim 128, bf16) at T = 2048 and 8192, and its decode (one query
token a sequence, 2048 cached tokens, batch 1, 64 and 256), median of CUDA-graph-free event
timings. Writes rows in chimera-gpu-check's JSON format."""
import argparse
import json

import torch
import torch.nn.functional as F

from event_timing import median_ms  # tests/gpu/event_timing.py

p = argparse.ArgumentParser()
p.add_argument("--json", required=True)
args = p.parse_args()
rows = []

for t in (2048, 8192):
    q = torch.randn(1, 32, t, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, t, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, t, 128, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    flops = 4 * t * t / 2 * 32 * 128
    rows.append({"suite": "peers", "check": f"PyTorch SDPA causal GQA 32q/8kv d128 T={t} "
                 f"({flops / ms / 1e9:.0f} TFLOP/s)", "measured": f"{ms:.3f} ms",
                 "bound": "reported", "pass": True, "value": ms})
# Decode: one query token a sequence against 2048 cached tokens, KV contiguous.
for b in (1, 64, 256):
    L = 2048
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 8, L + 1, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, 8, L + 1, 128, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    tbs = 2 * k.numel() * 2 / (ms * 1e-3) / 1e12
    rows.append({"suite": "peers", "check": f"PyTorch SDPA decode GQA 32q/8kv d128 bs{b} ctx{L} "
                 f"contiguous KV ({tbs:.2f} TB/s)", "measured": f"{ms * 1e3:.1f} µs",
                 "bound": "reported", "pass": True, "value": ms})
json.dump({"rows": rows}, open(args.json, "w"), indent=1)
for r in rows:
    print(r["check"], r["measured"])
