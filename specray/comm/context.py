"""DistContext: everything a rank knows about where it runs, passed explicitly.

Built once per rank from the launcher's rendezvous information; layers receive the group
they need from it (``ctx.tp``, ``ctx.moe_tp``, ``ctx.moe_ep``), never from a global.

Group layout over the tp ranks (world size == tp_size; moe_tp * moe_ep == tp):

| group   | ranks of this rank r                               | backend        |
|---------|----------------------------------------------------|----------------|
| tp      | all ranks                                          | nccl or gloo   |
| moe_tp  | the moe_tp ranks of expert group r // moe_tp       | nccl or gloo   |
| moe_ep  | the moe_ep ranks with the same r % moe_tp          | nccl or gloo   |
| cpu     | all ranks (geometry agreement, token checks)       | gloo (tp on CPU) |
| control | rank 0 and every rank off rank 0's node (plans)    | gloo           |

Every group carries ``ParallelConfig.timeout_s``: a collective that waits longer on a dead or
stuck rank raises instead of hanging. torch.distributed keeps its default group inside the
process, so one process holds at most one DistContext (one rank per process, as every
launcher arranges); ``close`` tears the groups down again.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from specray.comm.allreduce import make_reducer
from specray.comm.group import SINGLE, Group, TorchGroup, partition_groups
from specray.comm.rendezvous import Rendezvous, join_store, new_job_id
from specray.config import ParallelConfig
from specray.startup_phases import PhaseClock, timed


def expert_partitions(tp_size: int, moe_tp: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(moe_tp groups, moe_ep groups): tp rank r has moe_ep index r // moe_tp and moe_tp index
    r % moe_tp, so expert group e lives on the contiguous ranks [e * moe_tp, (e + 1) * moe_tp)."""
    moe_ep = tp_size // moe_tp
    tp_groups = [tuple(range(e * moe_tp, (e + 1) * moe_tp)) for e in range(moe_ep)]
    ep_groups = [tuple(range(t, tp_size, moe_tp)) for t in range(moe_tp)]
    return tp_groups, ep_groups


def node_ids(node_keys: list[str]) -> tuple[int, ...]:
    """Number the hosts in order of their lowest rank, so rank 0's node is node 0."""
    order: dict[str, int] = {}
    for key in node_keys:
        order.setdefault(key, len(order))
    return tuple(order[k] for k in node_keys)


@dataclass(slots=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_id: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    timeout_s: float = 60.0
    tp: Group = SINGLE
    moe_tp: Group = SINGLE
    moe_ep: Group = SINGLE
    cpu: Group = SINGLE
    """Control messages (geometry agreement, token checks): always gloo."""
    control: Group = SINGLE
    """Rank 0 and the ranks on other nodes: step plans that shared memory cannot carry."""
    node_of_rank: tuple[int, ...] = (0,)
    num_ranks_on_host: int = 1
    """Ranks of this job on this rank's host (same hostname), which share its RAM; not
    ``local_world_size``: torchrun may run several "nodes" on one host."""
    job_id: str = ""
    """Random per job: names of shared-memory segments derive from it."""
    owns_process_group: bool = False

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: str = "cpu") -> DistContext:
        dev = torch.device(device)
        return cls(device=dev, backend="nccl" if dev.type == "cuda" else "gloo", job_id=new_job_id())

    @classmethod
    def create(cls, rdzv: Rendezvous, parallel: ParallelConfig, device: str,
               store: dist.Store | None = None, clock: PhaseClock | None = None) -> DistContext:
        """Join the job's process groups (collective over every rank of the job).

        What a rank does here grows at most linearly with the world size: gloo connects a
        pair of ranks only when they first talk (``TORCH_GLOO_LAZY_INIT``, set by the
        launchers that own the rank process), node discovery is one gather to rank 0 and one
        broadcast (never an all-gather, which gloo runs as a ring of world-size hops), and a
        rank sets up shared memory only for the groups it belongs to."""
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group: one rank per process")
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rdzv.local_rank if rdzv.device_index is None else rdzv.device_index)
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout_s = parallel.timeout_s
        with timed(clock, "process_groups"):
            if store is None and rdzv.store_port is not None:
                store = join_store(rdzv.store_host, rdzv.store_port, timeout_s)
            init = dict(store=store) if store is not None else dict(init_method="env://")
            dist.init_process_group(backend, rank=rdzv.rank, world_size=rdzv.world_size,
                                    timeout=timedelta(seconds=timeout_s), **init)
            ranks = tuple(range(rdzv.world_size))
            ctx = cls(rank=rdzv.rank, world_size=rdzv.world_size, local_rank=rdzv.local_rank,
                      local_world_size=rdzv.local_world_size, device=dev, backend=backend, timeout_s=timeout_s,
                      owns_process_group=True)
            ctx.tp = TorchGroup(ranks, rdzv.rank, backend, timeout_s, pg=dist.group.WORLD)
            # On CPU the world group is gloo already: a second full-world gloo group would only
            # double the connections.
            ctx.cpu = ctx.tp if backend == "gloo" else TorchGroup(ranks, rdzv.rank, "gloo", timeout_s)
            ctx._make_expert_groups(parallel.resolved_moe_sizes[0])
        with timed(clock, "node_discovery"):
            places = ctx.cpu.gather_object((rdzv.node_key, socket.gethostname()))
            places, ctx.job_id = ctx.cpu.broadcast_object((places, rdzv.job_id or new_job_id()))
            ctx.node_of_rank = node_ids([key for key, _ in places])
            ctx.num_ranks_on_host = sum(host == places[rdzv.rank][1] for _, host in places)
            ctx.node_id = ctx.node_of_rank[rdzv.rank]
        with timed(clock, "allreduce_setup"):
            ctx._attach_reducers(parallel.allreduce)  # one-shot all-reduce where selection allows it
        with timed(clock, "process_groups"):
            remote = tuple(r for r in ranks if ctx.node_of_rank[r] != ctx.node_of_rank[0])
            ctx.control = partition_groups([(0, *remote)] + [(r,) for r in ranks if r and r not in remote],
                                           rdzv.rank, "gloo", timeout_s)
        return ctx

    def _make_expert_groups(self, moe_tp: int) -> None:
        tp_parts, ep_parts = expert_partitions(self.world_size, moe_tp)
        everyone = [tuple(range(self.world_size))]
        self.moe_tp = self.tp if tp_parts == everyone else partition_groups(
            tp_parts, self.rank, self.backend, self.timeout_s)
        self.moe_ep = self.tp if ep_parts == everyone else partition_groups(
            ep_parts, self.rank, self.backend, self.timeout_s)

    def _attach_reducers(self, mode: str) -> None:
        """Set ``reducer`` on each of ctx's tensor groups (tp, moe_tp, moe_ep; each group once).

        Collective: every rank calls it once its groups and ``node_of_rank`` exist. Every rank
        visits the groups in the same order and each make_reducer talks only inside its group,
        so the disjoint moe_tp (or moe_ep) groups set up side by side without waiting on each
        other. Closing a group drops its reducer, which unmaps the segment."""
        seen: set[int] = set()
        for group in (self.tp, self.moe_tp, self.moe_ep):
            if isinstance(group, TorchGroup) and id(group) not in seen:
                seen.add(id(group))
                group.reducer = make_reducer(group, [self.node_of_rank[r] for r in group.ranks], mode, self.timeout_s,
                                             job_id=self.job_id)

    def local_ranks_of(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of_rank) if n == node)

    def close(self) -> None:
        for group in {id(g): g for g in (self.tp, self.moe_tp, self.moe_ep, self.cpu, self.control)}.values():
            group.close()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False
