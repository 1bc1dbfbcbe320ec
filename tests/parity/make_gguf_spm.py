"""A tiny Llama GGUF with a SentencePiece vocabulary, and what transformers makes of it.

Writes `tests/fixtures/gguf/tiny-llama-spm.gguf` and `tests/fixtures/gguf/tiny-llama-spm-reference.json`:

1. A SentencePiece BPE model trained here on a fixed text (byte fallback on, `<unk>` `<s>` `</s>`
   control tokens, two user-defined symbols), stored the way llama.cpp's converter stores a
   `tokenizer.model`: `tokenizer.ggml.model = "llama"`, each piece with its score and token type
   (normal, unknown, control, user-defined, byte), BOS/EOS/UNK ids, `add_bos_token`.
2. A seeded random two-layer Llama (GQA) with that vocabulary, q/k rows permuted as llama.cpp's
   converter permutes them, F32 tensors.
3. transformers loading that file (`gguf_file=...`, its own SentencePiece rebuild): token ids of a
   few texts, greedy continuations (ids and text), and the last position's logits of one prompt.

    pip install gguf sentencepiece torch transformers
    python3 tests/parity/make_gguf_spm.py

Deterministic: seeded, CPU, float32, one thread.
"""

import io
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "gguf"
GGUF_NAME = "tiny-llama-spm.gguf"
REFERENCE_NAME = "tiny-llama-spm-reference.json"

CORPUS = """\
The sea was calm that morning, and the boats went out before the sun rose over the hills.
A small model learns to split words into pieces: frequent pieces become tokens, rare ones fall
back to bytes. Numbers like 12, 345 and 6789 appear now and then, as do names such as Paris,
Lisbon and Oslo. She said: "Why is the sky blue?" He answered that light scatters in the air.
Serving engines batch requests, cache prefixes and stream tokens back to their clients.
The quick brown fox jumps over the lazy dog; the lazy dog sleeps on in the warm afternoon.
Hello world, hello again, and welcome to the tiny vocabulary of a tiny model.
"""

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces\nand a newline",
    "naïve café, 東京! ☃",
    "<|user|>Why is the sky blue?<|assistant|>",
    "literal <s>control tokens</s> and <unk>",
    "numbers 12345 and tabs\tinside",
]
PROMPTS = ["The sea was", "Serving engines batch", "<|user|>Hello<|assistant|>"]
MAX_NEW_TOKENS = 16
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_spm() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 4),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<|user|>", "<|assistant|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def vocabulary(proto: bytes):
    """Pieces, scores and llama.cpp token types, as the converter reads a `tokenizer.model`."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        ty = T.NORMAL
        if sp.IsUnknown(i):
            ty = T.UNKNOWN
        elif sp.IsControl(i):
            ty = T.CONTROL
        elif sp.IsUnused(i):
            ty = T.UNUSED
        elif sp.IsByte(i):
            ty = T.BYTE
        elif sp.id_to_piece(i) in ("<|user|>", "<|assistant|>"):
            ty = T.USER_DEFINED
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.GetScore(i))
        types.append(int(ty))
    return tokens, scores, types


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, tokens, scores, types) -> None:
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    state = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-spm")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(TEMPLATE)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for hf, value in state.items():
        if hf in names:
            name = names[hf]
        else:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{parts[part]}.{kind}"
        if name.endswith("attn_q.weight"):
            value = permute(value, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            value = permute(value, cfg.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(path: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    tokenize = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        tokenize.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=True),
            }
        )
    generations = []
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
        new = out[0, len(ids) :].tolist()
        generations.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "output_ids": new,
                "text": tok.decode(new, skip_special_tokens=True),
            }
        )
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([generations[0]["prompt_ids"]])).logits[0, -1]
    return {
        "file": path.name,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "vocab_size": len(tok),
        "tokenize": tokenize,
        "generations": generations,
        "chat": {"messages": messages, "prompt_ids": list(chat_ids)},
        "last_logits": [float(v) for v in logits],
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = vocabulary(train_spm())
    path = OUT / GGUF_NAME
    write_gguf(path, tokens, scores, types)
    ref = reference(path)
    (OUT / REFERENCE_NAME).write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    if len(sys.argv) > 1:
        # For inspection: the tokenizer transformers built, as tokenizer.json.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        Path(sys.argv[1]).write_text(tok.backend_tokenizer.to_str(pretty=True))
    for t in ref["tokenize"]:
        print(t["text"], t["ids"])
    for g in ref["generations"]:
        print(repr(g["text"]))


if __name__ == "__main__":
    main()
