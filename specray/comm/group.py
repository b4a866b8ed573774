"""Groups of ranks and the collectives that run over them.

Every collective takes the group it runs on and returns at once for a group of one, so
single-rank code pays nothing. A group is an object handed to the layers that need it;
nothing here is module-level state.
"""

from __future__ import annotations

import pickle
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

    def gather_object(self, obj: object) -> list[object] | None:
        """Every member's ``obj`` in group order on the group's first rank, None elsewhere."""
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

    def gather_object(self, obj: object) -> list[object] | None:
        """Point-to-point sends to the first rank, which receives from all members at once.

        Not ``dist.gather_object``: it sizes the messages with an all-gather, which gloo runs
        as a ring of group-size hops, each waiting for one more process to be scheduled.
        Here every member talks to the first rank only (one hop; with gloo's lazy
        connections, one connection per member)."""
        if self.size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        root = self.ranks[0]
        if self.rank_in_group != 0:
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=root, group=self.pg)
            dist.send(payload, dst=root, group=self.pg)
            return None
        sizes = {r: torch.zeros(1, dtype=torch.int64) for r in self.ranks[1:]}
        wait = timedelta(seconds=self.timeout_s)
        for work in [dist.irecv(t, src=r, group=self.pg) for r, t in sizes.items()]:
            work.wait(wait)
        parts = {r: torch.empty(int(t.item()), dtype=torch.uint8) for r, t in sizes.items()}
        for work in [dist.irecv(t, src=r, group=self.pg) for r, t in parts.items()]:
            work.wait(wait)
        return [obj] + [pickle.loads(parts[r].numpy().tobytes()) for r in self.ranks[1:]]

    def broadcast_object(self, obj: object, src_in_group: int = 0) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src_in_group], group=self.pg)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def close(self) -> None:
        """Drop the reducer and this object's hold on the process group. Once
        ``destroy_process_group`` has run too, the last reference goes and the group's worker
        threads are joined now, on this thread, rather than during interpreter shutdown: there
        a gloo worker still finishing a collective would need the GIL, and a thread taking the
        GIL while Python finalizes is killed, which aborts the process (torch 2.13)."""
        self.reducer = None
        self.pg = None


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


class SubGroup(Group):
    """Some ranks of a TorchGroup that talk point-to-point over its process group, without a
    process group of their own: torch.distributed would make every rank of the job create
    it (or agree on how many groups each holds), while a subset such as "the ranks of this
    group on my node" is set up by its members alone. Object collectives only (set-up of
    shared segments); a tag of its own keeps its messages apart from the parent's."""

    TAG = 7

    def __init__(self, parent: TorchGroup, ranks: tuple[int, ...], my_rank: int):
        if not set(ranks) <= set(parent.ranks):
            raise ValueError(f"ranks {ranks} must be a subset of the parent group's {parent.ranks}")
        self.parent = parent
        self.ranks = tuple(ranks)
        self.rank_in_group = self.ranks.index(my_rank)

    def _wait(self, works) -> None:
        wait = timedelta(seconds=self.parent.timeout_s)
        for work in works:
            work.wait(wait)

    def _send(self, obj: object, dst: int) -> list:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        pg = self.parent.pg
        return [dist.isend(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst, group=pg, tag=self.TAG),
                dist.isend(payload, dst=dst, group=pg, tag=self.TAG)]

    def _recv(self, sources: tuple[int, ...]) -> list[object]:
        pg = self.parent.pg
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in sources]
        self._wait([dist.irecv(t, src=r, group=pg, tag=self.TAG) for r, t in zip(sources, sizes)])
        parts = [torch.empty(int(t.item()), dtype=torch.uint8) for t in sizes]
        self._wait([dist.irecv(t, src=r, group=pg, tag=self.TAG) for r, t in zip(sources, parts)])
        return [pickle.loads(p.numpy().tobytes()) for p in parts]

    def gather_object(self, obj: object) -> list[object] | None:
        if self.size == 1:
            return [obj]
        if self.rank_in_group != 0:
            self._wait(self._send(obj, self.ranks[0]))
            return None
        return [obj] + self._recv(self.ranks[1:])

    def broadcast_object(self, obj: object, src_in_group: int = 0) -> object:
        if self.size == 1:
            return obj
        src = self.ranks[src_in_group]
        if self.rank_in_group != src_in_group:
            return self._recv((src,))[0]
        self._wait([w for r in self.ranks if r != src for w in self._send(obj, r)])
        return obj
