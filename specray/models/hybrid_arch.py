"""The parts of the architecture record that only hybrid linear-attention models have
(``Qwen3NextForCausalLM``, ``KimiLinearForCausalLM``), read from their ``config.json`` once, with
every rule checked there so that a bad config fails on the driver before any rank starts.

- ``layer_types`` names each layer's token mixer: ``full_attention`` (Qwen3-Next: gated attention
  over the paged K/V pool; Kimi Linear: MLA without RoPE over the latent pool) or
  ``linear_attention`` (Gated DeltaNet, or Kimi Linear's KDA, over a state slot, ``kv/state.py``);
  the record keeps it as the per-layer ``mixers`` tuple, not a family flag.
- ``GatedDeltaArch``: the linear-attention heads, the conv kernel and the grouping of value heads
  per key head (``in_proj_qkvz`` and ``in_proj_ba`` are laid out per key head). KDA's layers have
  the same shape with one value head per key head (``read_kda``).
- Gated attention: ``q_proj`` yields ``(q, gate)`` interleaved per head, RoPE rotates the first
  ``partial_rotary_factor * head_dim`` dims, and every RMSNorm but the gated one is zero-centred
  (``x * (1 + w)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.errors import ConfigError, require_keys

LINEAR_KEYS = {
    "layer_types": "each layer's token mixer, full_attention or linear_attention",
    "linear_conv_kernel_dim": "the depthwise causal conv1d's kernel size",
    "linear_key_head_dim": "the per-head query/key width of the linear-attention layers",
    "linear_value_head_dim": "the per-head value width of the linear-attention layers",
    "linear_num_key_heads": "the query/key heads of the linear-attention layers",
    "linear_num_value_heads": "the value heads of the linear-attention layers",
}
LAYER_MIXERS = {"full_attention": "gated_attention", "linear_attention": "linear_attention"}
KIMI_LAYER_MIXERS = {"full_attention": "mla", "linear_attention": "kda"}


@dataclass(frozen=True, slots=True)
class GatedDeltaArch:
    conv_kernel_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv1d's channels: q, k (key_dim each) and v (value_dim), in that order."""
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.num_v_heads // self.num_k_heads


def read_layer_mixers(cfg: dict, source: str, mixers: dict[str, str] = LAYER_MIXERS,
                      default_types: list[str] | None = None) -> tuple[str, ...]:
    """The per-layer mixer of ``layer_types`` (transformers' default when the key is absent: every
    ``full_attention_interval``-th layer full, as Qwen3NextConfig writes it, or ``default_types``)."""
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or default_types
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    bad = [t for t in types if t not in mixers]
    if bad or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types {types} must name one of {sorted(mixers)} for each of the "
                          f"{num_layers} layers")
    return tuple(mixers[t] for t in types)


def read_gated_delta(cfg: dict, source: str) -> GatedDeltaArch:
    require_keys(cfg, LINEAR_KEYS, source)
    arch = GatedDeltaArch(conv_kernel_size=int(cfg["linear_conv_kernel_dim"]),
                          num_k_heads=int(cfg["linear_num_key_heads"]), num_v_heads=int(cfg["linear_num_value_heads"]),
                          k_head_dim=int(cfg["linear_key_head_dim"]), v_head_dim=int(cfg["linear_value_head_dim"]))
    for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"):
        if getattr(arch, name) < 1:
            raise ConfigError(f"{source}: linear {name} ({getattr(arch, name)}) must be >= 1")
    if arch.conv_kernel_size < 2:
        raise ConfigError(f"{source}: linear_conv_kernel_dim ({arch.conv_kernel_size}) must be >= 2")
    if arch.num_v_heads % arch.num_k_heads:
        raise ConfigError(f"{source}: linear_num_value_heads ({arch.num_v_heads}) must be a multiple of "
                          f"linear_num_key_heads ({arch.num_k_heads}): each key head serves a group of value heads")
    return arch


QWEN3_NEXT_PARTIAL_ROTARY_FACTOR = 0.25  # what Qwen3NextConfig assumes when a config leaves it out


def read_rotary_dim(cfg: dict, rope: dict, head_dim: int, source: str) -> int:
    """The dims RoPE rotates: ``int(head_dim * partial_rotary_factor)``, as transformers computes it;
    the factor from ``rope_parameters``, else the top level (Qwen3-Next-80B's own config.json keeps
    it there, beside ``rope_scaling: null``), else Qwen3NextConfig's default."""
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                             QWEN3_NEXT_PARTIAL_ROTARY_FACTOR)))
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor ({factor}) x head_dim ({head_dim}) = {dim} must be a "
                          f"positive even number of dims at most head_dim: RoPE rotates pairs")
    return dim


# Kimi Linear's config.json spells the router keys as its own modeling code did; transformers'
# KimiLinearConfig maps them (attribute_map) to the DeepSeek names the MLA reading expects
KIMI_KEY_ALIASES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
                    "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
                    "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}
KIMI_LINEAR_DEFAULTS = dict(head_dim=128, num_heads=32, short_conv_kernel_size=4)  # KimiLinearConfig's
MLP_LAYER_TYPES = ("dense", "sparse")


def kimi_config(cfg: dict) -> dict:
    """The config with Kimi's key spellings added under DeepSeek's names (where those are absent)."""
    return dict(cfg, **{deep: cfg[kimi] for kimi, deep in KIMI_KEY_ALIASES.items() if kimi in cfg and deep not in cfg})


def kimi_layer_types(cfg: dict, source: str) -> list[str]:
    """Kimi Linear's per-layer types as KimiLinearConfig resolves them: ``layer_types``, else
    ``linear_attn_config``'s 1-indexed ``kda_layers`` and ``full_attn_layers``, else every 4th
    layer after the first full (its default; for 4 layers that is all KDA)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    lin, num_layers = cfg.get("linear_attn_config") or {}, cfg["num_hidden_layers"]
    if "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in lin[key]:
                if not 1 <= layer <= num_layers:
                    raise ConfigError(f"{source}: linear_attn_config {key} names layer {layer}; layers are "
                                      f"numbered 1 to {num_layers}")
                types[layer - 1] = kind
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]


def read_kda(cfg: dict, source: str) -> GatedDeltaArch:
    """KDA's shape: ``linear_num_heads`` heads of ``linear_head_dim`` for q, k and v alike (one value
    head per key head), a short conv of ``linear_conv_kernel_dim``; ``linear_attn_config`` (the
    checkpoint's own spelling) wins where present, as in KimiLinearConfig."""
    lin = cfg.get("linear_attn_config") or {}
    dim = int(lin.get("head_dim", cfg.get("linear_head_dim", KIMI_LINEAR_DEFAULTS["head_dim"])))
    heads = int(lin.get("num_heads", cfg.get("linear_num_heads", KIMI_LINEAR_DEFAULTS["num_heads"])))
    kernel = int(lin.get("short_conv_kernel_size",
                         cfg.get("linear_conv_kernel_dim", KIMI_LINEAR_DEFAULTS["short_conv_kernel_size"])))
    if heads < 1 or dim < 1:
        raise ConfigError(f"{source}: KDA num_heads ({heads}) and head_dim ({dim}) must be >= 1")
    if kernel < 2:
        raise ConfigError(f"{source}: KDA short_conv_kernel_size ({kernel}) must be >= 2")
    return GatedDeltaArch(conv_kernel_size=kernel, num_k_heads=heads, num_v_heads=heads, k_head_dim=dim,
                          v_head_dim=dim)


def read_mlp_layer_types(cfg: dict, source: str) -> tuple[int, ...]:
    """The MoE layers: ``mlp_layer_types`` (dense / sparse per layer), else the first
    ``first_k_dense_replace`` layers dense (KimiLinearConfig's default 1) and the rest sparse."""
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types")
    if types is None:
        dense = int(cfg.get("first_k_dense_replace", 1))
        types = ["dense" if i < dense else "sparse" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: mlp_layer_types {types} must name one of {list(MLP_LAYER_TYPES)} for each of "
                          f"the {num_layers} layers")
    return tuple(i for i, t in enumerate(types) if t == "sparse")
