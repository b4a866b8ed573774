"""Model architecture read from a Hugging Face ``config.json``.

One decoder covers every supported family; the table below says how each family differs
(q/k norm, MoE routing, checkpoint names of the expert weights). Adding a family is a row,
not a copy of the model file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specray.errors import require_keys
from specray.models.hybrid_arch import (KIMI_LAYER_MIXERS, GatedDeltaArch, kimi_config, kimi_layer_types,
                                        read_gated_delta, read_kda, read_layer_mixers, read_mlp_layer_types,
                                        read_rotary_dim)
from specray.models.mla_arch import GroupedRouter, MLAArch, YarnRope, read_mla, read_router, read_yarn


@dataclass(frozen=True, slots=True)
class Family:
    has_qk_norm: bool
    moe_prefix: str | None = None  # the MLP module name of MoE layers ("mlp", "block_sparse_moe")
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    always_norm_topk: bool = False  # Mixtral renormalises the top-k weights unconditionally
    expert_size_key: str = "moe_intermediate_size"  # config key of one expert's intermediate size
    mixer: str = "attention"  # the token mixer of its layers: "attention" (GQA, K/V pool) or "mla" (latent pool)
    is_hybrid: bool = False  # per-layer mixers from layer_types: gated attention and linear attention (state slots)
    router: str = "softmax"  # "softmax" top-k, or "grouped_sigmoid" (DeepSeekMoE: bias, groups, shared experts)
    # where a dense layer's MLP may sit, first found wins: Kimi Linear's own checkpoints say "mlp", and
    # transformers' save_pretrained writes "block_sparse_moe" (its load-time renaming, reversed)
    dense_prefixes: tuple[str, ...] = ("mlp",)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(has_qk_norm=False),
    "Qwen3ForCausalLM": Family(has_qk_norm=True),
    "Qwen3MoeForCausalLM": Family(has_qk_norm=True, moe_prefix="mlp"),
    "MixtralForCausalLM": Family(
        has_qk_norm=False, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), always_norm_topk=True,
        expert_size_key="intermediate_size",
    ),
    # Kimi-K2 checkpoints use this class too (q_lora_rank null, n_group 1)
    "DeepseekV3ForCausalLM": Family(has_qk_norm=False, moe_prefix="mlp", mixer="mla", router="grouped_sigmoid"),
    # gated attention and Gated DeltaNet layers as layer_types says; MoE with a sigmoid-gated shared expert
    "Qwen3NextForCausalLM": Family(has_qk_norm=True, moe_prefix="mlp", mixer="gated_attention", is_hybrid=True),
    # KDA and MLA-without-RoPE layers as layer_types says; DeepSeek's router; dense or MoE per mlp_layer_types
    "KimiLinearForCausalLM": Family(has_qk_norm=False, moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
                                    mixer="mla", is_hybrid=True, router="grouped_sigmoid",
                                    dense_prefixes=("mlp", "block_sparse_moe")),
}
# "gated_attention": GQA with an output gate from q_proj (Qwen3-Next's full attention, K/V pool);
# "linear_attention": Gated DeltaNet over a state slot (kv/state.py); "kda": Kimi Linear's KDA over one
MIXERS = ("attention", "mla", "gated_attention", "linear_attention", "kda")
LINEAR_MIXERS = ("linear_attention", "kda")  # the mixers over state slots rather than pages


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    mixers: tuple[str, ...] = ()  # per layer (empty: the family's mixer everywhere)
    mla: MLAArch | None = None
    yarn: YarnRope | None = None
    router: GroupedRouter | None = None  # DeepSeekMoE routing; None: softmax top-k
    linear: GatedDeltaArch | None = None  # the linear-attention layers' shape (hybrid models)
    rotary_dim: int = 0  # the dims RoPE rotates (partial RoPE); 0: the whole head
    is_zero_centred_norm: bool = False  # RMSNorms scale by (1 + w) (Qwen3-Next), not w
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert beside the routed ones (Qwen3-Next)

    def __post_init__(self) -> None:
        bad = [m for m in self.mixers if m not in MIXERS]
        if bad or (self.mixers and len(self.mixers) != self.num_layers):
            raise ValueError(f"mixers {self.mixers} must name one of {MIXERS} for each of the {self.num_layers} layers")
        if self.mla is None and "mla" in self.mixers:
            raise ValueError("an MLA layer needs the MLA record (mla)")
        if self.linear is None and any(m in LINEAR_MIXERS for m in self.mixers):
            raise ValueError("a linear-attention layer needs the GatedDeltaArch record (linear)")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def mixer_of(self, layer: int) -> str:
        """The token mixer of layer ``layer``; past the last layer (MTP blocks) the family's."""
        return self.mixers[layer] if layer < len(self.mixers) else self.family.mixer

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: the whole head, or MLA's qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose K/V (or latent rows) live in the paged pool: all but linear attention,
        whose per-sequence state lives in state slots instead."""
        return tuple(i for i in range(self.num_layers) if self.mixer_of(i) not in LINEAR_MIXERS)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.mixer_of(i) in LINEAR_MIXERS)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self, dtype_size: int, tp_size: int) -> int:
        """Bytes one token's K and V (MLA: its latent row, on every rank whole) take on one rank,
        over all layers."""
        if self.mla is not None:
            return len(self.kv_layers) * self.mla.latent_dim * dtype_size
        kv_heads = max(self.num_kv_heads // tp_size, 1)
        return 2 * len(self.kv_layers) * kv_heads * self.head_dim * dtype_size


def read_arch(checkpoint_dir: str | Path) -> ModelArch:
    """Parse ``config.json``; errors name the directory and what is missing or unsupported."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint directory {str(checkpoint_dir)!r} has no config.json")
    cfg = json.loads(path.read_text())
    return arch_from_hf_config(cfg, source=str(path))


# The keys every target config must have, and what each is for (the rest have defaults).
REQUIRED_KEYS = {
    "vocab_size": "the vocabulary size: rows of the embedding and the LM head",
    "hidden_size": "the width of the residual stream",
    "num_hidden_layers": "the number of decoder layers",
    "num_attention_heads": "the query heads of each attention layer",
}


def arch_from_hf_config(cfg: dict, source: str = "config") -> ModelArch:
    """The architecture a Hugging Face config describes; ``source`` (the file, or a preset's
    name) is named in every error."""
    archs = cfg.get("architectures") or []
    supported = [a for a in archs if a in FAMILIES]
    if not supported:
        raise ValueError(
            f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"supported: {sorted(FAMILIES)}"
        )
    family = FAMILIES[supported[0]]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    allowed = ("default", "yarn") if family.mixer == "mla" else ("default",)
    if rope_type not in allowed:
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported for {supported[0]}; "
                         f"supported: {list(allowed)}")
    require_keys(cfg, REQUIRED_KEYS, source)
    if family.mixer == "mla" and family.is_hybrid:
        return _kimi_linear_arch(cfg, supported[0], rope, source)
    if family.mixer == "mla":
        return _mla_arch(cfg, supported[0], rope, source)
    if family.is_hybrid:
        # the Qwen3-MoE reading covers the rest of the config (same keys, same rules)
        base = arch_from_hf_config(dict(cfg, architectures=["Qwen3MoeForCausalLM"]), source)
        return _hybrid_arch(cfg, base, rope, source)
    num_heads = cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    moe_layers: tuple[int, ...] = ()
    if num_experts and FAMILIES[supported[0]].moe_prefix:
        family = FAMILIES[supported[0]]
        require_keys(cfg, {family.expert_size_key: "the intermediate size of one expert",
                           "num_experts_per_tok": "how many experts each token is routed to"}, source)
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    else:
        num_experts = 0
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelArch(
        architecture=supported[0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        num_experts=num_experts,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if num_experts else 0,
        moe_intermediate_size=cfg.get(FAMILIES[supported[0]].expert_size_key, 0) if num_experts else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) or FAMILIES[supported[0]].always_norm_topk,
        moe_layers=moe_layers,
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def _mla_arch(cfg: dict, architecture: str, rope: dict, source: str) -> ModelArch:
    """DeepSeek-V3 / Kimi-K2: MLA layers, the first ``first_k_dense_replace`` dense, the rest
    DeepSeekMoE. ``head_dim`` is the attention head size, qk_nope + qk_rope (the config's own
    ``head_dim`` key is qk_rope_head_dim and is not read)."""
    mla = read_mla(cfg, source)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = read_yarn(rope, source) if rope_type == "yarn" else None
    num_layers, num_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    num_experts = int(cfg.get("n_routed_experts") or 0)
    router, moe_layers = None, ()
    if num_experts:
        router = read_router(cfg, source)
        dense = int(cfg.get("first_k_dense_replace") or 0)
        if not 0 <= dense <= num_layers:
            raise ValueError(f"{source}: first_k_dense_replace ({dense}) must be between 0 and "
                             f"num_hidden_layers ({num_layers})")
        moe_layers = tuple(range(dense, num_layers))
    if len(moe_layers) < num_layers:
        require_keys(cfg, {"intermediate_size": "the MLP width of the dense layers"}, source)
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelArch(
        architecture=architecture, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_heads, head_dim=mla.qk_head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]) if num_experts else 0,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]) if num_experts else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe_layers,
        eos_token_ids=tuple(int(e) for e in eos_ids), mixers=("mla",) * num_layers, mla=mla, yarn=yarn,
        router=router)


def _hybrid_arch(cfg: dict, base: ModelArch, rope: dict, source: str) -> ModelArch:
    """Qwen3-Next: the Qwen3-MoE record (heads, experts, mlp_only_layers, decoder_sparse_step) read
    by the same code, plus per-layer mixers, the Gated DeltaNet shape, partial RoPE, zero-centred
    norms and the shared expert."""
    mixers = read_layer_mixers(cfg, source)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if base.num_experts else 0
    return replace(base, architecture="Qwen3NextForCausalLM", mixers=mixers, linear=read_gated_delta(cfg, source),
                   rotary_dim=read_rotary_dim(cfg, rope, base.head_dim, source), is_zero_centred_norm=True,
                   shared_expert_intermediate_size=shared)


def _kimi_linear_arch(cfg: dict, architecture: str, rope: dict, source: str) -> ModelArch:
    """Kimi Linear: the DeepSeek-V3 record (MLA, DeepSeekMoE router) read by the same code from the
    config with Kimi's key spellings mapped, plus per-layer mixers (KDA or MLA), the KDA shape, MLA
    without RoPE (transformers' KimiLinearAttention never rotates; ``mla_use_nope`` in the
    checkpoint's config says so) and the MoE layers of ``mlp_layer_types``."""
    cfg = kimi_config(cfg)
    if cfg.get("mla_use_nope") is False:
        raise ValueError(f"{source}: mla_use_nope false (RoPE in the full-attention layers) is not supported: "
                         f"Kimi Linear's MLA layers use no positional encoding")
    mixers = read_layer_mixers(cfg, source, KIMI_LAYER_MIXERS, kimi_layer_types(cfg, source))
    base = _mla_arch(dict(cfg, first_k_dense_replace=0), architecture, rope, source)
    moe_layers = read_mlp_layer_types(cfg, source) if base.num_experts else ()
    if len(moe_layers) < base.num_layers and not base.intermediate_size:
        raise ValueError(f"{source}: missing key 'intermediate_size' (the MLP width of the dense layers)")
    # no RoPE tables and no YaRN softmax factor: transformers' KimiLinearAttention scales by
    # qk_head_dim^-0.5 whatever rope_scaling says
    return replace(base, mixers=mixers, mla=replace(base.mla, has_rope=False), yarn=None,
                   linear=read_kda(cfg, source), moe_layers=moe_layers)
