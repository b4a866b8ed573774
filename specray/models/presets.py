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

from specray.envs import cache_root
from specray.models.builtin_models import BUILTIN_MODELS, builtin_model_path
from specray.models.checkpoint_writer import random_weights, write_checkpoint
from specray.models.drafter_presets import (DRAFTER_SUFFIXES, MTP_CONFIG_KEYS, PRESET_FORMAT_TAG, drafter_preset,
                                           mtp_checkpoint)

BYTE_VOCAB = 320  # 256 bytes, BOS 256, EOS 257, padding up to a multiple of 64 for TP
_TINY = dict(vocab_size=BYTE_VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, bos_token_id=256, eos_token_id=257,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)

_MLA = dict(_TINY, num_key_value_heads=8, head_dim=16, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, n_routed_experts=16, n_shared_experts=1, moe_intermediate_size=128, num_experts_per_tok=2,
            routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True)  # head_dim = qk_rope_head_dim

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(_TINY, architectures=["LlamaForCausalLM"], model_type="llama"),
    "tiny-qwen3": dict(_TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "tiny-moe": dict(_TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    # DeepSeek-V3's shape, small: MLA (q_lora, YaRN, interleaved RoPE), DeepSeekMoE (16 routed experts in 4
    # groups, 2 groups kept, 1 shared, score bias), the first layer dense, and one MTP module in the checkpoint
    "tiny-deepseek-v3": dict(_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=128,
                             n_group=4, topk_group=2, rope_interleave=True, num_nextn_predict_layers=1,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                                  mscale_all_dim=1.0, original_max_position_embeddings=1024,
                                                  beta_fast=32, beta_slow=1)),
    # Kimi-K2's shape: the same class with a plain q_proj (q_lora_rank null) and one expert group
    "tiny-kimi-k2": dict(_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=None,
                         n_group=1, topk_group=1, rope_interleave=True, num_nextn_predict_layers=1,
                         rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, mscale=1.0,
                                              mscale_all_dim=1.0, original_max_position_embeddings=1024,
                                              beta_fast=1, beta_slow=1)),
    # Qwen3-Next's shape, small: three Gated DeltaNet layers then one gated full-attention layer (its
    # full_attention_interval 4, written out as layer_types), partial RoPE (a quarter of head_dim), 8 experts
    # with a gated shared expert, and one MTP module in the checkpoint (mtp.*), as Qwen3-Next ships it
    "tiny-qwen3-next": dict(_TINY, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=64,
                            num_attention_heads=4, num_key_value_heads=2,
                            layer_types=["linear_attention"] * 3 + ["full_attention"],
                            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                            linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=128, shared_expert_intermediate_size=256, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], mtp_num_hidden_layers=1,
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Kimi Linear's shape, small, in its own config.json spellings (num_experts, num_experts_per_token,
    # num_expert_group, moe_renormalize, linear_attn_config's 1-indexed layer lists): three KDA layers then one
    # MLA layer without RoPE (its 3:1 ratio), 4 KDA heads of 32, the first layer dense, DeepSeek-routed MoE after
    "tiny-kimi-linear": dict(_TINY, architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
                             num_key_value_heads=8, head_dim=16, q_lora_rank=None, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True,
                             num_experts=16, num_experts_per_token=2, num_expert_group=1, topk_group=1,
                             num_shared_experts=1, moe_intermediate_size=128, moe_renormalize=True,
                             routed_scaling_factor=2.446, first_k_dense_replace=1, pad_token_id=None,
                             linear_attn_config=dict(head_dim=32, num_heads=4, short_conv_kernel_size=4,
                                                     kda_layers=[1, 2, 3], full_attn_layers=[4])),
    "mid-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
                      intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}


def drafter_preset_name(target: str, method: str) -> str:
    """The drafter preset matching a target preset (drafter_presets.py builds them)."""
    return f"{target}-{DRAFTER_SUFFIXES[method]}"


def _drafter_presets() -> dict[str, tuple[str, str]]:
    return {drafter_preset_name(t, m): (t, m) for t in PRESETS for m in DRAFTER_SUFFIXES}


def is_preset(name: str) -> bool:
    return name in PRESETS or name in _drafter_presets()


def materialize(name: str, seed: int = 0) -> Path:
    """The checkpoint directory of preset ``name``, written on first use."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)} and their drafters "
                         f"{sorted(_drafter_presets())}")
    target = cache_root() / "presets" / f"{name}-seed{seed}"
    if name not in PRESETS:  # drafter presets carry their format's version: old caches are not reused
        target = target.with_name(target.name + PRESET_FORMAT_TAG)
    if (target / "model.safetensors").is_file():
        if name not in PRESETS or _is_current(target, PRESETS[name]):
            return target
        shutil.rmtree(target, ignore_errors=True)  # written by an older specray (the preset has grown since)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        if name in PRESETS:
            cfg = PRESETS[name]
            weights = random_weights(cfg, seed)
            num_mtp = next((cfg[key] for key in MTP_CONFIG_KEYS if cfg.get(key)), 0)
            if num_mtp:  # MTP modules inside the checkpoint, as DeepSeek-V3 and Qwen3-Next ship them
                cfg, weights = mtp_checkpoint(cfg, weights, seed, num_mtp)
        else:
            target_name, method = _drafter_presets()[name]
            cfg, weights = drafter_preset(PRESETS[target_name], target_name, method, seed)
        write_checkpoint(tmp, cfg, weights)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(directory: Path, cfg: dict) -> bool:
    """Whether a cached preset still says what the preset says (every key of ``cfg``, as JSON)."""
    try:
        saved = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(saved.get(key) == value for key, value in json.loads(json.dumps(cfg)).items())


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
