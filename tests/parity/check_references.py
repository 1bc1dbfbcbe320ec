#!/usr/bin/env python3
"""Check the fixture references against an independent, token-by-token NumPy implementation.

How to run (from the repository root; needs only numpy and safetensors, no torch):

    python3 tests/parity/check_references.py                 # every model under tests/fixtures/models
    python3 tests/parity/check_references.py nemotronh-a     # only the named models

What it does: reads each fixture's config.json (any of the accepted forms) and weights, runs
the model one token at a time in float64 (attention with a growing K/V list, Mamba2 mixers as
the plain recurrence h = exp(dt*A) h + dt * B x, never the chunked scan), and compares the
result with reference.safetensors: prompt logits at the stored positions, the 32 greedy
tokens, and the stored decode-step logits. It prints the largest differences and exits non-zero
if any logit differs by more than TOLERANCE or any greedy token differs.

This is the written-down meaning of each architecture that the Rust model code must match, and
a guard that the references do not rest on a transformers quirk (it is what found that
transformers' NemotronH clamps dt in prefill but not in decode).
"""

import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "tests", "fixtures", "models")
TOLERANCE = 1e-3


# ---------------------------------------------------------------------------------------------
# Loading


def untag(v):
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    if isinstance(v, list):
        return [untag(x) for x in v]
    return v


def load_config(path):
    with open(os.path.join(path, "config.json")) as f:
        cfg = {k: untag(v) for k, v in json.load(f).items()}  # json accepts bare Infinity
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:  # older form: top-level rope_theta (+ rope_scaling, partial_rotary_factor)
        rope = dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if "partial_rotary_factor" in cfg:
            rope["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    rope.setdefault("rope_type", rope.pop("type", "default"))
    cfg["rope"] = rope
    return cfg


NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def read_safetensors(path):
    """A minimal safetensors reader: u64 header length, JSON header, raw little-endian data.

    Written out here (rather than safetensors.numpy) because NumPy has no bfloat16: BF16 is
    widened by placing its 16 bits in the high half of a float32.
    """
    with open(path, "rb") as f:
        data = f.read()
    (n,) = np.frombuffer(data[:8], dtype="<u8")
    header = json.loads(data[8: 8 + int(n)])
    base = 8 + int(n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[base + start: base + end]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=NUMPY_DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


def load_weights(path):
    index = os.path.join(path, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    w = {}
    for name in files:
        for k, v in read_safetensors(os.path.join(path, name)).items():
            w[k] = v.astype(np.float64)
    return w


# ---------------------------------------------------------------------------------------------
# Shared layers (one token at a time; x is a 1-D vector)


def rms_norm(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def linear(w, x, prefix):
    y = w[prefix + ".weight"] @ x
    if prefix + ".bias" in w:
        y = y + w[prefix + ".bias"]
    return y


def rope_inv_freq(head_dim, rope):
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    if rope["rope_type"] == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mixed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(medium, mixed, scaled)
    elif rope["rope_type"] != "default":
        raise SystemExit(f"rope_type {rope['rope_type']} not implemented here")
    return inv


def apply_rope(x, pos, inv):
    """x: [heads, head_dim]; rotates the first 2*len(inv) dims (rotate-half pairing)."""
    rot = 2 * len(inv)
    ang = pos * inv
    cos = np.concatenate([np.cos(ang), np.cos(ang)])
    sin = np.concatenate([np.sin(ang), np.sin(ang)])
    xr, xp = x[:, :rot], x[:, rot:]
    half = rot // 2
    rotated = np.concatenate([-xr[:, half:], xr[:, :half]], axis=1)
    return np.concatenate([xr * cos + rotated * sin, xp], axis=1)


class Attention:
    """Causal self-attention with GQA; `inv` None means no positional encoding (NemotronH)."""

    def __init__(self, w, prefix, n_heads, n_kv, head_dim, inv):
        self.w, self.p = w, prefix
        self.nh, self.nkv, self.hd, self.inv = n_heads, n_kv, head_dim, inv
        self.keys, self.values = [], []
        self.scale = 1.0 / math.sqrt(head_dim)  # Granite: attention_multiplier
        self.key_mult = 1.0  # Falcon-H1: key_multiplier

    def step(self, x, pos):
        q = linear(self.w, x, self.p + ".q_proj").reshape(self.nh, self.hd)
        k = linear(self.w, x, self.p + ".k_proj").reshape(self.nkv, self.hd) * self.key_mult
        v = linear(self.w, x, self.p + ".v_proj").reshape(self.nkv, self.hd)
        if self.inv is not None:
            q, k = apply_rope(q, pos, self.inv), apply_rope(k, pos, self.inv)
        self.keys.append(k)
        self.values.append(v)
        K, V = np.stack(self.keys), np.stack(self.values)  # [t, nkv, hd]
        out = np.empty((self.nh, self.hd))
        per_kv = self.nh // self.nkv
        for h in range(self.nh):
            s = K[:, h // per_kv] @ q[h] * self.scale
            p = np.exp(s - s.max())
            out[h] = (p / p.sum()) @ V[:, h // per_kv]
        return linear(self.w, out.reshape(-1), self.p + ".o_proj")


class Mamba2Mixer:
    """The Mamba2 mixer as a recurrence: depthwise causal conv, selective SSM, gated RMSNorm."""

    def __init__(self, w, prefix, n_heads, head_dim, n_groups, state, eps, dt_min):
        self.w, self.p = w, prefix
        self.nh, self.hd, self.ng, self.n = n_heads, head_dim, n_groups, state
        self.eps, self.dt_min = eps, dt_min
        self.d_inner = n_heads * head_dim
        self.conv_w = w[prefix + ".conv1d.weight"][:, 0, :]  # [conv_dim, K]
        self.conv_b = w.get(prefix + ".conv1d.bias")
        self.conv_dim, self.k = self.conv_w.shape
        self.window = np.zeros((self.k, self.conv_dim))
        self.ssm = np.zeros((n_heads, head_dim, state))
        self.A = -np.exp(w[prefix + ".A_log"])
        self.clamped = 0
        # Falcon-H1: input multiplier, µP vector over in_proj's outputs, and the output norm
        # ("gate_then_norm" as Mamba2; "norm_then_gate"; "gate_only", no norm).
        self.in_mult, self.mup, self.out_norm = 1.0, 1.0, "gate_then_norm"

    def step(self, x, _pos):
        proj = linear(self.w, x * self.in_mult, self.p + ".in_proj") * self.mup
        z = proj[: self.d_inner]
        xbc = proj[self.d_inner: self.d_inner + self.conv_dim]
        dt = proj[self.d_inner + self.conv_dim:]
        self.window = np.concatenate([self.window[1:], xbc[None, :]])
        conv = np.einsum("kc,ck->c", self.window, self.conv_w)
        if self.conv_b is not None:
            conv = conv + self.conv_b
        conv = silu(conv)
        xs = conv[: self.d_inner].reshape(self.nh, self.hd)
        B = conv[self.d_inner: self.d_inner + self.ng * self.n].reshape(self.ng, self.n)
        C = conv[self.d_inner + self.ng * self.n:].reshape(self.ng, self.n)
        dt = softplus(dt + self.w[self.p + ".dt_bias"])
        self.clamped += int((dt < self.dt_min).sum())
        dt = np.maximum(dt, self.dt_min)
        y = np.empty((self.nh, self.hd))
        per_group = self.nh // self.ng
        for h in range(self.nh):
            g = h // per_group
            self.ssm[h] = self.ssm[h] * math.exp(dt[h] * self.A[h]) + dt[h] * np.outer(xs[h], B[g])
            y[h] = self.ssm[h] @ C[g] + self.w[self.p + ".D"][h] * xs[h]
        y = y.reshape(-1)
        if self.out_norm != "norm_then_gate":
            y = y * silu(z)
        if self.out_norm != "gate_only":
            y = y.reshape(self.ng, -1)
            y = y / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + self.eps)
            y = y.reshape(-1) * self.w[self.p + ".norm.weight"]
        if self.out_norm == "norm_then_gate":
            y = y * silu(z)
        return linear(self.w, y, self.p + ".out_proj")


class Stateless:
    def __init__(self, fn):
        self.fn = fn

    def step(self, x, _pos):
        return self.fn(x)


def swiglu(w, prefix):
    return lambda x: linear(w, silu(linear(w, x, prefix + ".gate_proj")) * linear(
        w, x, prefix + ".up_proj"), prefix + ".down_proj")


def relu2_mlp(w, prefix):
    return lambda x: linear(w, np.maximum(linear(w, x, prefix + ".up_proj"), 0.0) ** 2,
                            prefix + ".down_proj")


def nemotron_moe(w, prefix, cfg):
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    groups, keep_groups = cfg["n_group"], cfg["topk_group"]
    gate_w = w[prefix + ".gate.weight"]
    bias = w[prefix + ".gate.e_score_correction_bias"]
    experts = [relu2_mlp(w, f"{prefix}.experts.{e}") for e in range(E)]
    shared = relu2_mlp(w, prefix + ".shared_experts")

    def moe(x):
        s = 1.0 / (1.0 + np.exp(-(gate_w @ x)))
        choice = s + bias
        per = E // groups
        group_score = np.sort(choice.reshape(groups, per), axis=1)[:, -2:].sum(axis=1)
        kept = np.argsort(-group_score, kind="stable")[:keep_groups]
        allowed = np.full(E, -np.inf)
        for g in kept:
            allowed[g * per:(g + 1) * per] = choice[g * per:(g + 1) * per]
        picked = np.argsort(-allowed, kind="stable")[:k]
        weights = s[picked]
        if cfg["norm_topk_prob"]:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg["routed_scaling_factor"]
        out = sum(wt * experts[e](x) for e, wt in zip(picked, weights))
        return out + shared(x)

    return moe


# ---------------------------------------------------------------------------------------------
# Architectures: each returns (embedding, list of blocks, final norm weight, lm_head, eps)
# where a block is a list of (norm weight, mixer) applied as x += mixer(norm(x)).


def build_llama(cfg, w):
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = rope_inv_freq(hd, cfg["rope"])
    blocks = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        attn = Attention(w, p + ".self_attn", cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], hd, inv)
        blocks.append([(w[p + ".input_layernorm.weight"], attn),
                       (w[p + ".post_attention_layernorm.weight"], Stateless(swiglu(w, p + ".mlp")))])
    emb = w["model.embed_tokens.weight"]
    return emb, blocks, w["model.norm.weight"], w.get("lm_head.weight", emb), cfg["rms_norm_eps"]


def build_mamba2(cfg, w):
    eps = cfg["layer_norm_epsilon"]
    blocks = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"backbone.layers.{i}"
        mixer = Mamba2Mixer(w, p + ".mixer", cfg["num_heads"], cfg["head_dim"], cfg["n_groups"],
                            cfg["state_size"], eps, cfg["time_step_limit"][0])
        blocks.append([(w[p + ".norm.weight"], mixer)])
    emb = w["backbone.embeddings.weight"]
    return emb, blocks, w["backbone.norm_f.weight"], w.get("lm_head.weight", emb), eps


def nemotron_pattern(cfg):
    if "hybrid_override_pattern" in cfg:
        return cfg["hybrid_override_pattern"]
    letter = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
              "mlp": "-", "moe": "E"}
    return "".join(letter[t] for t in cfg["layers_block_type"])


def build_nemotronh(cfg, w):
    eps = cfg["layer_norm_epsilon"]
    blocks = []
    for i, kind in enumerate(nemotron_pattern(cfg)):
        p = f"backbone.layers.{i}.mixer"
        if kind == "M":
            # transformers clamps dt at time_step_min in prefill only; the fixtures keep dt above
            # it, and `clamped` below proves the clamp never bound.
            mixer = Mamba2Mixer(w, p, cfg["mamba_num_heads"], cfg["mamba_head_dim"],
                                cfg["n_groups"], cfg["ssm_state_size"], eps, cfg["time_step_min"])
        elif kind == "*":
            mixer = Attention(w, p, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                              cfg["head_dim"], None)
        elif kind == "-":
            mixer = Stateless(relu2_mlp(w, p))
        elif kind == "E":
            mixer = Stateless(nemotron_moe(w, p, cfg))
        else:
            raise SystemExit(f"unknown NemotronH block {kind!r}")
        blocks.append([(w[f"backbone.layers.{i}.norm.weight"], mixer)])
    emb = w["backbone.embeddings.weight"]
    return emb, blocks, w["backbone.norm_f.weight"], w.get("lm_head.weight", emb), eps


def build_bamba(cfg, w):
    eps = cfg["rms_norm_eps"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = rope_inv_freq(hd, cfg["rope"])
    blocks = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if i in cfg["attn_layer_indices"]:
            mixer = Attention(w, p + ".self_attn", cfg["num_attention_heads"],
                              cfg["num_key_value_heads"], hd, inv)
        else:
            mixer = Mamba2Mixer(w, p + ".mamba", cfg["mamba_n_heads"], cfg["mamba_d_head"],
                                cfg["mamba_n_groups"], cfg["mamba_d_state"], eps,
                                cfg["time_step_limit"][0])
        blocks.append([(w[p + ".input_layernorm.weight"], mixer),
                       (w[p + ".pre_ff_layernorm.weight"], Stateless(swiglu(w, p + ".feed_forward")))])
    emb = w["model.embed_tokens.weight"]
    return emb, blocks, w["model.final_layernorm.weight"], w.get("lm_head.weight", emb), eps


# ---- wave 2, Mamba2-based: Granite 4.0 and Falcon-H1 (branch gfh) --------------------------
# Their builders return two more numbers: the embedding multiplier and the logits multiplier.


class Scaled:
    """A mixer whose input and output are multiplied by constants (µP multipliers)."""

    def __init__(self, mixer, out=1.0, inp=1.0):
        self.mixer, self.out, self.inp = mixer, out, inp

    def step(self, x, pos):
        return self.out * self.mixer.step(self.inp * x, pos)

    @property
    def clamped(self):
        return getattr(self.mixer, "clamped", 0)


class Parallel:
    """Several mixers on the same input, outputs summed (Falcon-H1's Mamba2 + attention)."""

    def __init__(self, *mixers):
        self.mixers = mixers

    def step(self, x, pos):
        return sum(m.step(x, pos) for m in self.mixers)

    @property
    def clamped(self):
        return sum(getattr(m, "clamped", 0) for m in self.mixers)


def layer_kind(t):
    return {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}[t]


def granite_mlp(w, prefix):
    """input_linear holds the gate rows, then the up rows."""
    gate, up = np.split(w[prefix + ".input_linear.weight"], 2, axis=0)
    down = w[prefix + ".output_linear.weight"]
    return lambda x: down @ (silu(gate @ x) * (up @ x))


def granite_moe(w, prefix, cfg):
    k = cfg["num_experts_per_tok"]
    router = w[prefix + ".router.layer.weight"]
    gate_up, down = w[prefix + ".input_linear.weight"], w[prefix + ".output_linear.weight"]
    inter = down.shape[2]

    def moe(x):
        logits = router @ x
        picked = np.argsort(-logits, kind="stable")[:k]
        p = np.exp(logits[picked] - logits[picked].max())
        out = np.zeros_like(x)
        for e, wt in zip(picked, p / p.sum()):
            h = gate_up[e] @ x
            out = out + wt * (down[e] @ (silu(h[:inter]) * h[inter:]))
        return out

    return moe


# ---- Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) ----------------------------------------------


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def head_norm(x, weight, eps):
    """RMS norm of each row of x [heads, dim] with one weight [dim]."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps))


class GatedAttention(Attention):
    """Qwen3-Next attention: q_proj rows are [q_h, gate_h] per head; per-head RMS norms on q and
    k with (1 + w) weights before RoPE; the output is multiplied by sigmoid(gate)."""

    def __init__(self, w, prefix, n_heads, n_kv, head_dim, inv, eps):
        super().__init__(w, prefix, n_heads, n_kv, head_dim, inv)
        self.eps = eps

    def step(self, x, pos):
        qg = linear(self.w, x, self.p + ".q_proj").reshape(self.nh, 2 * self.hd)
        q, gate = qg[:, : self.hd], qg[:, self.hd:].reshape(-1)
        k = linear(self.w, x, self.p + ".k_proj").reshape(self.nkv, self.hd)
        v = linear(self.w, x, self.p + ".v_proj").reshape(self.nkv, self.hd)
        q = head_norm(q, 1.0 + self.w[self.p + ".q_norm.weight"], self.eps)
        k = head_norm(k, 1.0 + self.w[self.p + ".k_norm.weight"], self.eps)
        q, k = apply_rope(q, pos, self.inv), apply_rope(k, pos, self.inv)
        self.keys.append(k)
        self.values.append(v)
        K, V = np.stack(self.keys), np.stack(self.values)
        out = np.empty((self.nh, self.hd))
        per_kv = self.nh // self.nkv
        for h in range(self.nh):
            s = K[:, h // per_kv] @ q[h] / math.sqrt(self.hd)
            p = np.exp(s - s.max())
            out[h] = (p / p.sum()) @ V[:, h // per_kv]
        return linear(self.w, out.reshape(-1) * sigmoid(gate), self.p + ".o_proj")


class GatedDeltaNet:
    """The Gated DeltaNet mixer as a recurrence, one token at a time (never the chunked form):
    conv + SiLU over q|k|v, L2-normalised q (scaled by dk^-1/2) and k, and per value head
    S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q; then RMS norm * silu(z)."""

    def __init__(self, w, prefix, cfg):
        self.w, self.p = w, prefix
        self.nk, self.nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.conv_w = w[prefix + ".conv1d.weight"][:, 0, :]
        self.conv_dim, self.k = self.conv_w.shape
        self.window = np.zeros((self.k, self.conv_dim))
        self.state = np.zeros((self.nv, self.dk, self.dv))
        self.fused = prefix + ".in_proj_qkvz.weight" in w  # Qwen3-Next's grouped projections

    def project(self, x):
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        r = nv // nk
        if not self.fused:
            lin = lambda n: self.w[f"{self.p}.{n}.weight"] @ x  # noqa: E731
            return lin("in_proj_qkv"), lin("in_proj_z"), lin("in_proj_b"), lin("in_proj_a")
        qkvz = (self.w[self.p + ".in_proj_qkvz.weight"] @ x).reshape(nk, 2 * dk + 2 * r * dv)
        ba = (self.w[self.p + ".in_proj_ba.weight"] @ x).reshape(nk, 2 * r)
        q, k = qkvz[:, :dk], qkvz[:, dk: 2 * dk]
        v, z = qkvz[:, 2 * dk: 2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]
        mixed = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
        return mixed, z.reshape(-1), ba[:, :r].reshape(-1), ba[:, r:].reshape(-1)

    def step(self, x, _pos):
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        mixed, z, b, a = self.project(x)
        self.window = np.concatenate([self.window[1:], mixed[None, :]])
        conv = silu(np.einsum("kc,ck->c", self.window, self.conv_w))
        q = conv[: nk * dk].reshape(nk, dk)
        k = conv[nk * dk: 2 * nk * dk].reshape(nk, dk)
        v = conv[2 * nk * dk:].reshape(nv, dv)
        beta = sigmoid(b)
        g = -np.exp(self.w[self.p + ".A_log"]) * softplus(a + self.w[self.p + ".dt_bias"])
        o = np.empty((nv, dv))
        for h in range(nv):
            kh = h // (nv // nk)
            qh = q[kh] / math.sqrt(q[kh] @ q[kh] + 1e-6) / math.sqrt(dk)
            kk = k[kh] / math.sqrt(k[kh] @ k[kh] + 1e-6)
            S = self.state[h] * math.exp(g[h])
            delta = beta[h] * (v[h] - S.T @ kk)
            S = S + np.outer(kk, delta)
            self.state[h] = S
            o[h] = S.T @ qh
        o = head_norm(o, self.w[self.p + ".norm.weight"], self.eps) * silu(z.reshape(nv, dv))
        return linear(self.w, o.reshape(-1), self.p + ".out_proj")


def qwen_moe(w, prefix, cfg, normalise):
    """Softmax top-k routing over gated SiLU experts (stacked gate_up_proj or one by one) plus a
    shared expert scaled by sigmoid(shared_expert_gate x)."""
    E, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    gate_w = w[prefix + ".gate.weight"]
    stacked = prefix + ".experts.gate_up_proj" in w

    def expert(e, x):
        if stacked:
            gu = w[prefix + ".experts.gate_up_proj"][e] @ x
            half = gu.shape[0] // 2
            return w[prefix + ".experts.down_proj"][e] @ (silu(gu[:half]) * gu[half:])
        return swiglu(w, f"{prefix}.experts.{e}")(x)

    shared = swiglu(w, prefix + ".shared_expert")
    shared_gate = w[prefix + ".shared_expert_gate.weight"]

    def moe(x):
        s = gate_w @ x
        p = np.exp(s - s.max())
        p = p / p.sum()
        picked = np.argsort(-p, kind="stable")[:top_k]
        weights = p[picked] / p[picked].sum() if normalise else p[picked]
        out = sum(wt * expert(e, x) for e, wt in zip(picked, weights))
        return out + sigmoid(shared_gate @ x)[0] * shared(x)

    return moe


def build_granite(cfg, w):
    eps, res = cfg["rms_norm_eps"], cfg["residual_multiplier"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = rope_inv_freq(hd, cfg["rope"]) if cfg.get("position_embedding_type") == "rope" else None
    blocks = []
    for i, t in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        if layer_kind(t) == "*":
            mixer = Attention(w, p + ".self_attn", cfg["num_attention_heads"],
                              cfg["num_key_value_heads"], hd, inv)
            mixer.scale = cfg["attention_multiplier"]
        else:
            mixer = Mamba2Mixer(w, p + ".mamba", cfg["mamba_n_heads"], cfg["mamba_d_head"],
                                cfg["mamba_n_groups"], cfg["mamba_d_state"], eps,
                                cfg["time_step_limit"][0])
        shared = granite_mlp(w, p + ".shared_mlp")
        if cfg["num_local_experts"] > 0:
            routed = granite_moe(w, p + ".block_sparse_moe", cfg)
            ffn = (lambda r, s: lambda x: r(x) + s(x))(routed, shared)
        else:
            ffn = shared
        blocks.append([(w[p + ".input_layernorm.weight"], Scaled(mixer, res)),
                       (w[p + ".post_attention_layernorm.weight"], Scaled(Stateless(ffn), res))])
    emb = w["model.embed_tokens.weight"]
    return (emb, blocks, w["model.norm.weight"], w.get("lm_head.weight", emb), eps,
            cfg["embedding_multiplier"], 1.0 / cfg["logits_scaling"])


def build_falcon_h1(cfg, w):
    eps = cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = rope_inv_freq(hd, cfg["rope"])
    d_ssm, gs = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    m = cfg["ssm_multipliers"]
    mup = np.concatenate([np.full(d_ssm, m[0]), np.full(d_ssm, m[1]), np.full(gs, m[2]),
                          np.full(gs, m[3]), np.full(cfg["mamba_n_heads"], m[4])])
    gate_mult, down_mult = cfg["mlp_multipliers"]
    if not cfg.get("mamba_rms_norm", False):
        out_norm = "gate_only"
    elif cfg.get("mamba_norm_before_gate", True):
        out_norm = "norm_then_gate"
    else:
        out_norm = "gate_then_norm"
    blocks = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        mamba = Mamba2Mixer(w, p + ".mamba", cfg["mamba_n_heads"], cfg["mamba_d_head"],
                            cfg["mamba_n_groups"], cfg["mamba_d_state"], eps,
                            cfg["time_step_limit"][0])
        mamba.in_mult, mamba.mup, mamba.out_norm = cfg["ssm_in_multiplier"], mup, out_norm
        attn = Attention(w, p + ".self_attn", cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], hd, inv)
        attn.key_mult = cfg["key_multiplier"]
        mixer = Parallel(Scaled(mamba, cfg["ssm_out_multiplier"]),
                         Scaled(attn, cfg["attention_out_multiplier"],
                                cfg["attention_in_multiplier"]))
        f = p + ".feed_forward"
        mlp = (lambda f: lambda x: down_mult * linear(w, linear(w, x, f + ".up_proj") * silu(
            gate_mult * linear(w, x, f + ".gate_proj")), f + ".down_proj"))(f)
        blocks.append([(w[p + ".input_layernorm.weight"], mixer),
                       (w[p + ".pre_ff_layernorm.weight"], Stateless(mlp))])
    emb = w["model.embed_tokens.weight"]
    return (emb, blocks, w["model.final_layernorm.weight"], w.get("lm_head.weight", emb), eps,
            cfg["embedding_multiplier"], cfg["lm_head_multiplier"])


# ---- end gfh ---------------------------------------------------------------------------------
def build_qwen_gdn(cfg, w):
    text = {k: v for k, v in cfg.items() if k != "text_config"}
    text.update(cfg.get("text_config") or {})
    rope = dict(text.get("rope_parameters") or {"rope_theta": text.get("rope_theta", 10000.0)})
    rope.setdefault("rope_type", "default")
    rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    arch = cfg["architectures"][0]
    root = "model.language_model" if "model.language_model.embed_tokens.weight" in w else "model"
    eps, n = text["rms_norm_eps"], text["num_hidden_layers"]
    hd = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    inv = rope_inv_freq(hd, rope)
    types = text.get("layer_types") or [
        "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)]
    blocks = []
    for i in range(n):
        p = f"{root}.layers.{i}"
        if types[i] == "full_attention":
            mixer = GatedAttention(w, p + ".self_attn", text["num_attention_heads"],
                                   text["num_key_value_heads"], hd, inv, eps)
        else:
            mixer = GatedDeltaNet(w, p + ".linear_attn", text)
        if arch.startswith("Qwen3_5Moe"):
            ffn = qwen_moe(w, p + ".mlp", text, True)
        elif arch.startswith("Qwen3_5"):
            ffn = swiglu(w, p + ".mlp")
        elif (text["num_experts"] > 0 and (i + 1) % text["decoder_sparse_step"] == 0
              and i not in (text.get("mlp_only_layers") or [])):
            ffn = qwen_moe(w, p + ".mlp", text, text["norm_topk_prob"])
        else:
            ffn = swiglu(w, p + ".mlp")
        # Every norm here but the mixer's output norm scales by (1 + w).
        blocks.append([(1.0 + w[p + ".input_layernorm.weight"], mixer),
                       (1.0 + w[p + ".post_attention_layernorm.weight"], Stateless(ffn))])
    emb = w[root + ".embed_tokens.weight"]
    return emb, blocks, 1.0 + w[root + ".norm.weight"], w.get("lm_head.weight", emb), eps


BUILDERS = {
    "LlamaForCausalLM": build_llama,
    "Mamba2ForCausalLM": build_mamba2,
    "NemotronHForCausalLM": build_nemotronh,
    "BambaForCausalLM": build_bamba,
    "GraniteMoeHybridForCausalLM": build_granite,
    "FalconH1ForCausalLM": build_falcon_h1,
    # Gated DeltaNet hybrids.
    "Qwen3NextForCausalLM": build_qwen_gdn,
    "Qwen3_5ForCausalLM": build_qwen_gdn,
    "Qwen3_5MoeForCausalLM": build_qwen_gdn,
    "Qwen3_5ForConditionalGeneration": build_qwen_gdn,
    "Qwen3_5MoeForConditionalGeneration": build_qwen_gdn,
}


class Model:
    def __init__(self, path):
        cfg = load_config(path)
        w = load_weights(path)
        self.build = lambda: BUILDERS[cfg["architectures"][0]](cfg, w)

    def fresh(self):
        built = self.build()
        self.emb, self.blocks, self.norm_f, self.head, self.eps = built[:5]
        self.emb_mult, self.logits_mult = built[5:] if len(built) == 7 else (1.0, 1.0)
        self.pos = 0

    def step(self, token):
        x = self.emb[token] * self.emb_mult
        for block in self.blocks:
            for norm_w, mixer in block:
                x = x + mixer.step(rms_norm(x, norm_w, self.eps), self.pos)
        self.pos += 1
        return (self.head @ rms_norm(x, self.norm_f, self.eps)) * self.logits_mult

    def clamped(self):
        return sum(getattr(m, "clamped", 0) for b in self.blocks for _, m in b)


# ---------------------------------------------------------------------------------------------


def check(name):
    path = os.path.join(MODELS, name)
    ref = read_safetensors(os.path.join(path, "reference.safetensors"))
    with open(os.path.join(path, "reference.json")) as f:
        meta = json.load(f)
    model = Model(path)
    ok = True
    worst = 0.0
    if "branch" in meta["cases"]:
        shared = meta["branch"]["shared_tokens"]
        src = ref["prompt_" + meta["branch"]["prefix_of"]][:shared]
        if ref["prompt_branch"][:shared].tolist() != src.tolist():
            print(f"  {name}: branch prompt does not share its prefix  FAIL")
            ok = False
    for n in meta["cases"]:
        model.fresh()
        logits = np.stack([model.step(int(t)) for t in ref[f"prompt_{n}"]])
        pos = ref[f"positions_{n}"]
        err_prefill = np.abs(logits[pos] - ref[f"logits_{n}"]).max()
        tokens, step_logits = [], [logits[-1]]
        tokens.append(int(np.argmax(logits[-1])))
        for _ in range(1, meta["greedy_steps"]):
            step_logits.append(model.step(tokens[-1]))
            tokens.append(int(np.argmax(step_logits[-1])))
        steps = ref[f"decode_steps_{n}"]
        err_decode = np.abs(np.stack(step_logits)[steps] - ref[f"decode_logits_{n}"]).max()
        same = tokens == ref[f"greedy_{n}"].tolist()
        clamped = model.clamped()
        worst = max(worst, err_prefill, err_decode)
        good = same and err_prefill <= TOLERANCE and err_decode <= TOLERANCE and clamped == 0
        ok &= good
        print(f"  {name:22s} {n:>6s} prefill max|d|={err_prefill:.2e} decode max|d|={err_decode:.2e}"
              f" greedy {'same' if same else 'DIFFERENT'}{'' if clamped == 0 else f' dt clamped {clamped}x'}"
              f"{'' if good else '  FAIL'}")
    return ok, worst


def main():
    # Folders without reference.json (the MTP-head fixtures, checked by their own script's
    # reference) are skipped.
    names = sys.argv[1:] or sorted(
        n for n in os.listdir(MODELS) if os.path.exists(os.path.join(MODELS, n, "reference.json")))
    results = [check(n) for n in names]
    worst = max(w for _, w in results)
    failed = [n for n, (ok, _) in zip(names, results) if not ok]
    print(f"{len(names)} models, largest logit difference {worst:.2e}, "
          f"{'all match' if not failed else 'FAILED: ' + ', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
