#!/usr/bin/env python3
"""bf16 parity: chimera's bf16 logits (dumped by `chimera gpu-check --suite parity --dump`)
against the fixture's f32 reference, bounded by 2× the error transformers' own bf16 shows on
this GPU against the same reference. Error = max |Δlogit| over the reference's largest
magnitude, at the recorded positions."""
import argparse
import glob
import json
import os

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--fixtures", required=True)
p.add_argument("--dump", required=True)
p.add_argument("--json", required=True)
args = p.parse_args()


def err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


rows = []
for d in sorted(glob.glob(os.path.join(args.fixtures, "*"))):
    name = os.path.basename(d)
    if not os.path.exists(os.path.join(d, "reference.json")):
        continue
    if not glob.glob(os.path.join(args.dump, f"{name}_*.f32")):
        continue  # this run did not dump the fixture (its suite did not run)
    meta = json.load(open(os.path.join(d, "reference.json")))
    ref = load_file(os.path.join(d, "reference.safetensors"))
    try:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    except Exception as e:  # an architecture this transformers version lacks: say so
        rows.append({"suite": "parity", "check": f"{name} bf16 vs transformers: SKIPPED "
                     f"(transformers cannot load it here: {type(e).__name__})", "measured": "skipped",
                     "bound": "-", "pass": True, "value": float("nan")})
        print(rows[-1]["check"])
        continue
    worst_ours, worst_hf = 0.0, 0.0
    for n in meta["prompt_lengths"]:
        prompt = ref[f"prompt_{n}"].astype(np.int64)
        pos = ref[f"positions_{n}"].astype(np.int64)
        want = ref[f"logits_{n}"].reshape(len(pos), -1)
        vocab = want.shape[1]
        dump = os.path.join(args.dump, f"{name}_{n}.f32")
        ours = np.fromfile(dump, dtype=np.float32).reshape(-1, vocab)[pos]
        with torch.no_grad():
            theirs = hf(torch.tensor(prompt, device="cuda")[None]).logits[0].float().cpu().numpy()[pos]
        worst_ours = max(worst_ours, err(ours, want))
        worst_hf = max(worst_hf, err(theirs, want))
    bound = 2 * worst_hf
    rows.append({"suite": "parity", "check": f"{name} bf16 logits vs f32 reference "
                 f"(transformers bf16 on this GPU: {worst_hf:.2e})", "measured": f"{worst_ours:.2e}",
                 "bound": f"≤ {bound:.2e}", "pass": worst_ours <= bound, "value": worst_ours})
    print(rows[-1]["check"], rows[-1]["measured"], rows[-1]["bound"])
json.dump({"rows": rows}, open(args.json, "w"), indent=1)
