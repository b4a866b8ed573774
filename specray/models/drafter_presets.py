"""Drafter presets matching the target presets: ``<target>-draft`` (draft_model),
``<target>-dflash``, ``<target>-eagle3`` and ``<target>-mtp``.

Written as real checkpoint directories by ``presets.materialize`` like the target presets.

- ``<target>-draft``: a one-layer causal LM of the target's family and vocabulary made of
  the target preset's own seeded embedding, first layer, final norm and LM head (an
  early-exit copy). How often it agrees with the target depends on the model, as measured:
  for the tests' small transformers-built checkpoints (hidden 64, vocab 384), often but not
  always, so partial acceptance and rollback both happen; for the presets (mid-llama and
  the tiny ones), almost never (acceptance length 1.00-1.02), so benchmarks use forced
  acceptance to measure the engine at a chosen acceptance length.
- the heads: seeded random weights (N(0, 0.02) matrices, unit norms) in the formats that
  dflash.py and hidden_state.py document, sized from the target's architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specray.models.arch import ModelArch, arch_from_hf_config
from specray.models.checkpoint_writer import random_weights, write_checkpoint

HEAD_ARCHITECTURES = {"eagle3": "SpecrayEagle3Drafter", "mtp": "SpecrayMTPDrafter", "dflash": "SpecrayDFlashDrafter"}
"""The ``architectures`` entry of each head format's config.json (drafters/ checks it on load)."""
DRAFTER_SUFFIXES = {"draft_model": "draft", "dflash": "dflash", "eagle3": "eagle3", "mtp": "mtp"}
HEAD_SEED_OFFSET = {"dflash": 1, "eagle3": 2, "mtp": 3}  # distinct weights per head kind


def feature_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high target layers (EAGLE-3's choice, scaled to small models)."""
    return sorted({0, num_layers // 2, num_layers - 1})


def head_config(method: str, target: ModelArch) -> dict:
    cfg = dict(architectures=[HEAD_ARCHITECTURES[method]], model_type=f"specray_{method}",
               vocab_size=target.vocab_size, hidden_size=target.hidden_size,
               intermediate_size=target.intermediate_size or 4 * target.hidden_size, num_hidden_layers=1,
               num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads,
               head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
               max_position_embeddings=target.max_position_embeddings)
    if method in ("eagle3", "dflash"):
        cfg["target_layer_ids"] = feature_layer_ids(target.num_layers)
    if method == "dflash":
        cfg.update(num_hidden_layers=2, block_size=16, mask_token_id=target.vocab_size - 1)
    return cfg


def head_weights(method: str, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 16 + HEAD_SEED_OFFSET[method])
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"norm.weight": torch.ones(h)}
    if method in ("eagle3", "dflash"):
        w["fc.weight"] = normal(h, len(cfg["target_layer_ids"]) * h)
    if method == "dflash":
        w["hidden_norm.weight"] = torch.ones(h)
    else:
        w.update({"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "eh_proj.weight": normal(h, 2 * h)})
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        w.update({f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                  f"{p}.self_attn.q_proj.weight": normal(nh * hd, h), f"{p}.self_attn.k_proj.weight": normal(nkv * hd, h),
                  f"{p}.self_attn.v_proj.weight": normal(nkv * hd, h), f"{p}.self_attn.o_proj.weight": normal(h, nh * hd),
                  f"{p}.mlp.gate_proj.weight": normal(inter, h), f"{p}.mlp.up_proj.weight": normal(inter, h),
                  f"{p}.mlp.down_proj.weight": normal(h, inter)})
    return w


def early_exit_weights(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Keep the embedding, head, final norm and the first ``num_layers`` decoder layers."""
    def kept(name: str) -> bool:
        if not name.startswith("model.layers."):
            return True
        return int(name.split(".")[2]) < num_layers

    return {name: t for name, t in weights.items() if kept(name)}


def drafter_preset(target_cfg: dict, target_name: str, method: str,
                   seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of the drafter preset for the target preset ``target_name`` (config ``target_cfg``)."""
    if method == "draft_model":
        return dict(target_cfg, num_hidden_layers=1), early_exit_weights(random_weights(target_cfg, seed), 1)
    cfg = head_config(method, arch_from_hf_config(target_cfg, source=target_name))
    return cfg, head_weights(method, cfg, seed)


def write_drafter_for(target_dir: str | Path, method: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a drafter checkpoint matching any target checkpoint directory (tests, custom
    targets): draft_model = the target's early-exit copy, heads = seeded random weights."""
    target_dir, directory = Path(target_dir), Path(directory)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    if method == "draft_model":
        weights = {}
        for f in sorted(target_dir.glob("*.safetensors")):
            with safe_open(f, "pt") as handle:
                weights.update({name: handle.get_tensor(name) for name in handle.keys()})
        cfg = dict(target_cfg, num_hidden_layers=1)
        cfg.pop("layer_types", None)
        write_checkpoint(directory, cfg, early_exit_weights(weights, 1))
        return directory
    cfg = head_config(method, arch_from_hf_config(target_cfg, source=str(target_dir)))
    write_checkpoint(directory, cfg, head_weights(method, cfg, seed))
    return directory
