"""The geometry agreement: rank 0 decides, every rank allocates exactly that, and then
every rank checks that every other rank allocated the same thing.

1. each rank reports its KV budget, its kernels' page sizes and the KV layout it needs;
2. rank 0 decides (pure function ``decide``) and broadcasts the geometry or the error, so a
   bad configuration fails on every rank with the same message instead of hanging;
3. each rank allocates from the broadcast geometry only;
4. rank 0 gathers a fingerprint of what every rank allocated (read from the tensors) and
   broadcasts its verdict: any difference stops start-up on every rank with an error naming
   the rank, the pool and the field.

Whatever the world size, that is four collectives, each a gather to rank 0 or a broadcast
from it (one hop; never a gloo all-gather, whose ring takes world-size hops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specray.comm.group import Group
from specray.config import KVConfig
from specray.kv.budget import split_budget
from specray.kv.geometry import KVLayout, PoolGeometry
from specray.kv.page_size import check_target_page_size, choose_draft_page_size, has_separate_draft_pool
from specray.kv.state import StateGeometry, StateLayout, StatePool, state_fingerprint


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    node: str
    budget_bytes: int
    target_layout: KVLayout
    target_kernels: dict[str, frozenset[int]]
    draft_layout: KVLayout | None = None
    draft_kernels: dict[str, frozenset[int]] = field(default_factory=dict)
    state_layout: StateLayout | None = None  # hybrid linear attention: the state one sequence needs


def decide(reports: list[RankReport], kv: KVConfig, method: str | None, dtype: str, *,
           num_state_slots: int = 0) -> dict[str, PoolGeometry | StateGeometry]:
    """The geometry every rank allocates, from every rank's report; a state layout gets
    ``num_state_slots`` rows (``kv.state.num_state_slots``), reserved before the pages."""
    first = reports[0]
    for r in reports[1:]:
        for name in ("target_layout", "draft_layout", "state_layout"):
            if getattr(r, name) != getattr(first, name):
                raise ValueError(f"rank {r.rank} needs {name} {getattr(r, name)}, rank 0 needs {getattr(first, name)}")
    target_page = check_target_page_size(kv.tokens_per_block, [r.target_kernels for r in reports])
    draft_page = choose_draft_page_size(method, target_page, [r.draft_kernels for r in reports])
    separate = has_separate_draft_pool(method)
    state = None
    if first.state_layout is not None:
        if num_state_slots < 1:
            raise ValueError(f"a model with linear-attention layers needs num_state_slots >= 1, not {num_state_slots}")
        state = StateGeometry(layout=first.state_layout, num_slots=num_state_slots)
    return split_budget(
        budget_bytes=min(r.budget_bytes for r in reports), capacity_tokens=kv.capacity_tokens,
        target=first.target_layout, target_page=target_page,
        draft=first.draft_layout if separate else None, draft_page=draft_page if separate else None, dtype=dtype,
        state=state,
    )


def fingerprint(pools: dict[str, list[torch.Tensor] | StatePool]) -> dict[str, dict]:
    """What was really allocated, read from the tensors themselves."""
    out = {}
    for name, layers in pools.items():
        if isinstance(layers, StatePool):
            out[name] = state_fingerprint(layers)
            continue
        blocks, rows, kv_heads, page, head_dim = layers[0].shape
        kind = "kv" if rows == 2 else "latent"
        out[name] = dict(kind=kind, tokens_per_block=page, num_blocks=blocks, num_layers=len(layers), num_kv_heads=kv_heads,
                         head_dim=head_dim, dtype=str(layers[0].dtype).removeprefix("torch."),
                         num_bytes=sum(t.numel() * t.element_size() for t in layers))
    return out


def check_fingerprints(fingerprints: list[dict[str, dict]]) -> None:
    """Raise naming the first rank, pool and field that differ from rank 0."""
    reference = fingerprints[0]
    for rank, fp in enumerate(fingerprints[1:], start=1):
        if fp.keys() != reference.keys():
            raise RuntimeError(f"KV geometry mismatch: rank {rank} allocated pools {sorted(fp)}, "
                               f"rank 0 allocated {sorted(reference)}")
        for pool, fields in fp.items():
            for key, value in fields.items():
                if value != reference[pool][key]:
                    raise RuntimeError(f"KV geometry mismatch: rank {rank} allocated {pool}.{key} = {value}, "
                                       f"rank 0 allocated {reference[pool][key]}")


def agree(group: Group, report: RankReport, kv: KVConfig, method: str | None, dtype: str, *,
          num_state_slots: int = 0) -> dict[str, PoolGeometry | StateGeometry]:
    """Steps 1-2 (collective over the control group): every rank returns rank 0's decision."""
    reports = group.gather_object(report)
    decision: dict | str = {}
    if reports is not None:
        try:
            decision = decide(reports, kv, method, dtype, num_state_slots=num_state_slots)
        except ValueError as e:
            decision = str(e)
    decision = group.broadcast_object(decision)
    if isinstance(decision, str):
        raise ValueError(decision)
    return decision


def verify(group: Group, pools: dict[str, list[torch.Tensor] | StatePool]) -> None:
    """Step 4 (collective): rank 0 checks every rank's allocation; every rank raises its verdict."""
    fingerprints = group.gather_object(fingerprint(pools))
    verdict = None
    if fingerprints is not None:
        try:
            check_fingerprints(fingerprints)
        except RuntimeError as e:
            verdict = str(e)
    verdict = group.broadcast_object(verdict)
    if verdict is not None:
        raise RuntimeError(verdict)
