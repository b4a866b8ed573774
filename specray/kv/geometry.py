"""Pool geometry: everything that fixes a pool's shape and size on every rank.

The budget and the allocation are computed by the same functions from the same geometry,
so what the budget charges is exactly what is allocated.

A pool's ``kind`` says what a page holds per layer:

- ``kv``: K and V for each kv head on this rank, ``[2, kv_heads, tokens_per_block, head_dim]``;
- ``latent`` (MLA): one row per token, ``[1, 1, tokens_per_block, kv_lora_rank + qk_rope_head_dim]``:
  ``num_kv_heads`` is 1 and ``head_dim`` the row's width, the same on every TP rank (the latent is
  not split by heads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
POOL_KINDS = {"kv": 2, "latent": 1}  # kind -> rows per token and head (K and V, or the latent row)


def _check_kind(kind: str, num_kv_heads: int) -> None:
    if kind not in POOL_KINDS:
        raise ValueError(f"pool kind {kind!r} is not one of {sorted(POOL_KINDS)}")
    if kind == "latent" and num_kv_heads != 1:
        raise ValueError(f"a latent pool holds one row per token (num_kv_heads 1), not {num_kv_heads}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV shape a model (or a drafter's layers) needs per token on one rank."""

    num_layers: int
    num_kv_heads: int  # on one rank
    head_dim: int
    kind: str = "kv"

    def __post_init__(self) -> None:
        _check_kind(self.kind, self.num_kv_heads)


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    tokens_per_block: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int  # on one rank
    head_dim: int
    dtype: str
    kind: str = "kv"

    def __post_init__(self) -> None:
        _check_kind(self.kind, self.num_kv_heads)

    @property
    def block_bytes(self) -> int:
        """Bytes one page takes over all layers: K and V of the kv heads on this rank, or one latent row."""
        return block_bytes(self.tokens_per_block, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                           self.kind)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def as_dict(self) -> dict:
        return dict(asdict(self), num_bytes=self.num_bytes)

    def describe(self, name: str) -> str:
        if self.kind == "latent":
            return (f"{name} pool: latent, page {self.tokens_per_block} tokens, {self.num_blocks} blocks, "
                    f"{self.num_layers} layers, row {self.head_dim}, {self.dtype}, {self.num_bytes / 2**20:.1f} MiB")
        return (f"{name} pool: page {self.tokens_per_block} tokens, {self.num_blocks} blocks, "
                f"{self.num_layers} layers, {self.num_kv_heads} kv heads/rank, head_dim {self.head_dim}, "
                f"{self.dtype}, {self.num_bytes / 2**20:.1f} MiB")


def block_bytes(tokens_per_block: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                kind: str = "kv") -> int:
    return POOL_KINDS[kind] * num_layers * num_kv_heads * tokens_per_block * head_dim * DTYPE_SIZES[dtype]


def allocate_pool(geometry: PoolGeometry, device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer: [num_blocks, 2 (kv) or 1 (latent), kv_heads, tokens_per_block, head_dim], zeroed."""
    g = geometry
    storage = torch.zeros(g.num_layers, g.num_blocks, POOL_KINDS[g.kind], g.num_kv_heads, g.tokens_per_block, g.head_dim,
                          dtype=getattr(torch, g.dtype), device=device)
    return list(storage.unbind(0))
