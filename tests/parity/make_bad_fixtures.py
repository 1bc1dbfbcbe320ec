#!/usr/bin/env python3
"""Write broken model folders for the loader's error tests (tests/fixtures/bad/<case>/).

Run through make_fixtures.py (`python3 tests/parity/make_fixtures.py --bad-only`), or alone:

    python3 tests/parity/make_bad_fixtures.py

Every case starts from the same tiny valid Llama checkpoint (hidden 8, one layer, vocab 512,
tied embeddings, float32), written to `ok-baseline/`, and differs from it by exactly one defect,
so a test can check that the baseline loads and that each case fails for its own reason. The
cases are listed (with the error a loader should report) in CASES and tests/fixtures/README.md.
"""

import json
import os
import shutil
import struct
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIR = os.path.join(ROOT, "host", "assets", "tokenizer")

# case name -> what is wrong (also the README's table)
CASES = {
    "ok-baseline": "nothing: a valid checkpoint every other case is derived from",
    "missing-config": "config.json is absent",
    "config-not-json": "config.json is not valid JSON (cut off mid-object)",
    "unsupported-arch": 'config.json says architectures ["GPT2LMHeadModel"], model_type "gpt2"',
    "wrong-shape": "model.layers.0.self_attn.k_proj.weight is [8, 8] instead of [4, 8]",
    "wrong-dtype": "model.norm.weight is stored as I32 instead of a float type",
    "missing-tensor": "model.layers.0.mlp.down_proj.weight is absent",
    "truncated": "model.safetensors is cut to half its length (data ends early)",
    "corrupt-header": "model.safetensors header length field claims 2^40 bytes",
    "missing-shard": "model.safetensors.index.json maps tensors to a shard file that is absent",
}


def base_model():
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).float()


def fresh(out, case, base):
    path = os.path.join(out, case)
    shutil.copytree(base, path)
    return path


def edit_config(path, fn):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def edit_tensors(path, fn):
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    fn(tensors)
    save_file(tensors, st, metadata={"format": "pt"})


def write_all(out):
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        base_model().save_pretrained(base)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(TOKENIZER_DIR, f), os.path.join(base, f))
        gen_cfg = os.path.join(base, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)

        fresh(out, "ok-baseline", base)

        p = fresh(out, "missing-config", base)
        os.remove(os.path.join(p, "config.json"))

        p = fresh(out, "config-not-json", base)
        with open(os.path.join(p, "config.json")) as f:
            text = f.read()
        with open(os.path.join(p, "config.json"), "w") as f:
            f.write(text[: len(text) // 2])

        p = fresh(out, "unsupported-arch", base)

        def gpt2(cfg):
            cfg["architectures"] = ["GPT2LMHeadModel"]
            cfg["model_type"] = "gpt2"

        edit_config(p, gpt2)

        p = fresh(out, "wrong-shape", base)

        def widen_k(t):
            k = "model.layers.0.self_attn.k_proj.weight"
            assert tuple(t[k].shape) == (4, 8), t[k].shape
            t[k] = torch.zeros(8, 8)

        edit_tensors(p, widen_k)

        p = fresh(out, "wrong-dtype", base)

        def int_norm(t):
            t["model.norm.weight"] = torch.ones(8, dtype=torch.int32)

        edit_tensors(p, int_norm)

        p = fresh(out, "missing-tensor", base)
        edit_tensors(p, lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))

        p = fresh(out, "truncated", base)
        st = os.path.join(p, "model.safetensors")
        with open(st, "rb") as f:
            data = f.read()
        with open(st, "wb") as f:
            f.write(data[: len(data) // 2])

        p = fresh(out, "corrupt-header", base)
        st = os.path.join(p, "model.safetensors")
        with open(st, "rb") as f:
            data = f.read()
        with open(st, "wb") as f:
            f.write(struct.pack("<Q", 1 << 40) + data[8:])

        p = fresh(out, "missing-shard", base)
        st = os.path.join(p, "model.safetensors")
        tensors = load_file(st)
        os.remove(st)
        names = sorted(tensors)
        half = len(names) // 2
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        save_file({n: tensors[n] for n in names[:half]}, os.path.join(p, shards[0]),
                  metadata={"format": "pt"})
        weight_map = {n: shards[0] if i < half else shards[1] for i, n in enumerate(names)}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
            f.write("\n")

    assert sorted(os.listdir(out)) == sorted(CASES), sorted(os.listdir(out))
    print(f"bad fixtures: {', '.join(sorted(CASES))}")


if __name__ == "__main__":
    write_all(os.path.join(ROOT, "tests", "fixtures", "bad"))
