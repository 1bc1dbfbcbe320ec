#!/usr/bin/env python3
"""Train the small byte-level BPE tokenizer shared by the embedded model and the test fixtures.

How to run (from the repository root, needs the `tokenizers` Python package):

    python3 tests/parity/make_tokenizer.py            # writes host/assets/tokenizer/
    python3 tests/parity/make_tokenizer.py --out DIR  # writes somewhere else

What it writes:
    tokenizer.json         byte-level BPE, VOCAB_SIZE entries, special tokens first (ids 0..4)
    tokenizer_config.json  bos/eos/pad tokens and a ChatML `chat_template`
    tests/fixtures/tokenizer/cases.json
                           golden encode/decode/chat-template cases computed by the Python
                           `tokenizers` package and transformers' apply_chat_template (jinja2)
                           from the saved files (skipped if transformers is not installed)

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


ENCODE_TEXTS = [
    "",
    "hello world",
    "def main():\n    return 42\n",
    "  leading spaces,\ttabs\tand\n\nblank lines  ",
    "unicode: caf\u00e9 na\u00efve \u2713 \u65e5\u672c\u8a9e \U0001f600",
    "special tokens inside text: <|im_start|>user\nhi<|im_end|> <|eos|>",
    "numbers 1234567890 and symbols !@#$%^&*()[]{}",
]

CHATS = [
    ("user only", [{"role": "user", "content": "What is 2 + 2?"}]),
    ("system and user", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ]),
    ("multi turn", [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello \u2014 how can I help?"},
        {"role": "user", "content": "Tell me a joke\nabout code."},
    ]),
]


def write_cases(tok_dir, out_path):
    """Golden tokenizer cases for the Rust tokenizer and chat-template code."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("transformers not installed: tests/fixtures/tokenizer/cases.json not rewritten")
        return
    hf = AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    encode = []
    for text in ENCODE_TEXTS:
        ids = raw.encode(text, add_special_tokens=True).ids
        assert ids == hf(text)["input_ids"], text
        encode.append({
            "text": text,
            "ids": ids,
            "decoded": raw.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": raw.decode(ids, skip_special_tokens=True),
        })
    chat = []
    for name, messages in CHATS:
        for gen in (False, True):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            chat.append({
                "name": name,
                "messages": messages,
                "add_generation_prompt": gen,
                "text": text,
                "ids": raw.encode(text, add_special_tokens=True).ids,
            })
    cases = {
        "vocab_size": raw.get_vocab_size(),
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "encode": encode,
        "chat": chat,
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(cases, f, indent=2, ensure_ascii=False)
        f.write("\n")


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
    write_cases(args.out, os.path.join(root, "tests", "fixtures", "tokenizer", "cases.json"))


if __name__ == "__main__":
    main()
