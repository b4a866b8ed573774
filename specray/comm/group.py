"""Groups of ranks and the collectives that run over them.

Every collective takes the group it runs on and returns at once for a group of one, so
single-rank code pays nothing. A group is an object handed to the layers that need it;
nothing here is module-level state.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Group:
    """A group of one rank: every collective is the identity."""

    ranks: tuple[int, ...] = (0,)
    rank_in_group: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj]

    def broadcast_object(self, obj: object, src_in_group: int = 0) -> object:
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


SINGLE = Group()


class TorchGroup(Group):
    """A torch.distributed process group (gloo on CPU, NCCL on CUDA) with a timeout.

    ``all_reduce`` may be swapped for a faster path (the one-shot all-reduce) by passing
    ``reducer``: any callable that sums a tensor over exactly these ranks.
    """

    def __init__(self, ranks: tuple[int, ...], my_rank: int, backend: str, timeout_s: float, pg=None):
        self.ranks = tuple(ranks)
        self.rank_in_group = self.ranks.index(my_rank)
        self.backend = backend
        self.timeout_s = timeout_s
        self.pg = pg if pg is not None else dist.new_group(list(self.ranks), backend=backend,
                                                           timeout=timedelta(seconds=timeout_s))
        self.reducer = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.reducer is not None:
            return self.reducer(x)
        dist.all_reduce(x, group=self.pg)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in self.ranks]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)

    def all_gather_object(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj: object, src_in_group: int = 0) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src_in_group], group=self.pg)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def close(self) -> None:
        self.reducer = None


def partition_groups(partition: list[tuple[int, ...]], my_rank: int, backend: str, timeout_s: float) -> Group:
    """This rank's group out of ``partition`` (disjoint rank tuples covering every rank).

    Collective: every rank must call it with the same partition, because torch.distributed
    creates each process group on every rank in the same order. Groups of one are not
    created at all (every rank skips the same ones), and return the identity ``Group``."""
    mine: Group | None = None
    for ranks in partition:
        if len(ranks) == 1:
            if my_rank in ranks:
                mine = SINGLE
            continue
        pg = dist.new_group(list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s))
        if my_rank in ranks:
            mine = TorchGroup(ranks, my_rank, backend, timeout_s, pg=pg)
    if mine is None:
        raise ValueError(f"rank {my_rank} is in no group of the partition {partition}")
    return mine
