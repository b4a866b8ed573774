"""Which all-reduce a group runs: the one-shot shared-memory path (one node), the hierarchical
path (comm/hierarchical.py: a group across nodes) or torch.distributed.

``ParallelConfig.allreduce``:

- ``"torch"``: torch.distributed (gloo on CPU, NCCL on CUDA) for everything.
- ``"auto"``: one-shot for messages of at most ``AUTO_THRESHOLD_BYTES`` on a group the one-shot
  path can serve; hierarchical for messages of at most ``HIERARCHICAL_THRESHOLD_BYTES`` on a
  group across nodes where it measured faster (``select_path``); torch.distributed for larger
  messages and wherever neither can serve, whatever the reason (``select_path``: ranks on several nodes, a group over ``MAX_GROUP_SIZE``, ...; or a
  segment that fails to set up).
- ``"one_shot"``: one-shot for every message that fits its buffer (``ONE_SHOT_SLOT_BYTES``),
  still torch.distributed for larger messages and for groups across nodes (shared memory does
  not reach another node); a group over the limit or a failed segment set-up is an error here
  that names ``auto`` or ``torch`` as the choice to make instead.

Under both modes, CUDA groups (no GPU path is built), non-x86-64 hosts (see one_shot.py on
memory ordering), CUDA tensors and dtypes other than float32 / bfloat16 / float16 go to
torch.distributed. The route of a call depends only on the message's size, dtype and device,
which agree on every rank, so all ranks of a group always take the same path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
import torch
import torch.distributed as dist

from specray.comm.group import TorchGroup
from specray.comm.hierarchical import HierarchicalAllReduce, node_layout
from specray.comm.one_shot import MAX_GROUP_SIZE, OneShotAllReduce, OneShotUnavailable, is_supported_platform
from specray.config import ALLREDUCE_MODES

log = logging.getLogger(__name__)

AUTO_THRESHOLD_BYTES = 1 << 20
"""Largest message ``auto`` sends one-shot. On the two-core CI machine (loaded by other jobs),
benchmarks/bench_allreduce.py measured back-to-back float32 all-reduces in three runs, one-shot
against gloo, world 2 / world 4: 6-68x / 21-32x faster at 4 KB, 6-37x / 19-28x at 64 KB,
1.6-7x / 3.2x at 1 MB, but only 1.4-1.8x / 1.0-1.2x at 16 MB (each rank adds every slot, so
its work grows with the group; gloo's does not), and call-by-call runs where 16 MB lost.
1 MB keeps the sizes that won in every run since the slot views are cached; it covers decode
and verify messages (tokens x hidden x 4 bytes: 256 tokens of a 1024-wide model) for 2 halves
x group size x 1 MB of /dev/shm per group, and leaves prefill-sized messages to gloo."""
ONE_SHOT_SLOT_BYTES = 4 << 20
"""Slot size when one_shot is forced: messages up to 4 MB, for 2 x group size x 4 MB of /dev/shm
per group (32 MB for a tp group of 4: well inside Docker's default 64 MB /dev/shm even with the
MoE groups; a /dev/shm too small fails set-up with an error naming the size)."""


HIERARCHICAL_MIN_RANKS = 4
"""Smallest group spanning nodes that ``auto`` gives the hierarchical all-reduce (see
benchmarks/bench_scale.py): below it, flat gloo."""
HIERARCHICAL_THRESHOLD_BYTES = 1 << 20
"""Largest message ``auto`` sends hierarchically across nodes (see benchmarks/bench_scale.py)."""


class SelectedAllReduce:
    """A TorchGroup reducer: the group's fast path (one-shot inside a node, hierarchical across
    nodes) for the messages it may take, torch.distributed otherwise."""

    def __init__(self, fast: OneShotAllReduce | HierarchicalAllReduce, limit_bytes: int, pg: dist.ProcessGroup):
        self.fast = fast
        self.path = "hierarchical" if isinstance(fast, HierarchicalAllReduce) else "one_shot"
        self.limit_bytes = min(limit_bytes, fast.slot_bytes)
        self.pg = pg

    @property
    def one_shot(self) -> OneShotAllReduce | HierarchicalAllReduce:
        return self.fast

    def route(self, x: torch.Tensor) -> str:
        """``self.path`` or 'torch': the path __call__ takes for x (the same on every rank)."""
        fits = self.fast.fits(x) and x.numel() * x.element_size() <= self.limit_bytes
        return self.path if fits else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.route(x) != "torch":
            return self.fast.reduce(x)
        dist.all_reduce(x, group=self.pg)
        return x

    def close(self) -> None:
        self.fast.close()


ADVICE = "choose allreduce='auto' (falls back to torch.distributed where one-shot cannot serve) or 'torch'"


def select_path(mode: str, *, group_size: int, node_ids: Sequence[int], backend: str, is_supported_machine: bool,
                max_group_size: int = MAX_GROUP_SIZE,
                hierarchical_min_ranks: int | None = None) -> tuple[str, str]:
    """(path, reason) for a group before any segment exists: 'one_shot', 'hierarchical' or 'torch'.

    torch under every mode: mode 'torch', a group of one, a non-gloo backend (no GPU path is
    built), a machine that is not x86-64 with /dev/shm. A group on several nodes: 'hierarchical'
    under 'auto' where it measured faster than flat torch.distributed (at least
    ``HIERARCHICAL_MIN_RANKS`` ranks, some node holding two of them, none more than
    ``max_group_size``), else torch; always torch under 'one_shot' (shared memory does not
    reach another node). A one-node group larger than ``max_group_size`` (the segment's flag
    header holds that many ranks): torch under 'auto', a ValueError under 'one_shot' that says
    what to choose instead. A segment that then fails to set up is the same choice (``make_reducer``)."""
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"allreduce {mode!r} must be one of {ALLREDUCE_MODES}")
    if len(node_ids) != group_size:
        raise ValueError(f"node_ids has {len(node_ids)} entries, but the group has {group_size} ranks: "
                         f"give the node of each rank in group order")
    if mode == "torch" or group_size == 1:
        return "torch", f"allreduce={mode!r}, group of {group_size}"
    if backend != "gloo":
        return "torch", f"backend {backend!r} (the one-shot path is CPU only)"
    if not is_supported_machine:
        return "torch", "this machine is not x86-64 with /dev/shm (see comm/one_shot.py on memory ordering)"
    if len(set(node_ids)) > 1:
        return _across_nodes(mode, group_size, node_ids, max_group_size,
                             HIERARCHICAL_MIN_RANKS if hierarchical_min_ranks is None else hierarchical_min_ranks)
    if group_size > max_group_size:
        reason = f"one-shot all-reduce takes groups of 2 to {max_group_size} ranks, this group has {group_size}"
        if mode == "one_shot":
            raise ValueError(f"allreduce='one_shot': {reason}; {ADVICE}")
        return "torch", reason
    return "one_shot", ""


def _across_nodes(mode: str, group_size: int, node_ids: Sequence[int], max_group_size: int,
                  min_ranks: int) -> tuple[str, str]:
    nodes = sorted(set(node_ids))
    largest = max(len(members) for members in node_layout(range(group_size), node_ids))
    if mode != "auto":
        return "torch", f"the group spans nodes {nodes} (allreduce={mode!r}: hierarchical only under 'auto')"
    if group_size < min_ranks:
        return "torch", (f"the group spans nodes {nodes} with {group_size} ranks; hierarchical all-reduce "
                         f"measured faster than torch.distributed from {min_ranks} ranks")
    if largest == 1:
        return "torch", f"the group spans nodes {nodes} with one rank on each: nothing to share in a node"
    if largest > max_group_size:
        return "torch", f"a node holds {largest} ranks of the group, more than the one-shot limit {max_group_size}"
    return "hierarchical", ""


def make_reducer(group: TorchGroup, node_ids: Sequence[int], mode: str, timeout_s: float, *,
                 threshold_bytes: int | None = None, slot_bytes: int | None = None,
                 max_group_size: int = MAX_GROUP_SIZE, hierarchical_min_ranks: int | None = None,
                 job_id: str = "") -> SelectedAllReduce | None:
    """The reducer for ``group.reducer``, or None where torch.distributed does everything.

    Collective over the group when it returns a reducer: every member calls it with the same
    ``node_ids`` (the node of each rank in ``group.ranks`` order) and mode, in the same order
    as its other collectives. ``threshold_bytes`` / ``slot_bytes`` / ``max_group_size``
    override the defaults (tests, benchmarks); ``job_id`` goes into the segment's name
    (``specray-<job>-ar-...``).
    """
    path, reason = select_path(mode, group_size=group.size, node_ids=node_ids, backend=group.backend,
                               is_supported_machine=is_supported_platform(), max_group_size=max_group_size,
                               hierarchical_min_ranks=hierarchical_min_ranks)
    if path == "torch":
        log.info("all-reduce over ranks %s uses torch.distributed: %s", group.ranks, reason)
        return None
    limit = AUTO_THRESHOLD_BYTES if threshold_bytes is None else threshold_bytes
    if path == "hierarchical" and threshold_bytes is None:
        limit = HIERARCHICAL_THRESHOLD_BYTES
    if slot_bytes is None:
        slot_bytes = limit if mode == "auto" else max(limit, ONE_SHOT_SLOT_BYTES)
    if mode == "one_shot":
        limit = slot_bytes
    try:
        if path == "hierarchical":
            fast = HierarchicalAllReduce(group, node_ids, slot_bytes, timeout_s, job_id=job_id)
        else:
            fast = OneShotAllReduce(group, slot_bytes, timeout_s, job_id=job_id)
    except OneShotUnavailable as e:
        if mode == "one_shot":
            raise OneShotUnavailable(f"allreduce='one_shot': {e}; {ADVICE}") from None
        log.warning("%s all-reduce over ranks %s unavailable, using torch.distributed: %s", path, group.ranks, e)
        return None
    return SelectedAllReduce(fast, limit, group.pg)
