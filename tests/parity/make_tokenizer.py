#!/usr/bin/env python3
"""Train the small byte-level BPE tokenizer shared by the embedded model and the test fixtures.

How to run (from the repository root, needs the `tokenizers` Python package):

    python3 tests/parity/make_tokenizer.py            # writes host/assets/tokenizer/
    python3 tests/parity/make_tokenizer.py --out DIR  # writes somewhere else

What it writes:
    tokenizer.json         byte-level BPE, VOCAB_SIZE entries, special tokens first (ids 0..4)
    tokenizer_config.json  bos/eos/pad tokens and a ChatML `chat_template`

The training text is the top-level modules of the running Python's standard library, read in
sorted order, so the result depends only on the Python version and the `tokenizers` version.
The fixture generator (make_fixtures.py) copies these two files into every fixture model.
"""

import argparse
import json
import os
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
# At most this many bytes of training text; enough for a stable 512-entry merge table.
MAX_CORPUS_BYTES = 4 * 1024 * 1024

# ChatML. Each message becomes `<|im_start|>{role}\n{content}<|im_end|>\n`; with
# add_generation_prompt the prompt ends with `<|im_start|>assistant\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def corpus_files():
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))
    total = 0
    for name in names:
        path = os.path.join(stdlib, name)
        size = os.path.getsize(path)
        if total + size > MAX_CORPUS_BYTES:
            break
        total += size
        yield path


def corpus_lines():
    for path in corpus_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f


def build():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok


def tokenizer_config():
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(root, "host", "assets", "tokenizer"))
    args = ap.parse_args()
    tok = build()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    sample = "def main():\n    print('hello, world')  # ünïcödé ✓\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()}, '{sample!r}' -> {len(tok.encode(sample).ids)} tokens")


if __name__ == "__main__":
    main()
