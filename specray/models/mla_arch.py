"""The parts of the architecture record that only MLA / DeepSeekMoE models have
(``DeepseekV3ForCausalLM``; Kimi-K2 checkpoints use the same class), read from their
``config.json`` once, with every rule checked there so that a bad config fails on the driver
before any rank starts.

- ``MLAArch``: multi-head latent attention. The KV cache holds one latent row per token,
  ``kv_lora_rank`` (``c``, after ``kv_a_layernorm``) + ``qk_rope_head_dim`` (``k_rot``, after RoPE).
  The saved config's ``head_dim`` is ``qk_rope_head_dim`` (transformers writes it so for its RoPE
  tables): it is not the attention head size, which is ``qk_nope_head_dim + qk_rope_head_dim``.
- ``YarnRope``: YaRN RoPE scaling (DeepSeek's: the softmax scale also gets ``mscale^2``).
- ``GroupedRouter``: DeepSeekMoE's sigmoid router with ``e_score_correction_bias``,
  group-limited top-k, ``routed_scaling_factor`` and shared experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specray.errors import ConfigError, require_keys

MLA_KEYS = {
    "kv_lora_rank": "the width of the latent c that the KV cache holds per token",
    "qk_nope_head_dim": "the per-head query/key width without RoPE",
    "qk_rope_head_dim": "the per-head query/key width with RoPE (one k_rot shared by every head)",
    "v_head_dim": "the per-head value width",
}
ROUTER_KEYS = {
    "n_routed_experts": "the number of routed experts",
    "num_experts_per_tok": "how many routed experts each token is sent to",
    "moe_intermediate_size": "the intermediate size of one expert",
    "n_group": "the expert groups of the group-limited top-k",
    "topk_group": "how many groups each token may choose experts from",
}
YARN_KEYS = {
    "factor": "the YaRN context extension factor",
    "original_max_position_embeddings": "the context length the RoPE frequencies were trained at",
}


@dataclass(frozen=True, slots=True)
class MLAArch:
    q_lora_rank: int | None  # None: a plain q_proj (Kimi-K2)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    # False: no positional encoding at all (Kimi Linear's full attention); the qk_rope_head_dim part of
    # q and the shared k_rot are still there, unrotated
    has_rope: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent row of the pool: [c | k_rot]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class YarnRope:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' ``_compute_yarn_parameters``)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """DeepSeek's softmax scale multiplier, ``mscale(factor, mscale_all_dim)^2``."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class GroupedRouter:
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    num_shared_experts: int


def read_yarn(rope: dict, source: str) -> YarnRope:
    require_keys(rope, YARN_KEYS, f"{source} rope_parameters (rope_type 'yarn')")
    return YarnRope(factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                    truncate=bool(rope.get("truncate", True)))


def read_mla(cfg: dict, source: str) -> MLAArch:
    require_keys(cfg, MLA_KEYS, source)
    if "q_lora_rank" not in cfg:
        raise ConfigError(f"{source}: missing key 'q_lora_rank' (the query's low-rank width; null for a "
                          f"plain q_proj, as Kimi-K2)")
    mla = MLAArch(q_lora_rank=cfg["q_lora_rank"] or None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                  qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                  v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)))
    if mla.qk_rope_head_dim <= 0 or mla.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim ({mla.qk_rope_head_dim}) must be a positive even number: "
                          f"RoPE rotates pairs of dimensions")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(mla, key) <= 0:
            raise ConfigError(f"{source}: {key} ({getattr(mla, key)}) must be positive")
    return mla


def read_router(cfg: dict, source: str) -> GroupedRouter:
    """DeepSeekMoE's routing parameters; errors state the rule each breaks."""
    require_keys(cfg, ROUTER_KEYS, source)
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    n_group, topk_group = int(cfg["n_group"] or 1), int(cfg["topk_group"] or 1)
    if n_group < 1 or experts % n_group:
        raise ConfigError(f"{source}: n_routed_experts ({experts}) must be divisible by n_group ({n_group}): "
                          f"the router scores equal groups of experts")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{source}: topk_group ({topk_group}) must be between 1 and n_group ({n_group})")
    per_group = experts // n_group
    if per_group < 2 and n_group > 1:
        raise ConfigError(f"{source}: each of the n_group ({n_group}) groups must hold at least 2 experts "
                          f"(a group is scored by its top-2), not {per_group}")
    if not 1 <= top_k <= topk_group * per_group:
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) must be between 1 and the experts of the "
                          f"topk_group ({topk_group}) groups a token may use ({topk_group * per_group})")
    return GroupedRouter(n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                         num_shared_experts=int(cfg.get("n_shared_experts") or 0))
