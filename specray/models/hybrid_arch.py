"""The parts of the architecture record that only hybrid linear-attention models have
(``Qwen3NextForCausalLM``), read from their ``config.json`` once, with every rule checked there
so that a bad config fails on the driver before any rank starts.

- ``layer_types`` names each layer's token mixer: ``full_attention`` (gated attention over the
  paged K/V pool) or ``linear_attention`` (Gated DeltaNet over a state slot, ``kv/state.py``);
  the record keeps it as the per-layer ``mixers`` tuple, not a family flag.
- ``GatedDeltaArch``: the linear-attention heads, the conv kernel and the grouping of value heads
  per key head (``in_proj_qkvz`` and ``in_proj_ba`` are laid out per key head).
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


def read_layer_mixers(cfg: dict, source: str) -> tuple[str, ...]:
    """The per-layer mixer of ``layer_types`` (transformers' default when the key is absent: every
    ``full_attention_interval``-th layer full, as Qwen3NextConfig writes it)."""
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    bad = [t for t in types if t not in LAYER_MIXERS]
    if bad or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types {types} must name one of {sorted(LAYER_MIXERS)} for each of the "
                          f"{num_layers} layers")
    return tuple(LAYER_MIXERS[t] for t in types)


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
