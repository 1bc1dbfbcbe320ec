#!/usr/bin/env python3
"""Give two Gated DeltaNet fixtures an MTP head and write what the head drafts (NumPy, float64).

How to run (from the repository root; needs only NumPy):

    python3 tests/parity/make_mtp_fixtures.py

For each base fixture below it writes tests/fixtures/models/<base>-mtp/: the base's files with
`mtp.*` tensors added to model.safetensors (the layout of the published Qwen3.5 / Qwen3-Next
checkpoints) and the config's MTP layer count, plus mtp-reference.json:

    prompts[i].prompt        prompt token ids (the base fixture's reference prompts)
    prompts[i].greedy        the target's greedy continuation (the float64 model of
                             check_references.py, which reproduces transformers' logits)
    prompts[i].drafts[L]     the head's greedy chain of `k` drafts when the request holds the
                             first L tokens of prompt + greedy (the last one sampled, not yet
                             run through the target), for every L from len(prompt) + 1 on
    prompts[i].min_margin    the smallest top-1 / top-2 logit gap of those drafts

The head (transformers does not implement it; its checkpoint tensors are ignored there):
for position p, x = fc([norm_e(embed(t[p+1])) ; norm_h(h[p])]) with h the target's hidden
state after its final norm, one decoder layer (gated full attention with its own KV at
position p, then the MLP or MoE the checkpoint has), o = norm(x), logits = lm_head(o); a chain
feeds o back as the hidden state of the next position together with the draft just made.
Every norm scales by (1 + w).

The head's weights are seeded: its attention and channel mixer are the base model's full
attention layer perturbed by noise of the same scale; qwen35-a's head also passes the token's
embedding through (an "echo" head, see head_tensors), so that some of its drafts are accepted.
Running the script twice gives the same bytes.
"""

import json
import os
import shutil
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_references as cr  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "models")
K = 3
GREEDY = 12
BASES = [
    # (base fixture, config key of the MTP layer count, expert layout of an MoE head, style)
    ("qwen35-a", "mtp_num_hidden_layers", None, "echo"),
    ("qwen3next-a", "num_nextn_predict_layers", "one_by_one", "perturbed"),
]


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        raw = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def head_tensors(w, cfg, layout, style, rng):
    """The mtp.* tensors: fc, three norms, and the base's full-attention layer perturbed.

    "echo" (a model with tied embeddings): fc passes the normalised embedding through and the
    layer's outputs are scaled down, so the head mostly drafts the token it was fed — which
    tiny random models, repeating themselves, often generate next: drafts get accepted."""
    h = cfg["hidden_size"]
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"][-1]
    src = f"model.layers.{full}."
    out = {
        "mtp.fc.weight": rng.normal(0.0, 1.0 / np.sqrt(2 * h), (h, 2 * h)),
        "mtp.pre_fc_norm_embedding.weight": rng.normal(0.0, 0.1, h),
        "mtp.pre_fc_norm_hidden.weight": rng.normal(0.0, 0.1, h),
        "mtp.norm.weight": rng.normal(0.0, 0.1, h),
    }
    for name, v in w.items():
        if not name.startswith(src):
            continue
        rest = name[len(src):]
        if rest.endswith("layernorm.weight") or rest.endswith("_norm.weight"):
            noisy = v + rng.normal(0.0, 0.1, v.shape)
        else:
            noisy = v + rng.normal(0.0, float(np.std(v)) or 0.02, v.shape)
        if layout == "one_by_one" and rest == "mlp.experts.gate_up_proj":
            inter = noisy.shape[1] // 2
            for e in range(noisy.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = noisy[e, :inter]
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = noisy[e, inter:]
            continue
        if layout == "one_by_one" and rest == "mlp.experts.down_proj":
            for e in range(noisy.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = noisy[e]
            continue
        if style == "echo" and rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            noisy = 0.1 * noisy
        out["mtp.layers.0." + rest] = noisy
    if style == "echo":
        out["mtp.fc.weight"] = np.concatenate(
            [np.eye(h) + rng.normal(0.0, 0.05, (h, h)), rng.normal(0.0, 0.05, (h, h))], axis=1)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{n}.weight"] = rng.normal(0.0, 0.02, h)
    return out


class Head:
    """The MTP head, one position at a time, with its own attention KV."""

    def __init__(self, w, cfg, emb, lm_head):
        text = dict(cfg)
        eps = cfg["rms_norm_eps"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rope = dict(cfg["rope"])
        rope.setdefault("partial_rotary_factor", 0.25)
        inv = cr.rope_inv_freq(hd, rope)
        self.attn = cr.GatedAttention(w, "mtp.layers.0.self_attn", cfg["num_attention_heads"],
                                      cfg["num_key_value_heads"], hd, inv, eps)
        if "mtp.layers.0.mlp.gate.weight" in w:
            self.ffn = cr.qwen_moe(w, "mtp.layers.0.mlp", text,
                                   cfg["architectures"][0].startswith("Qwen3_5Moe")
                                   or cfg.get("norm_topk_prob", True))
        else:
            self.ffn = cr.swiglu(w, "mtp.layers.0.mlp")
        self.w, self.eps, self.emb, self.lm_head = w, eps, emb, lm_head

    def norm(self, name, x):
        return cr.rms_norm(x, 1.0 + self.w[name], self.eps)

    def step(self, hidden, token, pos):
        """Writes KV at `pos`; returns (normalised output, logits)."""
        e = self.norm("mtp.pre_fc_norm_embedding.weight", self.emb[token])
        hn = self.norm("mtp.pre_fc_norm_hidden.weight", hidden)
        x = self.w["mtp.fc.weight"] @ np.concatenate([e, hn])
        x = x + self.attn.step(self.norm("mtp.layers.0.input_layernorm.weight", x), pos)
        x = x + self.ffn(self.norm("mtp.layers.0.post_attention_layernorm.weight", x))
        o = self.norm("mtp.norm.weight", x)
        return o, self.lm_head @ o

    def chain(self, hidden, token, pos, k):
        """`k` greedy drafts from (hidden of `pos`, the token after it); the chain's KV is
        dropped again (the real values replace it once the target has run those positions)."""
        kept = len(self.attn.keys)
        drafts, margins = [], []
        for j in range(k):
            hidden, logits = self.step(hidden, token, pos + j)
            top = np.argsort(-logits, kind="stable")[:2]
            drafts.append(int(top[0]))
            margins.append(float(logits[top[0]] - logits[top[1]]))
            token = drafts[-1]
        del self.attn.keys[kept:], self.attn.values[kept:]
        return drafts, min(margins)


def target_hidden(model, token):
    """One target step: (final normalised hidden state, logits)."""
    x = model.emb[token] * model.emb_mult
    for block in model.blocks:
        for norm_w, mixer in block:
            x = x + mixer.step(cr.rms_norm(x, norm_w, model.eps), model.pos)
    model.pos += 1
    hn = cr.rms_norm(x, model.norm_f, model.eps)
    return hn, (model.head @ hn) * model.logits_mult


def reference(path, prompt):
    cfg = cr.load_config(path)
    w = cr.load_weights(path)
    model = cr.Model(path)
    model.fresh()
    head = Head(w, cfg, model.emb, model.head)
    seq = [int(t) for t in prompt]
    hidden = []
    for t in seq:
        hn, logits = target_hidden(model, t)
        hidden.append(hn)
    greedy = []
    drafts, worst = {}, float("inf")
    for _ in range(GREEDY):
        nxt = int(np.argmax(logits))
        greedy.append(nxt)
        seq.append(nxt)
        # The head has run every position but the last computed one; it runs that one now,
        # with the token just sampled, and drafts from it.
        p = len(seq) - 2
        for q in range(len(head.attn.keys), p):
            head.step(hidden[q], seq[q + 1], q)
        d, m = head.chain(hidden[p], seq[p + 1], p, K)
        drafts[str(len(seq))] = d
        worst = min(worst, m)
        hn, logits = target_hidden(model, nxt)
        hidden.append(hn)
    return {"prompt": [int(t) for t in prompt], "greedy": greedy, "drafts": drafts,
            "min_margin": worst}


def build(base, key, layout, style):
    src = os.path.join(MODELS, base)
    dst = os.path.join(MODELS, base + "-mtp")
    os.makedirs(dst, exist_ok=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if os.path.exists(os.path.join(src, f)):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config[key] = 1
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    base_w = cr.read_safetensors(os.path.join(src, "model.safetensors"))
    cfg = cr.load_config(src)
    rng = np.random.default_rng(20261208)
    tensors = {k: v.astype(np.float64) for k, v in base_w.items()}
    tensors.update(head_tensors(tensors, cfg, layout, style, rng))
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    ref = cr.read_safetensors(os.path.join(src, "reference.safetensors"))
    cases = [reference(dst, ref[f"prompt_{n}"]) for n in ("7", "33")]
    out = {"name": base + "-mtp", "base": base, "k": K, "prompts": cases}
    with open(os.path.join(dst, "mtp-reference.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    hits = sum(d[0] == c["greedy"][int(n) - len(c["prompt"])]
               for c in cases for n, d in c["drafts"].items()
               if int(n) - len(c["prompt"]) < len(c["greedy"]))
    print(f"{base}-mtp: min draft margin {min(c['min_margin'] for c in cases):.4f}, "
          f"first drafts that are the next greedy token: {hits}")


def main():
    for base, key, layout, style in BASES:
        build(base, key, layout, style)


if __name__ == "__main__":
    main()
