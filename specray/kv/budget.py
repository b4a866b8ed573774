"""How much memory a rank can give to KV pools, and the pool geometry that fills it.

The split charges each pool at the page size it is allocated with: both pools hold the
same number of tokens, a multiple of both page sizes, so every page is whole and the bytes
charged are exactly ``PoolGeometry.num_bytes``, the bytes ``allocate_pool`` allocates.
State slots (hybrid linear attention, ``kv/state.py``) are reserved before the split.
"""

from __future__ import annotations

import torch

from specray.config import KVConfig
from specray.kv.geometry import KVLayout, PoolGeometry
from specray.kv.state import StateGeometry, reserve_state_bytes


def available_memory_bytes(device: torch.device) -> int:
    """Memory free right now: free device memory on GPUs, MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_budget_bytes(*, available_bytes: int, memory_fraction: float, num_ranks_sharing: int,
                    cap_bytes: int | None) -> int:
    """The KV memory one rank offers: ``memory_fraction`` of the memory free to it, split evenly
    between the ranks that draw on that same memory, then capped at ``cap_bytes`` (None: no cap).

    CPU ranks on one host share its RAM, so each takes 1/num_ranks_sharing of the fraction and
    together they stay within it; a GPU rank owns its device (num_ranks_sharing = 1, no cap)."""
    if num_ranks_sharing < 1:
        raise ValueError(f"num_ranks_sharing ({num_ranks_sharing}) must be >= 1")
    budget = int(available_bytes * memory_fraction) // num_ranks_sharing
    return budget if cap_bytes is None else min(budget, cap_bytes)


def rank_kv_budget_bytes(memory_fraction: float, kv: KVConfig, device: torch.device, num_ranks_on_host: int) -> int:
    """``kv_budget_bytes`` for this rank, from the memory free now on its device or host."""
    is_cpu = device.type == "cpu"
    return kv_budget_bytes(available_bytes=available_memory_bytes(device), memory_fraction=memory_fraction,
                           num_ranks_sharing=num_ranks_on_host if is_cpu else 1,
                           cap_bytes=kv.cpu_max_bytes if is_cpu else None)


def _geometry(layout: KVLayout, page: int, capacity: int, dtype: str) -> PoolGeometry:
    return PoolGeometry(tokens_per_block=page, num_blocks=capacity // page, num_layers=layout.num_layers,
                        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=dtype, kind=layout.kind)


def split_budget(*, budget_bytes: int, capacity_tokens: int | None, target: KVLayout, target_page: int,
                 draft: KVLayout | None, draft_page: int | None, dtype: str,
                 state: StateGeometry | None = None) -> dict[str, PoolGeometry | StateGeometry]:
    """Target (and draft) pool geometry holding the same token capacity within the budget.

    The state slots, if any, are reserved first (always, also with an explicit capacity: a budget
    too small for them is an error); capacity = the explicit token capacity rounded up, or the
    most tokens whose pages in both pools fit in what is left; always a multiple of both page sizes."""
    page_budget = reserve_state_bytes(budget_bytes, state)
    pools = {"target": (target, target_page)}
    if draft is not None:
        pools["draft"] = (draft, draft_page)
    unit = max(page for _, page in pools.values())  # both are powers of two: the larger is the lcm
    if capacity_tokens is not None:
        capacity = -(-capacity_tokens // unit) * unit
    else:
        bytes_per_unit = sum(_geometry(layout, page, unit, dtype).num_bytes for layout, page in pools.values())
        capacity = page_budget // bytes_per_unit * unit
        if capacity == 0:
            after = "" if state is None else f" left after {state.num_bytes} bytes of state slots"
            raise ValueError(f"the KV budget ({page_budget} bytes{after}) cannot hold {unit} tokens in every pool "
                             f"({bytes_per_unit} bytes); raise kv.memory_fraction or kv.cpu_max_bytes, "
                             f"or set kv.capacity_tokens")
    geometry: dict[str, PoolGeometry | StateGeometry] = {
        name: _geometry(layout, page, capacity, dtype) for name, (layout, page) in pools.items()}
    if state is not None:
        geometry["state"] = state
    return geometry
