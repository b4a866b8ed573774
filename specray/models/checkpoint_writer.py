"""Seeded random checkpoints in Hugging Face's layout, written as real checkpoint directories
(``config.json`` plus ``model.safetensors``): what the presets and drafter presets are made of."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specray.models.kimi_checkpoint import random_kimi_linear_weights


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in Hugging Face names: N(0, 0.02) matrices, unit norms (Kimi Linear in
    Moonshot's own layout, kimi_checkpoint.py)."""
    if cfg["model_type"] == "kimi_linear":
        return random_kimi_linear_weights(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg.get("head_dim"), cfg["num_attention_heads"], cfg.get("num_key_value_heads")

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(v, h)
    if cfg["model_type"] == "deepseek_v3":
        for i in range(cfg["num_hidden_layers"]):
            w.update(_deepseek_layer(cfg, i, normal))
        return w
    if cfg["model_type"] == "qwen3_next":
        w["model.norm.weight"] = normal(h)  # zero-centred: scales by 1 + w
        for i in range(cfg["num_hidden_layers"]):
            w.update(_qwen3_next_layer(cfg, i, normal))
        return w
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = torch.ones(h)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        w[f"{p}.self_attn.q_proj.weight"] = normal(nh * hd, h)
        w[f"{p}.self_attn.k_proj.weight"] = normal(nkv * hd, h)
        w[f"{p}.self_attn.v_proj.weight"] = normal(nkv * hd, h)
        w[f"{p}.self_attn.o_proj.weight"] = normal(h, nh * hd)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            w[f"{p}.self_attn.q_norm.weight"] = torch.ones(hd)
            w[f"{p}.self_attn.k_norm.weight"] = torch.ones(hd)
        if cfg.get("num_experts"):
            e_inter = cfg["moe_intermediate_size"]
            w[f"{p}.mlp.gate.weight"] = normal(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = normal(e_inter, h)
                w[f"{p}.mlp.experts.{e}.up_proj.weight"] = normal(e_inter, h)
                w[f"{p}.mlp.experts.{e}.down_proj.weight"] = normal(h, e_inter)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = normal(inter, h)
            w[f"{p}.mlp.up_proj.weight"] = normal(inter, h)
            w[f"{p}.mlp.down_proj.weight"] = normal(h, inter)
    return w


def _deepseek_layer(cfg: dict, i: int, normal) -> dict[str, torch.Tensor]:
    """One DeepSeek-V3 / Kimi-K2 layer: MLA attention; a dense MLP for the first
    ``first_k_dense_replace`` layers, DeepSeekMoE (router with a non-zero score-correction
    bias, routed and shared experts) after."""
    h, nh, p = cfg["hidden_size"], cfg["num_attention_heads"], f"model.layers.{i}"
    rank, nope, rope, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = f"{p}.self_attn"
    w = {f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
         f"{a}.kv_a_proj_with_mqa.weight": normal(rank + rope, h), f"{a}.kv_a_layernorm.weight": torch.ones(rank),
         f"{a}.kv_b_proj.weight": normal(nh * (nope + v), rank), f"{a}.o_proj.weight": normal(h, nh * v)}
    if cfg.get("q_lora_rank"):
        q = cfg["q_lora_rank"]
        w.update({f"{a}.q_a_proj.weight": normal(q, h), f"{a}.q_a_layernorm.weight": torch.ones(q),
                  f"{a}.q_b_proj.weight": normal(nh * (nope + rope), q)})
    else:
        w[f"{a}.q_proj.weight"] = normal(nh * (nope + rope), h)
    is_moe = cfg.get("n_routed_experts") and i >= (cfg.get("first_k_dense_replace") or 0)
    parts = [("mlp", cfg["intermediate_size"])]
    if is_moe:
        e_inter = cfg["moe_intermediate_size"]
        parts = [(f"mlp.experts.{e}", e_inter) for e in range(cfg["n_routed_experts"])]
        if cfg.get("n_shared_experts"):
            parts.append(("mlp.shared_experts", e_inter * cfg["n_shared_experts"]))
        w[f"{p}.mlp.gate.weight"] = normal(cfg["n_routed_experts"], h)
        w[f"{p}.mlp.gate.e_score_correction_bias"] = normal(cfg["n_routed_experts"]) * 2
    for name, inter in parts:
        w.update({f"{p}.{name}.gate_proj.weight": normal(inter, h), f"{p}.{name}.up_proj.weight": normal(inter, h),
                  f"{p}.{name}.down_proj.weight": normal(h, inter)})
    return w


def _qwen3_next_layer(cfg: dict, i: int, normal) -> dict[str, torch.Tensor]:
    """One Qwen3-Next layer as ``layer_types`` says: gated attention (q_proj holds q and its gate)
    or Gated DeltaNet; a dense MLP in ``mlp_only_layers``, else MoE with the gated shared expert.
    Zero-centred norms get N(0, 0.02) weights (scale 1 + w); A_log and dt_bias as transformers
    initialises them (A uniform in [1, 16], dt_bias 1)."""
    h, nh, nkv, hd, p = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], \
        f"model.layers.{i}"
    w = {f"{p}.input_layernorm.weight": normal(h), f"{p}.post_attention_layernorm.weight": normal(h)}
    if cfg["layer_types"][i] == "full_attention":
        a = f"{p}.self_attn"
        w.update({f"{a}.q_proj.weight": normal(2 * nh * hd, h), f"{a}.k_proj.weight": normal(nkv * hd, h),
                  f"{a}.v_proj.weight": normal(nkv * hd, h), f"{a}.o_proj.weight": normal(h, nh * hd),
                  f"{a}.q_norm.weight": normal(hd), f"{a}.k_norm.weight": normal(hd)})
    else:
        a, nk, nv = f"{p}.linear_attn", cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        w.update({f"{a}.in_proj_qkvz.weight": normal(2 * nk * dk + 2 * nv * dv, h),
                  f"{a}.in_proj_ba.weight": normal(2 * nv, h),
                  f"{a}.conv1d.weight": normal(2 * nk * dk + nv * dv, 1, cfg["linear_conv_kernel_dim"]) * 10,
                  f"{a}.A_log": torch.linspace(1, 16, nv).log(), f"{a}.dt_bias": torch.ones(nv),
                  f"{a}.norm.weight": torch.ones(dv), f"{a}.out_proj.weight": normal(h, nv * dv)})
    parts = [("mlp", cfg["intermediate_size"])]
    if cfg.get("num_experts") and i not in (cfg.get("mlp_only_layers") or []):
        parts = [(f"mlp.experts.{e}", cfg["moe_intermediate_size"]) for e in range(cfg["num_experts"])]
        parts.append(("mlp.shared_expert", cfg["shared_expert_intermediate_size"]))
        w.update({f"{p}.mlp.gate.weight": normal(cfg["num_experts"], h),
                  f"{p}.mlp.shared_expert_gate.weight": normal(1, h)})
    for name, inter in parts:
        w.update({f"{p}.{name}.gate_proj.weight": normal(inter, h), f"{p}.{name}.up_proj.weight": normal(inter, h),
                  f"{p}.{name}.down_proj.weight": normal(h, inter)})
    return w


def write_checkpoint(directory: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32"), indent=2))
    save_file({k: t.contiguous() for k, t in weights.items()}, str(directory / "model.safetensors"))
