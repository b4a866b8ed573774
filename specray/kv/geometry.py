"""Pool geometry: everything that fixes a pool's shape and size on every rank.

The budget and the allocation are computed by the same functions from the same geometry,
so what the budget charges is exactly what is allocated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV shape a model (or a drafter's layers) needs per token on one rank."""

    num_layers: int
    num_kv_heads: int  # on one rank
    head_dim: int


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    tokens_per_block: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int  # on one rank
    head_dim: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        """Bytes one page takes over all layers: K and V, kv heads on this rank."""
        return block_bytes(self.tokens_per_block, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def as_dict(self) -> dict:
        return dict(asdict(self), num_bytes=self.num_bytes)

    def describe(self, name: str) -> str:
        return (f"{name} pool: page {self.tokens_per_block} tokens, {self.num_blocks} blocks, "
                f"{self.num_layers} layers, {self.num_kv_heads} kv heads/rank, head_dim {self.head_dim}, "
                f"{self.dtype}, {self.num_bytes / 2**20:.1f} MiB")


def block_bytes(tokens_per_block: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    return 2 * num_layers * num_kv_heads * tokens_per_block * head_dim * DTYPE_SIZES[dtype]


def allocate_pool(geometry: PoolGeometry, device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer: [num_blocks, 2, kv_heads, tokens_per_block, head_dim], zeroed."""
    g = geometry
    storage = torch.zeros(g.num_layers, g.num_blocks, 2, g.num_kv_heads, g.tokens_per_block, g.head_dim,
                          dtype=getattr(torch, g.dtype), device=device)
    return list(storage.unbind(0))
