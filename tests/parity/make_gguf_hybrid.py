"""State-space fixtures written as GGUF the way llama.cpp's `convert_hf_to_gguf.py` writes them.

`mamba2-g2` becomes `mamba2`; `nemotronh-b` (attention, Mamba2, relu² MLP and MoE layers)
becomes `nemotron_h_moe` (`nemotron_h` without experts); `granite-moe` (RoPE attention, experts
and a shared MLP) and `granite-dense` (no positional encoding, shared MLP only) become
`granitehybrid`; `qwen35-a` (Gated DeltaNet and gated attention) becomes `qwen35`.

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

- Qwen3.5: zero-centred norms stored as `w + 1` (not the Gated DeltaNet's own gated norm),
  value heads tiled (`v0k0 v0k1 v1k0 v1k1`) rather than grouped by key head in every tensor
  with a row per value head or value element (the value block of `in_proj_qkv` and `conv1d`,
  `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`) and in the columns of `out_proj`,
  `A_log` as `-exp(A_log)`, `rope.dimension_sections` for the multimodal RoPE.

The Rust test compares each file with chimera's own load of the fixture's safetensors (the same
weights in two containers); transformers cannot load Mamba2, NemotronH or Granite GGUFs. It
can load Qwen3.5 ones: for `qwen35-a` it writes `<name>-reference.json` with transformers'
last-position logits and greedy continuation on the GGUF file.

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
    "qwen35-a": gguf.MODEL_ARCH.QWEN35,
}
# transformers loads these architectures from GGUF itself: its logits are recorded too.
TRANSFORMERS_READS = {"qwen35-a"}


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


def add_qwen35_params(w: gguf.GGUFWriter, cfg: dict) -> None:
    """The `qwen35.*` keys transformers' GGUF config mapping reads (as llama.cpp writes them)."""
    kinds = cfg["layer_types"]
    interval = kinds.index("full_attention") + 1
    if any((k == "full_attention") != ((i + 1) % interval == 0) for i, k in enumerate(kinds)):
        raise SystemExit("qwen35: layer_types is not one full attention layer every `interval`")
    rope = cfg["rope_parameters"]
    rotary = int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_full_attention_interval(interval)
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(rotary)
    # Text puts every token at the same position on all three axes, so the split of the rotary
    # pairs between them changes nothing; transformers wants three non-zero sections.
    w.add_rope_dimension_sections(rope.get("mrope_section", [1, 1, 1]) + [0])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def tile_value_heads(tensors: dict, cfg: dict) -> dict:
    """llama.cpp's order of value heads: tiled over key heads instead of grouped by them."""
    k_heads = cfg["linear_num_key_heads"]
    per_k = cfg["linear_num_value_heads"] // k_heads
    v_dim = cfg["linear_value_head_dim"]
    qk_rows = 2 * cfg["linear_key_head_dim"] * k_heads

    def order(dim: int) -> np.ndarray:
        return np.arange(k_heads * per_k * dim).reshape(k_heads, per_k, dim).transpose(1, 0, 2).reshape(-1)

    out = {}
    for name, value in tensors.items():
        if ".linear_attn." in name:
            leaf = name.split(".linear_attn.", 1)[1]
            if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
                value = np.concatenate([value[:qk_rows], value[qk_rows:][order(v_dim)]])
            elif leaf == "in_proj_z.weight":
                value = value[order(v_dim)]
            elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
                value = value[order(1)]
            elif leaf == "out_proj.weight":
                value = value[:, order(v_dim)]
        out[name] = value
    return out


def qwen35_reference(path: Path, folder: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok(text, add_special_tokens=True)["input_ids"]
    prompt = (ids * 8)[:40]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )
    return {
        "file": path.name,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "text": text,
        "text_ids": ids,
        "prompt_ids": prompt,
        "last_logits": [float(v) for v in logits],
        "output_ids": out[0, len(prompt) :].tolist(),
    }


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
    elif arch == gguf.MODEL_ARCH.QWEN35:
        add_qwen35_params(w, cfg)
        d_inner, groups = 0, 1
        layers = cfg["num_hidden_layers"]
        tensors = tile_value_heads(tensors, cfg)
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
        if arch == gguf.MODEL_ARCH.QWEN35:
            pass  # Qwen rotates halves as llama.cpp's NeoX mode does: no q/k permutation
        elif hf.endswith(("mixer.q_proj.weight", "self_attn.q_proj.weight")):
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
        if arch == gguf.MODEL_ARCH.QWEN35:
            if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
                value = value + 1.0  # zero-centred norms, stored as w + 1
            elif hf.endswith(".conv1d.weight"):
                value = value.squeeze(1)
        elif hf.endswith((".A_log", ".D")):
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
        if name in TRANSFORMERS_READS:
            ref = qwen35_reference(path, FIXTURES / name)
            out = OUT / f"{name}-reference.json"
            out.write_text(json.dumps(ref, indent=1) + "\n")
            print(out.relative_to(ROOT), ref["output_ids"])


if __name__ == "__main__":
    main()
