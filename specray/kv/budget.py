"""How much memory a rank can give to KV pools, and the pool geometry that fills it."""

from __future__ import annotations

import torch

from specray.config import KVConfig
from specray.kv.geometry import PoolGeometry, block_bytes


def available_memory_bytes(device: torch.device) -> int:
    """Memory free right now: free device memory on GPUs, MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_budget_bytes(kv: KVConfig, device: torch.device) -> int:
    """The KV memory this rank offers: a fraction of what is free (capped on CPU)."""
    budget = int(available_memory_bytes(device) * kv.memory_fraction)
    return min(budget, kv.cpu_max_bytes) if device.type == "cpu" else budget


def pool_geometry(*, tokens_per_block: int, capacity_tokens: int | None, budget_bytes: int, num_layers: int,
                  num_kv_heads: int, head_dim: int, dtype: str) -> PoolGeometry:
    """One pool sized by an explicit token capacity, or by the bytes it may take."""
    per_block = block_bytes(tokens_per_block, num_layers, num_kv_heads, head_dim, dtype)
    if capacity_tokens is not None:
        num_blocks = -(-capacity_tokens // tokens_per_block)
    else:
        num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV budget ({budget_bytes} bytes) is smaller than one page ({per_block} bytes); "
                         f"raise kv.memory_fraction or kv.cpu_max_bytes, or set kv.capacity_tokens")
    return PoolGeometry(tokens_per_block=tokens_per_block, num_blocks=num_blocks, num_layers=num_layers,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
