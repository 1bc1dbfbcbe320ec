#!/usr/bin/env python3
"""Writes a model folder for the constrained-serving benchmark: a full-size config (Llama-3-8B's
shape by default) with dummy weights, and a byte-level BPE tokenizer trained here on the
repository's own text and the Python standard library's sources with `tokenizers` (a
vocabulary the size of SmolLM2's, 49,152 tokens, so
that the constraint plugin's masks cost what they cost on a real vocabulary), its size written
into the config as the model's vocabulary, `<|endoftext|>` (id 0) as EOS.

    python3 tests/gpu/constrained_model.py /tmp/constrained-model [--config DIR] [--vocab N]

Needs the `tokenizers` package (the GPU machine's Python has it). The training is
deterministic for a given tree and Python: the same files, in sorted order.
"""
import argparse
import json
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def corpus():
    """The repository's source and prose, then the standard library's modules, in sorted order
    (build outputs and installed packages left out)."""
    skip = {".git", ".gpu", ".dyn", "target", "node_modules", "__pycache__", "site-packages",
            "dist-packages"}
    for root, suffixes in ((ROOT, {".rs", ".md", ".py", ".toml", ".wit", ".cu", ".sh"}),
                           (Path(sysconfig.get_paths()["stdlib"]), {".py"})):
        for path in sorted(root.rglob("*")):
            if any(part in skip for part in path.relative_to(root).parts):
                continue
            if path.is_file() and path.suffix in suffixes and utf8(path):
                yield str(path)


def utf8(path):
    try:
        path.read_bytes().decode("utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dst")
    p.add_argument("--config", default=str(ROOT / "tests/gpu/configs/llama-3-8b"))
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = list(corpus())
    tok.train(files, trainer)
    dst = Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    size = tok.get_vocab_size()
    config = json.loads(Path(args.config, "config.json").read_text())
    config["vocab_size"] = size
    config["bos_token_id"] = 0
    config["eos_token_id"] = 0
    config.pop("pad_token_id", None)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "model_max_length": config.get("max_position_embeddings", 8192)}))
    print(f"{dst}: {Path(args.config).name}'s config with a {size}-token byte-level BPE "
          f"tokenizer trained on {len(files)} files")


if __name__ == "__main__":
    main()
