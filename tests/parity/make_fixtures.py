#!/usr/bin/env python3
"""Build the tiny random-weight model fixtures and their reference outputs.

How to run (from the repository root; needs torch, transformers, safetensors, tokenizers):

    OMP_NUM_THREADS=1 python3 tests/parity/make_fixtures.py             # every model + bad cases
    OMP_NUM_THREADS=1 python3 tests/parity/make_fixtures.py llama-gqa   # only the named models
    python3 tests/parity/make_fixtures.py --bad-only                    # only tests/fixtures/bad/

What it writes:
    tests/fixtures/models/<name>/   a Hugging Face model folder (config.json, *.safetensors,
                                    tokenizer.json, tokenizer_config.json) plus
                                    reference.safetensors and reference.json (schema in
                                    tests/fixtures/README.md)
    tests/fixtures/bad/<case>/      broken model folders for loader error tests

After writing the models it runs check_references.py (an independent float64 NumPy
implementation) on them and fails if any reference disagrees. The tokenizer comes from
host/assets/tokenizer/ (made by make_tokenizer.py). References are
computed in float32 by transformers from the weights as read back from disk, so a bf16 or f16
checkpoint's reference is the float32 computation on the upcast stored weights. Everything is
seeded: running the script twice with the same torch/transformers versions gives the same
bytes (thread count fixed by OMP_NUM_THREADS=1).
"""

import argparse
import copy
import inspect
import json
import math
import os
import shutil
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    # Gated DeltaNet hybrids.
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIR = os.path.join(ROOT, "host", "assets", "tokenizer")
OUT_MODELS = os.path.join(ROOT, "tests", "fixtures", "models")
OUT_BAD = os.path.join(ROOT, "tests", "fixtures", "bad")

VOCAB = 512
N_SPECIAL = 5  # ids 0..4 are <|pad|> <|bos|> <|eos|> <|im_start|> <|im_end|>
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPT_LENS = [1, 7, 33, 131]
GREEDY_STEPS = 32
# Prompts longer than this store only some positions' logits (the file stays small).
FULL_LOGITS_MAX_LEN = 40
SAMPLED_POSITIONS = [0, 1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100]
LAST_POSITIONS = 8
# Decode steps whose logits are stored (step t's logits come from feeding greedy[t-1]).
DECODE_STEPS = [1, 2, 16, 31]
# The "branch" case shares the first BRANCH_SHARED tokens of the BRANCH_OF-token prompt and
# then diverges (for prefix-cache and SSM-snapshot tests); its stored positions straddle the
# divergence and cover the end.
BRANCH_OF = 131
BRANCH_SHARED = 48
BRANCH_LEN = 65
BRANCH_POSITIONS = [47, 48, 49] + list(range(BRANCH_LEN - LAST_POSITIONS, BRANCH_LEN))
# A prompt is redrawn (next seed) while some greedy step has top-1 minus top-2 logit below this,
# so that float32 rounding differences between implementations cannot flip a greedy choice.
MIN_GREEDY_MARGIN = 2e-3
MAX_PROMPT_DRAWS = 200
# Same idea for MoE routing: a prompt is redrawn while some token's k-th and (k+1)-th expert
# (or group) scores are closer than this, so rounding cannot change which experts are chosen.
MIN_ROUTING_MARGIN = 2e-4
# The cached decode must match one full forward at least this well, or the script fails.
MAX_SELF_CHECK_ERR = 1e-4

LLAMA_BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)

MAMBA2_BASE = dict(
    state_size=16,
    conv_kernel=4,
    expand=2,
    use_bias=False,
    use_conv_bias=True,
    layer_norm_epsilon=1e-5,
    residual_in_fp32=True,
)

NEMOTRONH_BASE = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    mlp_hidden_act="relu2",
    ssm_state_size=16,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    conv_kernel=4,
    expand=2,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=32,
    n_shared_experts=1,
    max_position_embeddings=512,
    layer_norm_epsilon=1e-5,
    use_mamba_kernels=False,
)

BAMBA_BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# ---- Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) ---------------------------------------------

GDN_BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)

GDN_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
)

# The multimodal classes (the published Qwen3.5 layout) need a vision tower; the text model
# never runs it, so it is as small as the config allows.
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                   patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                   num_position_embeddings=16)


def legacy_qwen3_next(cfg):
    """Qwen3-Next as published: top-level rope_theta and partial_rotary_factor,
    full_attention_interval instead of layer_types, torch_dtype."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    types = cfg.pop("layer_types")
    interval = types.index("full_attention") + 1
    assert types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(len(types))], types
    cfg["full_attention_interval"] = interval
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def per_expert_tensors(path):
    """Stacked experts (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I], as
    transformers 5 writes them) rewritten one expert at a time (experts.{j}.gate_proj.weight …),
    as the published Qwen3-Next checkpoints store them."""
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    for f in files:
        full = os.path.join(path, f)
        tensors = load_file(full)
        out = {}
        for k, v in tensors.items():
            if k.endswith("experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                inter = v.shape[1] // 2
                for j in range(v.shape[0]):
                    out[f"{base}{j}.gate_proj.weight"] = v[j, :inter].contiguous()
                    out[f"{base}{j}.up_proj.weight"] = v[j, inter:].contiguous()
            elif k.endswith("experts.down_proj"):
                base = k[: -len("down_proj")]
                for j in range(v.shape[0]):
                    out[f"{base}{j}.down_proj.weight"] = v[j].contiguous()
            else:
                out[k] = v
        save_file(out, full, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = {}
        for f in files:
            for k in load_file(os.path.join(path, f)):
                weight_map[k] = f
        with open(index) as fh:
            meta = json.load(fh)
        meta["weight_map"] = weight_map
        with open(index, "w") as fh:
            json.dump(meta, fh, indent=2, sort_keys=True)
            fh.write("\n")


# Older config.json forms. Checkpoints on the Hub were written by older transformers versions;
# a few fixtures rewrite their config.json into those forms so a loader must accept both.


def legacy_llama(cfg):
    """Top-level rope_theta plus rope_scaling, and torch_dtype (transformers 4.x layout)."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def legacy_nemotronh(cfg):
    """hybrid_override_pattern string (as in NVIDIA's checkpoints) instead of layers_block_type."""
    letter = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    cfg["hybrid_override_pattern"] = "".join(letter[t] for t in cfg.pop("layers_block_type"))
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def legacy_infinity(cfg):
    """A bare Infinity in time_step_limit (not valid JSON; Python's json module writes it)."""
    cfg["time_step_limit"] = [0.0, float("inf")]
    return cfg


def rewrite_config(path, fn):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in list(cfg.items()):  # undo transformers' {"__float__": "Infinity"} tagging
        if isinstance(v, list):
            cfg[k] = [float(x["__float__"]) if isinstance(x, dict) and "__float__" in x else x
                      for x in v]
    cfg = fn(cfg)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")



# ---------------------------------------------------------------------------------------------
# The fixture models

# name, model class, config class, config kwargs, on-disk dtype, shard count, what it covers
SPECS = [
    dict(
        name="llama-gqa",
        cls=LlamaForCausalLM,
        cfg=LlamaConfig,
        kwargs=dict(LLAMA_BASE, num_key_value_heads=2, tie_word_embeddings=False),
        dtype="float32",
        shards=1,
        covers="GQA 4q/2kv, head_dim 16, untied embeddings, default RoPE theta 10000",
    ),
    dict(
        name="mamba2-g1",
        cls=Mamba2ForCausalLM,
        cfg=Mamba2Config,
        kwargs=dict(
            MAMBA2_BASE,
            hidden_size=32,
            num_heads=4,
            head_dim=16,
            n_groups=1,
            num_hidden_layers=2,
            chunk_size=8,
            tie_word_embeddings=False,
        ),
        dtype="float32",
        shards=1,
        covers="Mamba2, n_groups 1, chunk_size 8 (prompts 33/131 are not multiples), untied",
    ),
    dict(
        name="llama-mqa-tied",
        cls=LlamaForCausalLM,
        cfg=LlamaConfig,
        kwargs=dict(LLAMA_BASE, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                    num_hidden_layers=3, rope_parameters=dict(rope_type="default", rope_theta=500.0)),
        dtype="bfloat16",
        shards=1,
        covers="MQA 4q/1kv, head_dim 24 != hidden/heads, tied embeddings, rope_theta 500, bf16 on disk",
    ),
    dict(
        name="llama-mha-llama3rope",
        cls=LlamaForCausalLM,
        cfg=LlamaConfig,
        kwargs=dict(
            LLAMA_BASE,
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=2,
            tie_word_embeddings=False,
            max_position_embeddings=1024,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        dtype="float16",
        shards=1,
        legacy_config=legacy_llama,
        covers="MHA 4/4, head_dim 12, llama3 rope scaling (factor 8, original 64), f16 on disk; "
        "config.json in the older form (top-level rope_theta + rope_scaling, torch_dtype)",
    ),
    dict(
        name="llama-sharded-bias",
        cls=LlamaForCausalLM,
        cfg=LlamaConfig,
        kwargs=dict(LLAMA_BASE, num_key_value_heads=2, num_hidden_layers=4, attention_bias=True,
                    tie_word_embeddings=False),
        dtype="float32",
        shards=2,
        covers="GQA 4q/2kv, 4 layers, q/k/v/o biases (Qwen2-like), 2 safetensors shards + index",
    ),
    dict(
        name="mamba2-g2",
        cls=Mamba2ForCausalLM,
        cfg=Mamba2Config,
        kwargs=dict(
            MAMBA2_BASE,
            hidden_size=48,
            num_heads=6,
            head_dim=16,
            n_groups=2,
            num_hidden_layers=3,
            chunk_size=16,
            tie_word_embeddings=True,
        ),
        dtype="float32",
        shards=1,
        legacy_config=legacy_infinity,
        covers="Mamba2, hidden 48, 6 heads in n_groups 2, chunk_size 16, 3 layers, tied embeddings; "
        "config.json has a bare Infinity in time_step_limit",
    ),
    dict(
        name="nemotronh-a",
        cls=NemotronHForCausalLM,
        cfg=NemotronHConfig,
        kwargs=dict(
            NEMOTRONH_BASE,
            hybrid_override_pattern="M-M*EM",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        dtype="float32",
        shards=1,
        covers="NemotronH pattern M-M*EM, MoE 8 experts top-2, n_group 1, norm_topk_prob, scale 2.5",
    ),
    dict(
        name="nemotronh-b",
        cls=NemotronHForCausalLM,
        cfg=NemotronHConfig,
        kwargs=dict(
            NEMOTRONH_BASE,
            hybrid_override_pattern="*EME-M",
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            n_groups=1,
            chunk_size=8,
            tie_word_embeddings=False,
        ),
        dtype="bfloat16",
        shards=1,
        covers="NemotronH pattern *EME-M, grouped routing n_group 4 / topk_group 2, top-3, "
        "no norm_topk_prob, mamba n_groups 1, chunk 8, bf16 on disk except the routers "
        "(gate.weight, gate.e_score_correction_bias stay F32, as in NVIDIA's checkpoints); "
        "config.json in the older form (hybrid_override_pattern, torch_dtype)",
        keep_f32=["gate.weight", "gate.e_score_correction_bias"],
        legacy_config=legacy_nemotronh,
    ),
    dict(
        name="bamba-a",
        cls=BambaForCausalLM,
        cfg=BambaConfig,
        kwargs=dict(
            BAMBA_BASE,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_n_groups=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
        dtype="float32",
        shards=1,
        covers="Bamba, attention at layer 1 of 3, partial rotary 0.5, mamba n_groups 1",
    ),
    dict(
        name="bamba-b",
        cls=BambaForCausalLM,
        cfg=BambaConfig,
        kwargs=dict(
            BAMBA_BASE,
            num_hidden_layers=4,
            attn_layer_indices=[0, 3],
            mamba_n_groups=2,
            mamba_chunk_size=8,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
        dtype="float32",
        shards=1,
        covers="Bamba, attention at layers 0 and 3 of 4, MQA, mamba n_groups 2, chunk 8, tied",
    ),
    # ---- Gated DeltaNet hybrids ----
    dict(
        name="qwen3next-a",
        cls=Qwen3NextForCausalLM,
        cfg=Qwen3NextConfig,
        kwargs=dict(GDN_BASE, **GDN_MOE) | dict(num_hidden_layers=4, full_attention_interval=4,
                    decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False),
        dtype="float32",
        shards=1,
        covers="Qwen3-Next: 3 Gated DeltaNet layers then gated attention (4/2 × 16, partial rotary "
        "0.25); GDN 2 key heads × 8, 4 value heads × 8 (2 value heads per key head), conv 4; "
        "MoE on every layer (8 experts top-2, softmax, norm_topk_prob, sigmoid-gated shared "
        "expert 32); stacked experts as transformers writes them",
    ),
    dict(
        name="qwen3next-b",
        cls=Qwen3NextForCausalLM,
        cfg=Qwen3NextConfig,
        kwargs=dict(GDN_BASE, **GDN_MOE) | dict(num_hidden_layers=4, full_attention_interval=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts_per_tok=3,
                    decoder_sparse_step=2, norm_topk_prob=False, attention_bias=True,
                    rope_parameters=dict(rope_type="default", rope_theta=5000.0,
                                         partial_rotary_factor=0.5),
                    tie_word_embeddings=True),
        dtype="bfloat16",
        shards=2,
        legacy_config=legacy_qwen3_next,
        rewrite_tensors=per_expert_tensors,
        covers="Qwen3-Next: linear/full alternating (full_attention_interval 2), MQA 4/1 × 8 with "
        "q/k/v/o biases, partial rotary 0.5, theta 5000; GDN 2 key heads × 16, 2 value heads × 8, "
        "conv 3; MoE on odd layers only (decoder_sparse_step 2), top-3, no norm_topk_prob; "
        "tied; bf16, 2 shards; experts stored one by one and config.json in the published form "
        "(top-level rope_theta / partial_rotary_factor, full_attention_interval, torch_dtype)",
    ),
    dict(
        name="qwen35-a",
        cls=Qwen3_5ForCausalLM,
        cfg=Qwen3_5TextConfig,
        kwargs=dict(GDN_BASE, num_hidden_layers=4, full_attention_interval=4,
                    linear_value_head_dim=16, tie_word_embeddings=True),
        dtype="float32",
        shards=1,
        covers="Qwen3.5 dense as transformers writes Qwen3_5ForCausalLM: 3 GDN layers (2 key heads "
        "× 8, 4 value heads × 16) then gated attention 4/2 × 16, partial rotary 0.25 (mrope, text "
        "positions); separate in_proj_qkv/z/b/a; tied embeddings",
    ),
    dict(
        name="qwen35-vl-b",
        cls=Qwen3_5ForConditionalGeneration,
        cfg=Qwen3_5Config,
        nested=True,
        kwargs=dict(GDN_BASE, num_hidden_layers=3,
                    layer_types=["full_attention", "linear_attention", "linear_attention"],
                    num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=1,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_conv_kernel_dim=3, tie_word_embeddings=False),
        dtype="bfloat16",
        shards=1,
        covers="Qwen3.5 dense in the published multimodal layout (Qwen3_5ForConditionalGeneration: "
        "nested text_config, model.language_model.* weights, a vision tower that is not served); "
        "attention first, then 2 GDN layers (1 key head × 16, 2 value heads × 8, conv 3); "
        "MHA 2/2 × 16; bf16",
    ),
    dict(
        name="qwen35moe-a",
        cls=Qwen3_5MoeForCausalLM,
        cfg=Qwen3_5MoeTextConfig,
        kwargs=dict(GDN_BASE, **GDN_MOE) | dict(num_hidden_layers=4, full_attention_interval=2,
                    tie_word_embeddings=False),
        dtype="float32",
        shards=2,
        covers="Qwen3.5 MoE as transformers writes Qwen3_5MoeForCausalLM: GDN/attention "
        "alternating, MoE on every layer (8 experts top-2, always renormalised, sigmoid-gated "
        "shared expert), 2 shards",
    ),
    dict(
        name="qwen35moe-vl-b",
        cls=Qwen3_5MoeForConditionalGeneration,
        cfg=Qwen3_5MoeConfig,
        nested=True,
        kwargs=dict(GDN_BASE, **GDN_MOE) | dict(num_hidden_layers=3, full_attention_interval=3,
                    num_experts=6, num_experts_per_tok=3, shared_expert_intermediate_size=24,
                    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8,
                    linear_value_head_dim=8, tie_word_embeddings=False),
        dtype="bfloat16",
        shards=1,
        covers="Qwen3.5 MoE in the published multimodal layout (Qwen3_5MoeForConditionalGeneration); "
        "2 GDN layers (1 key head × 8, 3 value heads × 8) then attention; 6 experts top-3, shared "
        "expert 24; bf16",
    ),
]


# ---- wave 2, Mamba2-based: Granite 4.0 and Falcon-H1 (branch gfh) ----------------------------
# Each spec has a fixed seed_index (its seeds do not depend on its place in SPECS).

GRANITE_BASE = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    intermediate_size=16,
    shared_intermediate_size=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

FALCON_H1_BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_ssm=64,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    embedding_multiplier=1.5,
    lm_head_multiplier=0.7,
    key_multiplier=0.6,
    attention_in_multiplier=0.9,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.7,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.5],
    mlp_multipliers=[1.3, 0.6],
)


def legacy_granite(cfg):
    """Layer types spelled mamba/attention (IBM's published configs) and torch_dtype."""
    spell = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [spell[t] for t in cfg.pop("layer_types")]
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


SPECS_GFH = [
    dict(
        name="granite-moe",
        seed_index=100,
        cls=GraniteMoeHybridForCausalLM,
        cfg=GraniteMoeHybridConfig,
        kwargs=dict(
            GRANITE_BASE,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            position_embedding_type="rope",
            mamba_n_groups=1,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=2.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=1.6,
            tie_word_embeddings=False,
        ),
        dtype="float32",
        shards=1,
        covers="Granite 4.0 MoE: mamba/attention/mamba, RoPE, 8 SwiGLU experts top-2 (softmax) "
        "+ shared MLP 32, mamba n_groups 1, chunk 16, multipliers embedding 2, attention 0.2, "
        "residual 0.5, logits_scaling 1.6, untied",
    ),
    dict(
        name="granite-dense",
        seed_index=101,
        cls=GraniteMoeHybridForCausalLM,
        cfg=GraniteMoeHybridConfig,
        kwargs=dict(
            GRANITE_BASE,
            num_hidden_layers=4,
            layer_types=["full_attention", "linear_attention", "linear_attention",
                         "full_attention"],
            position_embedding_type=None,
            num_key_value_heads=1,
            mamba_n_groups=2,
            mamba_chunk_size=8,
            num_local_experts=0,
            embedding_multiplier=1.5,
            attention_multiplier=0.25,
            residual_multiplier=0.7,
            logits_scaling=0.8,
            tie_word_embeddings=True,
        ),
        dtype="bfloat16",
        shards=2,
        legacy_config=legacy_granite,
        covers="Granite 4.0 dense (no experts, shared MLP only): attention/mamba/mamba/attention, "
        "no positional encoding (NoPE), MQA 4/1, mamba n_groups 2, chunk 8, tied, bf16 in 2 "
        "shards; config.json spells layer types mamba/attention (published form), torch_dtype",
    ),
    dict(
        name="falconh1-a",
        seed_index=102,
        cls=FalconH1ForCausalLM,
        cfg=FalconH1Config,
        kwargs=dict(
            FALCON_H1_BASE,
            num_hidden_layers=2,
            mamba_n_groups=2,
            mamba_rms_norm=False,
            tie_word_embeddings=False,
        ),
        dtype="float32",
        shards=1,
        covers="Falcon-H1: Mamba2 and attention in parallel per layer, GQA 4/2, mamba 4 x 16 in "
        "n_groups 2, no mamba norm (y * silu(z)), chunk 16, every multiplier != 1 incl. the µP "
        "vector ssm_multipliers and mlp_multipliers, untied",
    ),
    dict(
        name="falconh1-b",
        seed_index=103,
        cls=FalconH1ForCausalLM,
        cfg=FalconH1Config,
        kwargs=dict(
            FALCON_H1_BASE,
            num_hidden_layers=3,
            num_key_value_heads=1,
            mamba_d_ssm=48,
            mamba_d_head=12,
            mamba_n_groups=1,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            projectors_bias=True,
            attention_bias=True,
            tie_word_embeddings=True,
            key_multiplier=1.4,
            ssm_multipliers=[1.2, 0.7, 1.1, 0.9, 1.5],
        ),
        dtype="bfloat16",
        shards=1,
        covers="Falcon-H1: MQA 4/1 with q/k/v/o biases, mamba_d_ssm 48 (!= expand x hidden), "
        "4 heads x 12, n_groups 1, chunk 8, gated RMSNorm with the norm before the gate, "
        "out_proj bias (projectors_bias), tied, bf16",
    ),
    dict(
        name="falconh1-c",
        seed_index=104,
        cls=FalconH1ForCausalLM,
        cfg=FalconH1Config,
        kwargs=dict(
            FALCON_H1_BASE,
            num_hidden_layers=2,
            mamba_n_groups=2,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=500.0),
        ),
        dtype="float32",
        shards=2,
        covers="Falcon-H1: gated RMSNorm with the gate first, per group of n_groups 2, "
        "rope_theta 500, 2 shards",
    ),
    dict(
        name="falconh1-d",
        seed_index=105,
        cls=FalconH1ForCausalLM,
        cfg=FalconH1Config,
        kwargs=dict(
            FALCON_H1_BASE,
            num_hidden_layers=2,
            mamba_n_groups=2,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            tie_word_embeddings=False,
        ),
        dtype="float32",
        shards=1,
        covers="Falcon-H1: gated RMSNorm with the norm before the gate, per group of n_groups 2 "
        "(each group normalised with its own slice of the weight, then silu(z))",
    ),
]
SPECS += SPECS_GFH
# ---- end gfh ---------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Random weights


def inv_softplus(x):
    return x + torch.log(-torch.expm1(-x))


def randomize(model, gen):
    """Give every parameter (and the MoE score-correction buffer) a non-trivial random value.

    transformers initializes several tensors to constants (A_log, D, dt_bias, norm weights,
    conv and linear biases, e_score_correction_bias); constants could hide indexing bugs, so
    each kind gets its own random distribution here. Matrices get std 1/sqrt(fan_in) so
    activations stay O(1); lm_head gets a larger scale so greedy choices have clear margins.
    """

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    tensors = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = buf
    seen = set()
    for name in sorted(tensors):
        t = tensors[name]
        if id(t) in seen:  # tied weights appear once
            continue
        seen.add(id(t))
        shape = t.shape
        leaf = name.split(".")[-1]
        if leaf == "A_log":
            v = torch.log(uniform(shape, 1.0, 16.0))
        elif leaf == "D":
            v = uniform(shape, 0.5, 1.5)
        elif leaf == "dt_bias":
            v = inv_softplus(torch.exp(uniform(shape, math.log(0.01), math.log(0.3))))
        elif leaf == "e_score_correction_bias":
            v = normal(shape, 0.1)
        elif "norm" in name and leaf == "weight":
            v = uniform(shape, 0.6, 1.4)
        elif "conv1d" in name and leaf == "weight":
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif leaf == "bias":
            v = normal(shape, 0.2)
        elif "embed" in name:
            v = normal(shape, 1.0)
        elif name.startswith("lm_head"):
            v = normal(shape, 3.0 / math.sqrt(shape[-1]))
        elif t.dim() >= 2:
            v = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            raise SystemExit(f"randomize: no rule for {name} {tuple(shape)}")
        with torch.no_grad():
            t.copy_(v.to(t.dtype))

    # Gated DeltaNet models: their RMS norms scale by (1 + w), so w is shifted to keep the scale
    # in U(0.6, 1.4) like other models' norms; decays are kept mild (A = U(0.05, 1)) so the
    # delta-rule state carries information across many tokens.
    for mod in model.modules():
        kind = type(mod).__name__
        if kind.startswith("Qwen3") and kind.endswith("RMSNorm"):
            with torch.no_grad():
                mod.weight -= 1.0
        if kind.endswith("GatedDeltaNet"):
            with torch.no_grad():
                mod.A_log.copy_(torch.log(uniform(mod.A_log.shape, 0.05, 1.0)))

    # transformers' NemotronH clamps dt to time_step_min (0.001) in the chunked prefill path but
    # not in the one-token decode path, so the two disagree whenever softplus(dt + dt_bias)
    # falls below it. Shrinking the dt rows of in_proj keeps dt well above the clamp (checked by
    # the decode-vs-full self-check), so the references do not depend on that inconsistency.
    for mod in model.modules():
        if type(mod).__name__ == "NemotronHMamba2Mixer":
            with torch.no_grad():
                mod.in_proj.weight[-mod.num_heads:] *= 0.25


# ---------------------------------------------------------------------------------------------
# Saving


def copy_tokenizer(dst):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(TOKENIZER_DIR, f), os.path.join(dst, f))


def reshard_in_two(path):
    """Split model.safetensors into two shards plus model.safetensors.index.json."""
    single = os.path.join(path, "model.safetensors")
    tensors = load_file(single)
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    first, acc = [], 0
    for n in names:  # first shard takes names until half of the bytes
        if acc >= total // 2:
            break
        first.append(n)
        acc += tensors[n].numel() * tensors[n].element_size()
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for i, part in enumerate([first, names[len(first):]]):
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, shard_names[i]),
                  metadata={"format": "pt"})
        for n in part:
            weight_map[n] = shard_names[i]
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
        f.write("\n")
    os.remove(single)


def save_model(spec, model, path):
    if os.path.exists(path):
        shutil.rmtree(path)
    disk_dtype = getattr(torch, spec["dtype"])
    keep = tuple(spec.get("keep_f32", ()))
    copy.deepcopy(model).to(disk_dtype).save_pretrained(path)
    # Round the in-memory weights the way they were stored (buffers that are not saved, such
    # as RoPE's inv_freq, stay float32, as they are after loading).
    rounded = {k: v if k.endswith(keep) or not v.is_floating_point() else v.to(disk_dtype).float()
               for k, v in model.state_dict().items()}
    model.load_state_dict(rounded)
    if keep:  # a mixed-dtype file: these tensors go back to float32 on disk
        st = os.path.join(path, "model.safetensors")
        tensors = load_file(st)
        by_suffix = {k.split(".", 1)[1]: v for k, v in rounded.items()}
        for k in tensors:
            if k.endswith(keep):
                tensors[k] = by_suffix[k.split(".", 1)[1]].contiguous()
        save_file(tensors, st, metadata={"format": "pt"})
    if spec["shards"] == 2:
        reshard_in_two(path)
    if spec.get("rewrite_tensors"):
        spec["rewrite_tensors"](path)
    if spec.get("legacy_config"):
        rewrite_config(path, spec["legacy_config"])
    copy_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# References


def prompt_seed(model_index, length, draw):
    return 1_000_000 * (model_index + 1) + 1000 * length + draw


def prompt_ids(seed, length):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(N_SPECIAL, VOCAB, (length,), generator=gen)


def stored_positions(length):
    if length <= FULL_LOGITS_MAX_LEN:
        return list(range(length))
    pos = {p for p in SAMPLED_POSITIONS if p < length}
    pos.update(range(length - LAST_POSITIONS, length))
    return sorted(pos)


def forward_kwargs(model):
    return "position_ids" in inspect.signature(model.forward).parameters


@torch.no_grad()
def full_logits(model, ids):
    out = model(input_ids=ids[None, :], use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def greedy_with_cache(model, ids, steps):
    """Prefill the prompt into a cache, then decode one token at a time.

    Returns (tokens [steps], logits used for each choice [steps, vocab]).
    """
    wants_pos = forward_kwargs(model)
    n = ids.shape[0]
    kw = dict(input_ids=ids[None, :], use_cache=True)
    if wants_pos:
        kw["position_ids"] = torch.arange(n)[None, :]
    out = model(**kw)
    cache = out.cache
    step_logits = [out.logits[0, -1].float()]
    tokens = [int(step_logits[0].argmax())]
    for t in range(1, steps):
        kw = dict(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        if wants_pos:
            kw["position_ids"] = torch.tensor([[n + t - 1]])
        out = model(**kw)
        cache = out.cache
        step_logits.append(out.logits[0, -1].float())
        tokens.append(int(step_logits[-1].argmax()))
    return torch.tensor(tokens), torch.stack(step_logits)


@torch.no_grad()
def generate_tokens(model, ids, steps):
    out = model.generate(
        input_ids=ids[None, :],
        attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, ids.shape[0]:]


class RoutingMargins:
    """Forward hooks on every NemotronH router that record how close each routing choice was.

    For each token: the gap between the last selected and the first rejected group score (when
    n_group > topk_group) and between the last selected and first rejected expert score among
    the allowed groups, computed the way NemotronHTopkRouter chooses (sigmoid + correction bias).
    """

    def __init__(self, model):
        self.min = float("inf")
        self.handles = []
        for mod in model.modules():
            if type(mod).__name__ == "NemotronHTopkRouter":
                self.handles.append(mod.register_forward_hook(self.hook))
            if type(mod).__name__ == "GraniteMoeHybridTopKRouter":
                self.handles.append(mod.register_forward_hook(self.hook_granite))
            if type(mod).__name__ in ("Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter"):
                self.handles.append(mod.register_forward_hook(self.softmax_hook))

    def softmax_hook(self, mod, inputs, _out):
        """Softmax routing: the gap between the k-th and (k+1)-th expert probability."""
        h = inputs[0].reshape(-1, mod.hidden_dim).float()
        probs = torch.softmax(h @ mod.weight.float().T, dim=-1).sort(dim=-1, descending=True).values
        if mod.num_experts > mod.top_k:
            gap = probs[:, mod.top_k - 1] - probs[:, mod.top_k]
            self.min = min(self.min, gap.min().item())

    def hook(self, mod, inputs, _out):
        h = inputs[0].reshape(-1, mod.hidden_dim).float()
        choice = torch.sigmoid(h @ mod.weight.float().T) + mod.e_score_correction_bias
        per_group = mod.num_experts // mod.num_group
        grouped = choice.view(-1, mod.num_group, per_group)
        if mod.num_group > mod.topk_group:
            gs = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
            self.min = min(self.min, (gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min().item())
        gs = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(mod.topk_group, dim=-1).indices, 1.0)
        mask = keep.bool().unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, mod.num_experts)
        allowed = choice.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True).values
        if mod.topk_group * per_group > mod.top_k:
            gap = allowed[:, mod.top_k - 1] - allowed[:, mod.top_k]
            self.min = min(self.min, gap.min().item())

    # ---- gfh: Granite's softmax top-k router picks the top_k largest logits ----
    def hook_granite(self, mod, inputs, _out):
        h = inputs[0].reshape(-1, mod.weight.shape[1]).float()
        logits = (h @ mod.weight.float().T).sort(dim=-1, descending=True).values
        if mod.top_k < mod.num_experts:
            gap = logits[:, mod.top_k - 1] - logits[:, mod.top_k]
            self.min = min(self.min, gap.min().item())

    def close(self):
        for h in self.handles:
            h.remove()


def margins(step_logits):
    top2 = step_logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def run_case(model, ids, pos):
    """Reference tensors and self-check numbers for one prompt, or None if margins are unclear."""
    n = ids.shape[0]
    routing = RoutingMargins(model)
    tokens, step_logits = greedy_with_cache(model, ids, GREEDY_STEPS)
    routing.close()
    m = margins(step_logits)
    if m.min().item() < MIN_GREEDY_MARGIN or routing.min < MIN_ROUTING_MARGIN:
        return None
    logits = full_logits(model, ids)
    # Self-consistency: cached prefill+decode vs one full forward over prompt + greedy.
    teacher = full_logits(model, torch.cat([ids, tokens[:-1]]))[n - 1:]
    decode_err = (teacher - step_logits).abs().max().item()
    prefill_err = (teacher[0] - logits[-1]).abs().max().item()
    gen_match = bool(torch.equal(generate_tokens(model, ids, GREEDY_STEPS), tokens))
    report = dict(decode_vs_full_max_abs=decode_err, prefill_vs_full=prefill_err,
                  generate_matches=gen_match, min_margin=m.min().item(),
                  min_routing_margin=routing.min if routing.handles else None,
                  logit_absmax=logits.abs().max().item())
    if not (decode_err <= MAX_SELF_CHECK_ERR and prefill_err <= MAX_SELF_CHECK_ERR and gen_match):
        raise SystemExit(f"self-check failed: {report}")
    tensors = dict(
        prompt=ids.to(torch.int32),
        positions=torch.tensor(pos, dtype=torch.int32),
        logits=logits[pos].contiguous(),
        greedy=tokens.to(torch.int32),
        greedy_margin=m.contiguous(),
        decode_steps=torch.tensor(DECODE_STEPS, dtype=torch.int32),
        decode_logits=step_logits[DECODE_STEPS].contiguous(),
    )
    return tensors, report


def make_references(spec, model_index, model, path):
    tensors = {}
    report = []
    seeds = {}
    cases = [(str(n), n) for n in PROMPT_LENS] + [("branch", None)]
    for label, n in cases:
        for draw in range(MAX_PROMPT_DRAWS):
            if n is not None:
                seeds[label] = prompt_seed(model_index, n, draw)
                ids = prompt_ids(seeds[label], n)
                pos = stored_positions(n)
            else:  # the 131-token prompt's first BRANCH_SHARED tokens, then new ones
                seeds[label] = prompt_seed(model_index, 999, draw)
                shared = tensors[f"prompt_{BRANCH_OF}"][:BRANCH_SHARED].long()
                ids = torch.cat([shared, prompt_ids(seeds[label], BRANCH_LEN - BRANCH_SHARED)])
                pos = BRANCH_POSITIONS
            result = run_case(model, ids, pos)
            if result is not None:
                break
        else:
            raise SystemExit(f"{spec['name']}: no prompt for case {label} with clear margins")
        case_tensors, case_report = result
        report.append(dict(case=label, len=int(ids.shape[0]), seed=seeds[label], **case_report))
        for k, v in case_tensors.items():
            tensors[f"{k}_{label}"] = v
    save_file(tensors, os.path.join(path, "reference.safetensors"), metadata={"format": "pt"})
    meta = dict(
        name=spec["name"],
        architecture=spec["cls"].__name__,
        covers=spec["covers"],
        disk_dtype=spec["dtype"],
        f32_on_disk=list(spec.get("keep_f32", [])),
        legacy_config=spec["legacy_config"].__doc__ if spec.get("legacy_config") else None,
        shards=spec["shards"],
        cases=[label for label, _ in cases],
        prompt_lengths=PROMPT_LENS,
        branch=dict(prefix_of=str(BRANCH_OF), shared_tokens=BRANCH_SHARED, length=BRANCH_LEN),
        prompt_seeds=seeds,
        min_greedy_margin=MIN_GREEDY_MARGIN,
        min_routing_margin=MIN_ROUTING_MARGIN,
        greedy_steps=GREEDY_STEPS,
        decode_steps=DECODE_STEPS,
        compute_dtype="float32",
        num_parameters=sum(p.numel() for p in model.parameters()),
        self_check=report,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
    )
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return report


def build_model(spec, model_index):
    torch.manual_seed(model_index)
    if spec.get("nested"):  # the multimodal layout: text settings in text_config
        config = spec["cfg"](text_config=dict(vocab_size=VOCAB, **TOKEN_IDS, **spec["kwargs"]),
                             vision_config=TINY_VISION)
    else:
        config = spec["cfg"](vocab_size=VOCAB, **TOKEN_IDS, **spec["kwargs"])
    config._attn_implementation = "eager"
    model = spec["cls"](config).float().eval()
    gen = torch.Generator().manual_seed(1234 + model_index)
    randomize(model, gen)
    return model


def text_state_dict(model):
    """The state dict with a multimodal model's text weights named as the text model's
    (model.language_model.* -> model.*) and its vision tower left out."""
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("model.visual."):
            continue
        out[k.replace("model.language_model.", "model.", 1)] = v
    return out


def check_roundtrip(before, after):
    """The model read back from disk has exactly the (rounded) weights that were saved."""
    sd_b = text_state_dict(before)
    sd_a = text_state_dict(after)
    assert set(sd_b) == set(sd_a), set(sd_b) ^ set(sd_a)
    for k in sd_b:
        assert torch.equal(sd_b[k].float(), sd_a[k].float()), k


def make_model(spec, model_index):
    path = os.path.join(OUT_MODELS, spec["name"])
    model = build_model(spec, model_index)
    save_model(spec, model, path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    check_roundtrip(model, loaded)
    probe = prompt_ids(0, 19)
    same = (full_logits(model, probe) - full_logits(loaded, probe)).abs().max().item()
    if same != 0.0:  # e.g. an older config form read back differently
        raise SystemExit(f"{spec['name']}: reloaded model differs from the saved one by {same}")
    report = make_references(spec, model_index, loaded, path)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"{spec['name']}: {size / 1024:.0f} KiB")
    for r in report:
        print("   ", json.dumps(r))


# ---------------------------------------------------------------------------------------------
# Entry point


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help="models to build (default: all)")
    ap.add_argument("--bad-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.bad_only:
        known = [s["name"] for s in SPECS]
        for n in args.names:
            if n not in known:
                raise SystemExit(f"unknown model {n}; known: {known}")
        built = []
        for i, spec in enumerate(SPECS):
            if args.names and spec["name"] not in args.names:
                continue
            make_model(spec, spec.get("seed_index", i))
            built.append(spec["name"])
        # Independent check: a token-by-token float64 NumPy implementation must agree.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import check_references

        for name in built:
            ok, _ = check_references.check(name)
            if not ok:
                raise SystemExit(f"{name}: references disagree with check_references.py")
    if args.bad_only or not args.names:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import make_bad_fixtures

        make_bad_fixtures.write_all(OUT_BAD)


if __name__ == "__main__":
    main()
