"""State-space fixtures written as GGUF the way llama.cpp's `convert_hf_to_gguf.py` writes them.

`mamba2-g2` becomes `mamba2`; `nemotronh-b` (attention, Mamba2, relu² MLP and MoE layers)
becomes `nemotron_h_moe` (`nemotron_h` without experts); `granite-moe` (RoPE attention, experts
and a shared MLP) and `granite-dense` (no positional encoding, shared MLP only) become
`granitehybrid`.

For each fixture folder named below, writes `tests/fixtures/gguf/<name>.gguf`: the `{arch}.*`
metadata llama.cpp's converter states for the architecture, the byte-level BPE vocabulary as
`tokenizer.ggml.*`, and every tensor under the name gguf-py's tensor map gives it, with the
converter's layout changes:

- `mixer.dt_bias` is renamed `dt_proj.bias` before mapping (so it becomes `ssm_dt.bias`);
- `A_log` is stored as `A = -exp(A_log)`, and `A` and `D` gain a trailing axis;
- the depthwise `conv1d.weight` `[channels, 1, kernel]` is squeezed to `[channels, kernel]`;
- the gated norm `mixer.norm.weight` `[d_inner]` is reshaped to `[groups, d_inner / groups]`;
- a tied LM head is not written;
- NemotronH: q/k rows permuted as for Llama (the converter's `undo_permute`; its attention has
  no RoPE, so this changes nothing but the stored order), the routed experts stacked into one
  `[experts, out, in]` tensor per projection, `e_score_correction_bias` as `exp_probs_b.bias`;
- Granite 4.0: q/k rows permuted, the fused `input_linear` (gate rows, then up rows) split into
  `ffn_gate*` and `ffn_up*` (`_exps` for experts, `_shexp` for the shared MLP beside experts,
  plain without), the µP multipliers as `attention.scale`, `embedding_scale`, `residual_scale`,
  `logit_scale`. llama.cpp reads `rope.scaling.finetuned` as "this hybrid uses RoPE"; written
  here from the config's `position_embedding_type` (the converter snapshot read for this
  derives it from the architecture name instead).

transformers cannot load these architectures from GGUF, so the Rust test compares each file
with chimera's own load of the fixture's safetensors: the same weights in two containers.

    pip install gguf safetensors numpy torch
    python3 tests/parity/make_gguf_hybrid.py
"""

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
OUT = ROOT / "tests" / "fixtures" / "gguf"
MODELS = {
    "mamba2-g2": gguf.MODEL_ARCH.MAMBA2,
    "nemotronh-b": gguf.MODEL_ARCH.NEMOTRON_H_MOE,
    "granite-moe": gguf.MODEL_ARCH.GRANITE_HYBRID,
    "granite-dense": gguf.MODEL_ARCH.GRANITE_HYBRID,
}


def add_vocab(w: gguf.GGUFWriter, folder: Path, cfg: dict) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if "chat_template" in tok_cfg:
        w.add_chat_template(tok_cfg["chat_template"])


def add_mamba2_params(w: gguf.GGUFWriter, cfg: dict) -> tuple[int, int]:
    """As llama.cpp's `Mamba2Model.set_gguf_parameters`; returns (d_inner, groups)."""
    d_model = cfg["hidden_size"]
    d_inner = int(cfg.get("expand", 2) * d_model)
    head_dim = cfg["head_dim"]
    groups = cfg.get("n_groups", 1)
    w.add_context_length(2**20)  # the converter's "unlimited"
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(cfg["state_size"])
    w.add_ssm_time_step_rank(d_inner // head_dim)
    w.add_ssm_group_count(groups)
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return d_inner, groups


def add_nemotron_h_params(w: gguf.GGUFWriter, cfg: dict, moe: bool) -> tuple[int, int]:
    """As llama.cpp's `NemotronHModel.set_gguf_parameters` (through `GraniteHybridModel`)."""
    pattern = cfg["hybrid_override_pattern"]
    layers = len(pattern)
    d_inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    groups = cfg["n_groups"]
    w.add_context_length(2**20)  # no RoPE: the converter's "unlimited"
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if c == "*" else 0 for c in pattern])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    w.add_rope_scaling_finetuned(False)
    if moe:
        w.add_feed_forward_length([cfg["moe_intermediate_size"] if c == "E" else 0 for c in pattern])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    else:
        w.add_feed_forward_length([cfg["intermediate_size"] if c == "-" else 0 for c in pattern])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return d_inner, groups


def add_granite_params(w: gguf.GGUFWriter, cfg: dict) -> tuple[int, int]:
    """As llama.cpp's `GraniteHybridModel.set_gguf_parameters` (through the Llama, Granite and
    GraniteMoe converters)."""
    kinds = cfg["layer_types"]
    attn = [k in ("attention", "full_attention") for k in kinds]
    d_inner = int(cfg["mamba_expand"] * cfg["hidden_size"])
    groups = cfg["mamba_n_groups"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(len(kinds))
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if a else 0 for a in attn])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if cfg.get("num_local_experts"):
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(cfg.get("position_embedding_type") == "rope")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return d_inner, groups


def split_granite_mlps(tensors: dict, cfg: dict) -> dict:
    """The converter's split of each fused `input_linear` into gate and up halves."""
    out = {}
    experts = bool(cfg.get("num_local_experts"))
    for name, value in tensors.items():
        if not name.endswith("input_linear.weight"):
            out[name] = value
            continue
        layer = name.split(".")[2]
        gate, up = np.split(value, 2, axis=-2)
        if ".block_sparse_moe." in name:
            parts = ("ffn_gate_exps", "ffn_up_exps")
        elif experts:
            parts = ("ffn_gate_shexp", "ffn_up_shexp")
        else:
            parts = ("ffn_gate", "ffn_up")
        out[f"gguf:blk.{layer}.{parts[0]}.weight"] = gate
        out[f"gguf:blk.{layer}.{parts[1]}.weight"] = up
        if not experts and ".shared_mlp." in name:
            down = f"model.layers.{layer}.shared_mlp.output_linear.weight"
            out[f"gguf:blk.{layer}.ffn_down.weight"] = tensors[down]
    if not experts:
        out = {k: v for k, v in out.items() if not k.endswith("shared_mlp.output_linear.weight")}
    return out


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stack_experts(tensors: dict, cfg: dict) -> dict:
    """The converter's merge of per-expert projections into one tensor per layer."""
    out = {k: v for k, v in tensors.items() if ".mixer.experts." not in k}
    layers = {k.split(".")[2] for k in tensors if ".mixer.experts." in k}
    for layer in sorted(layers):
        for proj in ("up_proj", "down_proj"):
            parts = [
                tensors[f"backbone.layers.{layer}.mixer.experts.{e}.{proj}.weight"]
                for e in range(cfg["n_routed_experts"])
            ]
            out[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = np.stack(parts, axis=0)
    return out


def convert(name: str, arch: gguf.MODEL_ARCH) -> Path:
    folder = FIXTURES / name
    cfg = json.loads((folder / "config.json").read_text(), parse_constant=float)
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    # torch reads the bf16 fixtures numpy cannot; widened to f32 exactly.
    tensors = {
        k: v.float().numpy()
        for shard in sorted(folder.glob("model*.safetensors"))
        for k, v in load_file(str(shard)).items()
    }
    if arch == gguf.MODEL_ARCH.MAMBA2:
        d_inner, groups = add_mamba2_params(w, cfg)
        layers = cfg["num_hidden_layers"]
    elif arch == gguf.MODEL_ARCH.GRANITE_HYBRID:
        d_inner, groups = add_granite_params(w, cfg)
        layers = len(cfg["layer_types"])
        tensors = split_granite_mlps(tensors, cfg)
    else:
        d_inner, groups = add_nemotron_h_params(w, cfg, arch == gguf.MODEL_ARCH.NEMOTRON_H_MOE)
        layers = len(cfg["hybrid_override_pattern"])
        tensors = stack_experts(tensors, cfg)
    w.add_vocab_size(cfg["vocab_size"])
    add_vocab(w, folder, cfg)
    names = gguf.get_tensor_name_map(arch, layers)
    for hf, value in sorted(tensors.items()):
        value = value.astype(np.float32)
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        if hf.startswith("gguf:"):  # already named by the converter's own split
            w.add_tensor(hf.removeprefix("gguf:"), np.ascontiguousarray(value))
            continue
        if hf.endswith(("mixer.q_proj.weight", "self_attn.q_proj.weight")):
            value = permute(value, cfg["num_attention_heads"])
        elif hf.endswith(("mixer.k_proj.weight", "self_attn.k_proj.weight")):
            value = permute(value, cfg["num_key_value_heads"])
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if hf.endswith(".dt_bias"):
            hf = hf.removesuffix(".dt_bias") + ".dt_proj.bias"
        new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise SystemExit(f"{name}: no GGUF name for {hf}")
        if hf.endswith(".A_log"):
            value = -np.exp(value)
        if hf.endswith((".A_log", ".D")):
            value = value.reshape(*value.shape, 1)
        elif hf.endswith(".conv1d.weight"):
            value = value.squeeze(1)
        elif hf.endswith((".mixer.norm.weight", ".mamba.norm.weight")):
            value = value.reshape(groups, d_inner // groups)
        w.add_tensor(new, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, arch in MODELS.items():
        path = convert(name, arch)
        print(path.relative_to(ROOT), path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
