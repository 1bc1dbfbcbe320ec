#!/usr/bin/env python3
"""Build FP8 checkpoints of three fixture models, in the forms FP8 releases publish, and their
reference outputs.

How to run (from the repository root, after make_fixtures.py; needs torch, transformers,
safetensors):

    OMP_NUM_THREADS=1 python3 tests/parity/make_fp8_fixtures.py

What it writes (tests/fixtures/models/<name>/, read by the same parity tests as every fixture):
    llama-gqa-fp8-block       quant_method "fp8" (transformers' fine-grained FP8, the Qwen3.5 /
                              Qwen3-Next / DeepSeek form): e4m3 weights with `weight_scale_inv`
                              per 16 × 16 block (128 × 128 in releases; 16 here so that the tiny
                              matrices hold several blocks, partial ones included), and one
                              projection left in float32 through `modules_to_not_convert`
    nemotronh-a-fp8-channel   quant_method "compressed-tensors", float 8-bit weights with the
                              `channel` strategy: `weight_scale` [out, 1] in bf16 (Mamba2
                              in/out projections, attention, MLP and expert projections)
    qwen3next-a-fp8-block     quant_method "fp8" with 16 × 16 blocks on a Gated DeltaNet + MoE
                              hybrid, the router, shared-expert gate and `in_proj_ba` left
                              unquantized as the published Qwen3-Next FP8 checkpoint lists
                              them, and every unquantized tensor stored in bf16 as there

The reference is what the FP8 checkpoint means: each quantized weight dequantized exactly
(`code · scale` in float32), loaded into transformers in float32 and run with the same prompts
and cases as make_fixtures.py's references (schema in tests/fixtures/README.md). Quantization
rounds to nearest even after dividing by the scale `max|block| / 448` (torch's float8_e4m3fn
cast, after clamping to ±448). Seeded and deterministic like make_fixtures.py.
"""

import json
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

E4M3_MAX = 448.0

# The projections an FP8 release quantizes (everything else stays as it was).
PROJECTIONS = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj|out_proj|"
    r"in_proj_qkvz|in_proj_ba)\.weight$"
)

FP8 = [
    dict(
        name="llama-gqa-fp8-block",
        source="llama-gqa",
        scheme="block",
        block=16,
        config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                    weight_block_size=[16, 16],
                    modules_to_not_convert=["lm_head", "model.layers.1.mlp.down_proj"]),
        covers="FP8 checkpoint (quant_method fp8, 16x16 block scales `weight_scale_inv`, a "
               "module kept in float32 by modules_to_not_convert) on a dense model",
    ),
    dict(
        name="nemotronh-a-fp8-channel",
        source="nemotronh-a",
        scheme="channel",
        config=dict(
            quant_method="compressed-tensors", format="float-quantized",
            config_groups=dict(group_0=dict(
                targets=["Linear"],
                weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True,
                             dynamic=False),
                input_activations=dict(num_bits=8, type="float", strategy="token",
                                       dynamic=True))),
            ignore=["lm_head", "re:.*mixer\\.gate$"]),
        covers="FP8 checkpoint (compressed-tensors, channel-wise bf16 `weight_scale`) on a "
               "Mamba2 / attention / MoE hybrid",
    ),
    dict(
        name="qwen3next-a-fp8-block",
        source="qwen3next-a",
        scheme="block",
        block=16,
        config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                    weight_block_size=[16, 16],
                    modules_to_not_convert=["lm_head", "mlp.gate", "mlp.shared_expert_gate",
                                            "linear_attn.in_proj_ba"]),
        rest="bfloat16",
        covers="FP8 checkpoint (quant_method fp8, 16x16 block scales) on a Gated DeltaNet + "
               "MoE hybrid: regrouped and stacked FP8 weights, kept gates, every other tensor "
               "in bf16 as releases store them (in_proj_qkvz FP8 beside a bf16 in_proj_ba)",
    ),
]


def to_e4m3(x):
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(w, scheme, block):
    """(codes, scales, dequantized) of a [rows, cols] float32 weight."""
    rows, cols = w.shape
    if scheme == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        # The checkpoint stores bf16 scales: quantize with the stored value.
        s = s.to(torch.bfloat16)
        codes = to_e4m3(w / s.float())
        return codes, s, codes.float() * s.float()
    br, bc = -(-rows // block), -(-cols // block)
    s = torch.ones(br, bc)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    deq = torch.empty(rows, cols)
    for i in range(br):
        for j in range(bc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = tile.abs().max()
            sc = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            s[i, j] = sc
            q = to_e4m3(tile / sc)
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = q
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = q.float() * sc
    return codes, s, deq


def kept(name, keep):
    module = name[: -len(".weight")]
    for k in keep:
        if k.startswith("re:"):
            if re.fullmatch(k[3:], module):
                return True
        elif module == k or module.endswith("." + k) or module.startswith(k + "."):
            return True
    return False


def make(spec, index):
    src = os.path.join(mf.OUT_MODELS, spec["source"])
    out = os.path.join(mf.OUT_MODELS, spec["name"])
    files = sorted(f for f in os.listdir(src) if f.startswith("model") and f.endswith(".safetensors"))
    assert files == ["model.safetensors"], f"{src}: one unsharded file expected"
    tensors = load_file(os.path.join(src, "model.safetensors"))
    keep = spec["config"].get("modules_to_not_convert") or spec["config"].get("ignore") or []
    fp8, exact = {}, {}
    quantized = 0
    for name, t in sorted(tensors.items()):
        if PROJECTIONS.search(name) and t.dim() == 2 and not kept(name, keep):
            codes, s, deq = quantize(t.float(), spec["scheme"], spec.get("block"))
            fp8[name] = codes.contiguous()
            key = "_scale_inv" if spec["config"]["quant_method"] == "fp8" else "_scale"
            fp8[name + key] = s.contiguous()
            exact[name] = deq.contiguous()
            quantized += 1
        elif spec.get("rest"):
            stored = t.to(getattr(torch, spec["rest"]))
            fp8[name] = stored.contiguous()
            exact[name] = stored.float().contiguous()
        else:
            fp8[name] = t
            exact[name] = t
    assert quantized > 0
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    # The reference model: the exact values, loaded the way make_fixtures.py's are.
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(src):
            if f.endswith(".json") and not f.startswith("reference"):
                shutil.copyfile(os.path.join(src, f), os.path.join(tmp, f))
        save_file(exact, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for f in os.listdir(src):
        if f.endswith(".json") and not f.startswith("reference") and f != "config.json":
            shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    config["quantization_config"] = spec["config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(fp8, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    ref_spec = dict(name=spec["name"], cls=type(model), covers=spec["covers"],
                    dtype="float8_e4m3fn", shards=1, legacy_config=None)
    report = mf.make_references(ref_spec, index, model, out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{spec['name']}: {quantized} FP8 weights, {size / 1024:.0f} KiB")
    for r in report:
        print("   ", json.dumps(r))


def main():
    torch.set_num_threads(1)
    for i, spec in enumerate(FP8):
        make(spec, 200 + i)


if __name__ == "__main__":
    main()
