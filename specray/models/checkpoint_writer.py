"""Seeded random checkpoints in Hugging Face's layout, written as real checkpoint directories
(``config.json`` plus ``model.safetensors``): what the presets and drafter presets are made of."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in Hugging Face names: N(0, 0.02) matrices, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(v, h)
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


def write_checkpoint(directory: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32"), indent=2))
    save_file({k: t.contiguous() for k, t in weights.items()}, str(directory / "model.safetensors"))
