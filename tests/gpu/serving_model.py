#!/usr/bin/env python3
"""Writes a model folder for serving benchmarks with dummy weights: the given config.json and a
word-level tokenizer.json that covers the config's whole vocabulary (token i is a lowercase word
spelling i in base 26), so that every id a random-weight model samples decodes to text and
`chimera bench` can build prompts from plain words.

    python3 tests/gpu/serving_model.py tests/gpu/configs/nemotron-h-8b /tmp/nemotron-h-8b [MAX_POSITIONS]
"""
import json
import sys
from pathlib import Path


def word(i: int) -> str:
    letters = ""
    while True:
        letters = chr(ord("a") + i % 26) + letters
        i //= 26
        if i == 0:
            return "q" + letters


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    config = json.loads((src / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    dst.mkdir(parents=True, exist_ok=True)
    text = (src / "config.json").read_text()
    if len(sys.argv) > 3:
        # A longer context than the published one (a full-length prompt plus its answer).
        config["max_position_embeddings"] = int(sys.argv[3])
        text = json.dumps(config, indent=1)
    (dst / "config.json").write_text(text)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {word(i): i for i in range(vocab)},
            "unk_token": word(0),
        },
    }
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    # A plain chat template: Dynamo's frontend registers a model for chat only with one.
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (dst / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    print(f"{dst}: config.json, a {vocab}-word tokenizer.json and a plain chat template")


if __name__ == "__main__":
    main()
