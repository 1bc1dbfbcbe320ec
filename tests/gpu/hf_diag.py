#!/usr/bin/env python3
"""Why transformers' bf16 is far off the f32 reference on some fixtures: transformers' error
against reference.safetensors per prompt length in f32 (GPU and CPU), in bf16, with only the
weights rounded to bf16 (f32 arithmetic), with the Mamba2 mixers kept in f32 inside the bf16
model, and per layer (bf16 hidden states against f32 ones). Prints; writes nothing else."""
import copy
import inspect
import json
import os
import re
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/models"
names = sys.argv[2:] or ["bamba-b", "mamba2-g2", "bamba-a", "mamba2-g1", "nemotronh-a"]
print("torch", torch.__version__, "transformers", transformers.__version__)
for mod in ["mamba_ssm", "causal_conv1d", "kernels"]:
    try:
        __import__(mod)
        print(mod, "importable")
    except Exception as e:  # noqa: BLE001
        print(mod, "not importable:", type(e).__name__)


def err(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def run(model, dev, prompt):
    with torch.no_grad():
        return model(torch.tensor(prompt, device=dev)[None]).logits[0].float().cpu().numpy()


def mixers(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Mixer")]


for name in names:
    d = os.path.join(root, name)
    meta = json.load(open(os.path.join(d, "reference.json")))
    ref = load_file(os.path.join(d, "reference.safetensors"))
    print(f"\n== {name}: {meta.get('covers', '')}")
    variants = {}
    try:
        variants["f32 cuda"] = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval(), "cuda")
        variants["f32 cpu"] = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), "cpu")
        variants["bf16 cuda"] = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval(), "cuda")
        w = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            for p in w.parameters():
                p.copy_(p.bfloat16().float())
        variants["bf16 weights, f32 math"] = (w, "cuda")
        mx = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        for _, m in mixers(mx):
            m32 = copy.deepcopy(m).float()
            def fwd(hidden_states, *a, _m=m32, **k):
                out = _m(hidden_states.float(), *a, **k)
                return out.to(torch.bfloat16) if torch.is_tensor(out) else out
            m.forward = fwd
        variants["bf16, mixers in f32"] = (mx, "cuda")
    except Exception as e:  # noqa: BLE001
        print("  load failed:", type(e).__name__, e)
    b = variants.get("bf16 cuda", (None,))[0]
    if b is not None:
        for n, m in mixers(b)[:1]:
            print("  mixer", n, type(m).__name__, "n_groups", getattr(m, "n_groups", None),
                  "norm", type(getattr(m, "norm", None)).__name__,
                  "group_size", getattr(getattr(m, "norm", None), "group_size", None))
            try:
                src = inspect.getsource(type(m).torch_forward)
                keep = [l.strip() for l in src.splitlines()
                        if re.search(r"dtype|float\(|bfloat|clamp|softplus|exp\(", l)]
                print("  torch_forward lines with casts/exp/clamp:")
                for l in keep[:30]:
                    print("    ", l)
            except Exception as e:  # noqa: BLE001
                print("  no torch_forward source:", type(e).__name__)
    for label, (model, dev) in variants.items():
        errs = []
        for n in meta["prompt_lengths"]:
            pos = ref[f"positions_{n}"].astype(np.int64)
            want = ref[f"logits_{n}"].reshape(len(pos), -1)
            try:
                got = run(model, dev, ref[f"prompt_{n}"].astype(np.int64))[pos]
                errs.append(f"{n}:{err(got, want):.2e}")
            except Exception as e:  # noqa: BLE001
                errs.append(f"{n}:error {type(e).__name__}")
        print(f"  {label:<24} " + "  ".join(errs))
    if "f32 cuda" in variants and b is not None:
        n = max(meta["prompt_lengths"])
        ids = torch.tensor(ref[f"prompt_{n}"].astype(np.int64), device="cuda")[None]
        with torch.no_grad():
            h32 = variants["f32 cuda"][0](ids, output_hidden_states=True).hidden_states
            h16 = b(ids, output_hidden_states=True).hidden_states
        per = []
        for i, (x, y) in enumerate(zip(h16, h32)):
            x, y = x.float(), y.float()
            per.append(f"{i}:{float((x - y).abs().max() / y.abs().max()):.1e}(|h| {float(y.abs().max()):.1f})")
        print("  hidden states bf16 vs f32, per layer (max|Δ|/max|ref|):", " ".join(per))
        pos = ref[f"positions_{n}"].astype(np.int64)
        want = ref[f"logits_{n}"].reshape(len(pos), -1)
        got = run(b, "cuda", ref[f"prompt_{n}"].astype(np.int64))[pos]
        worst = np.abs(got - want).max(axis=1)
        print("  bf16 per recorded position: max|Δ| ", np.array2string(worst, precision=2),
              " max|ref| ", np.array2string(np.abs(want).max(axis=1), precision=1))
