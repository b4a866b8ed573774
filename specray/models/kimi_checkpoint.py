"""Seeded random Kimi Linear checkpoints in the layout Moonshot's own checkpoints have (what
``tiny-kimi-linear`` is made of; ``checkpoint_writer.random_weights`` calls it for this family): KDA layers with separate ``q/k/v_conv1d``, ``f_a/f_b_proj``, ``A_log [1, 1, heads, 1]``
and ``dt_bias``; MLA layers as DeepSeek's; dense MLPs under ``mlp``, MoE under
``block_sparse_moe`` with ``w1``/``w3``/``w2`` experts, a router with its score-correction bias
and ``shared_experts``."""

from __future__ import annotations

import torch

from specray.models.hybrid_arch import kimi_config, kimi_layer_types, read_mlp_layer_types


def random_kimi_linear_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: N(0, 0.02) matrices, unit norms; A and dt_bias in the ranges
    transformers initialises them in (A in [1, 16], softplus(dt_bias) in [1e-3, 1e-1])."""
    gen = torch.Generator().manual_seed(seed)
    cfg = kimi_config(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": normal(v, h)}
    types = kimi_layer_types(cfg, "preset")
    moe = set(read_mlp_layer_types(cfg, "preset"))
    for i, kind in enumerate(types):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h)})
        mixer = _kda if kind == "linear_attention" else _mla
        w.update(mixer(cfg, f"{p}.self_attn", normal))
        w.update(_moe(cfg, f"{p}.block_sparse_moe", normal) if i in moe else _mlp(h, cfg["intermediate_size"],
                                                                                   f"{p}.mlp", normal))
    return w


def _kda(cfg: dict, a: str, normal) -> dict[str, torch.Tensor]:
    lin, h = cfg["linear_attn_config"], cfg["hidden_size"]
    heads, dim, kernel = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    width = heads * dim
    dt = torch.logspace(-3, -1, width)
    w = {f"{a}.{n}_proj.weight": normal(width, h) for n in ("q", "k", "v")}
    w.update({f"{a}.{n}_conv1d.weight": normal(width, 1, kernel) * 10 for n in ("q", "k", "v")})
    w.update({f"{a}.f_a_proj.weight": normal(dim, h), f"{a}.f_b_proj.weight": normal(width, dim),
              f"{a}.g_a_proj.weight": normal(dim, h), f"{a}.g_b_proj.weight": normal(width, dim),
              f"{a}.b_proj.weight": normal(heads, h), f"{a}.o_proj.weight": normal(h, width),
              f"{a}.A_log": torch.linspace(1, 16, heads).log().view(1, 1, heads, 1),
              f"{a}.dt_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
              f"{a}.o_norm.weight": torch.ones(dim)})
    return w


def _mla(cfg: dict, a: str, normal) -> dict[str, torch.Tensor]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rank, nope, rope, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return {f"{a}.q_proj.weight": normal(heads * (nope + rope), h),
            f"{a}.kv_a_proj_with_mqa.weight": normal(rank + rope, h), f"{a}.kv_a_layernorm.weight": torch.ones(rank),
            f"{a}.kv_b_proj.weight": normal(heads * (nope + v), rank), f"{a}.o_proj.weight": normal(h, heads * v)}


def _mlp(h: int, inter: int, p: str, normal, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
    gate, up, down = names
    return {f"{p}.{gate}.weight": normal(inter, h), f"{p}.{up}.weight": normal(inter, h),
            f"{p}.{down}.weight": normal(h, inter)}


def _moe(cfg: dict, p: str, normal) -> dict[str, torch.Tensor]:
    h, experts, inter = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    w = {f"{p}.gate.weight": normal(experts, h), f"{p}.gate.e_score_correction_bias": normal(experts) * 2}
    for e in range(experts):
        w.update(_mlp(h, inter, f"{p}.experts.{e}", normal, ("w1", "w3", "w2")))
    return dict(w, **_mlp(h, inter * cfg.get("n_shared_experts", 1), f"{p}.shared_experts", normal))
