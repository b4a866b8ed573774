"""Built-in presets: small Hugging Face checkpoints with seeded random weights.

A preset is written once as a real checkpoint directory (``config.json`` plus
``model.safetensors``) under the cache (``$SPECRAY_CACHE``, default ``~/.cache/specray``)
and then loaded through the same loader as any checkpoint, so demos and benchmarks need no
download and exercise the real loading path. Writes go to a temporary directory renamed
into place, so concurrent ranks or jobs never see a half-written preset.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from specray.models.builtin_models import BUILTIN_MODELS, builtin_model_path

BYTE_VOCAB = 320  # 256 bytes, BOS 256, EOS 257, padding up to a multiple of 64 for TP
_TINY = dict(vocab_size=BYTE_VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, bos_token_id=256, eos_token_id=257,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama"),
    "tiny-qwen3": dict(_TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "tiny-moe": dict(_TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    "mid-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
                      intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}


def drafter_preset_name(target: str, method: str) -> str:
    """The drafter preset matching a target preset (drafter_presets.py builds them)."""
    from specray.models.drafter_presets import DRAFTER_SUFFIXES

    return f"{target}-{DRAFTER_SUFFIXES[method]}"


def _drafter_presets() -> dict[str, tuple[str, str]]:
    from specray.models.drafter_presets import DRAFTER_SUFFIXES

    return {drafter_preset_name(t, m): (t, m) for t in PRESETS for m in DRAFTER_SUFFIXES}


def is_preset(name: str) -> bool:
    return name in PRESETS or name in _drafter_presets()


def cache_root() -> Path:
    return Path(os.environ.get("SPECRAY_CACHE", Path.home() / ".cache" / "specray"))


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


def materialize(name: str, seed: int = 0) -> Path:
    """The checkpoint directory of preset ``name``, written on first use."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)} and their drafters "
                         f"{sorted(_drafter_presets())}")
    target = cache_root() / "presets" / f"{name}-seed{seed}"
    if name not in PRESETS:  # drafter presets carry their format's version: old caches are not reused
        from specray.models.drafter_presets import PRESET_FORMAT_TAG

        target = target.with_name(target.name + PRESET_FORMAT_TAG)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        if name in PRESETS:
            cfg, weights = PRESETS[name], random_weights(PRESETS[name], seed)
        else:
            from specray.models.drafter_presets import drafter_preset

            cfg, weights = drafter_preset(*_drafter_presets()[name], seed)
        write_checkpoint(tmp, cfg, weights)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str, seed: int = 0) -> Path:
    """A built-in model, a preset name, a checkpoint directory or a GGUF file -> the path to load."""
    if model in BUILTIN_MODELS:
        return builtin_model_path(model)
    if is_preset(model):
        return materialize(model, seed)
    path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        raise ValueError(f"model {model!r} is neither a built-in model ({sorted(BUILTIN_MODELS)}), a preset "
                         f"({sorted(PRESETS)}, or a drafter preset such as 'tiny-llama-draft'), a checkpoint "
                         f"directory nor a .gguf file")
    return path
