"""Hierarchical all-reduce for a group that spans nodes (CPU tensors).

For call x on every rank of the group:

1. inside each node, the one-shot segment of that node's members sums their inputs onto the
   node's leader (its lowest rank in the group), in group order: p_k = ((x_a + x_b) + x_c) ...;
2. the leaders (one per node) send each other their partial sums over the group's own
   torch.distributed process group (point to point: every leader gets every partial in one
   hop), and each leader adds them in node order: ((p_0 + p_1) + p_2) + ...;
3. inside each node, the leader's result is copied to the other members through the segment.

Nodes are ordered by their lowest rank in the group. Every leader runs the same additions on
the same bytes, and step 3 copies bytes, so every rank of the group holds bitwise the same
result, equal to that nested sum computed anywhere in the input's dtype (tests compute it).

No new torch.distributed group is created: torch makes every rank of the job take part in
creating any group (or agree on how many each holds), while these node subsets are set up by
their own members (``SubGroup``). A node with a single member of the group needs no segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from specray.comm.group import SubGroup, TorchGroup
from specray.comm.one_shot import SUPPORTED_DTYPES, OneShotAllReduce

LEADER_TAG = 8
"""Tag of the leaders' messages, apart from the parent group's collectives and SubGroup's set-up."""


def node_layout(ranks: Sequence[int], node_ids: Sequence[int]) -> list[tuple[int, ...]]:
    """The group's ranks per node, nodes ordered by their lowest rank, ranks in group order."""
    nodes: dict[int, list[int]] = {}
    for rank, node in zip(ranks, node_ids):
        nodes.setdefault(node, []).append(rank)
    return [tuple(members) for members in nodes.values()]


def reference_sum(inputs: Sequence[torch.Tensor], layout: list[tuple[int, ...]],
                  ranks: Sequence[int]) -> torch.Tensor:
    """What every rank must hold: the nested sum of the module doc, in the inputs' dtype."""
    def ordered(parts):
        total = parts[0].clone()
        for part in parts[1:]:
            total = total + part
        return total

    position = {r: i for i, r in enumerate(ranks)}
    return ordered([ordered([inputs[position[r]] for r in members]) for members in layout])


class HierarchicalAllReduce:
    """Sums CPU tensors of up to ``slot_bytes`` over ``group`` (collective set-up, like
    OneShotAllReduce). ``node_ids``: the node of each rank in ``group.ranks`` order."""

    def __init__(self, group: TorchGroup, node_ids: Sequence[int], slot_bytes: int, timeout_s: float,
                 job_id: str = ""):
        layout = node_layout(group.ranks, node_ids)
        if len(layout) < 2:
            raise ValueError(f"a hierarchical all-reduce needs a group on 2 or more nodes, got nodes {list(node_ids)}")
        me = group.ranks[group.rank_in_group]
        self.group = group
        self.layout = layout
        self.leaders = tuple(members[0] for members in layout)
        self.my_node = next(i for i, members in enumerate(layout) if me in members)
        self.is_leader = me == self.leaders[self.my_node]
        self.timeout_s = timeout_s
        members = layout[self.my_node]
        self.node = None
        if len(members) > 1:
            self.node = OneShotAllReduce(SubGroup(group, members, me), slot_bytes, timeout_s, job_id=job_id)
        self.slot_bytes = self.node.slot_bytes if self.node is not None else slot_bytes
        self.path = self.node.path if self.node is not None else None  # the node segment (unlinked already)
        self.num_calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in SUPPORTED_DTYPES
                and x.numel() * x.element_size() <= self.slot_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group (in place, like dist.all_reduce) and return it."""
        if not self.fits(x):
            raise ValueError(f"hierarchical all-reduce takes CPU tensors of at most {self.slot_bytes} bytes, "
                             f"got {x.dtype} on {x.device} with {x.numel() * x.element_size()} bytes")
        return self.reduce(x)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """__call__ for an x the caller already checked with fits()."""
        self.num_calls += 1
        if not x.is_contiguous():
            x.copy_(self.reduce(x.contiguous()))
            self.num_calls -= 1
            return x
        with torch.no_grad():
            if self.node is not None:
                self.node.reduce_to_first(x)
            if self.is_leader:
                self._across_nodes(x)
            if self.node is not None:
                self.node.broadcast_from_first(x)
        return x

    def _across_nodes(self, x: torch.Tensor) -> None:
        """Step 2: exchange the partials among the leaders, then add them in node order."""
        pg = self.group.pg
        others = [leader for leader in self.leaders if leader != self.leaders[self.my_node]]
        partials = {leader: torch.empty_like(x) for leader in others}
        works = [dist.isend(x, dst=leader, group=pg, tag=LEADER_TAG) for leader in others]
        works += [dist.irecv(partials[leader], src=leader, group=pg, tag=LEADER_TAG) for leader in others]
        wait = timedelta(seconds=self.timeout_s)
        for work in works:
            work.wait(wait)
        partials[self.leaders[self.my_node]] = x.clone()
        ordered = [partials[leader] for leader in self.leaders]
        torch.add(ordered[0], ordered[1], out=x)
        for part in ordered[2:]:
            x.add_(part)

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
