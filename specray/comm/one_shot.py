"""One-shot all-reduce through a shared-memory segment, for the ranks of one node (CPU tensors).

Algorithm, for call number n = 1, 2, ... (every rank of the group makes the same calls in the
same order, as with any collective):

1. copy the input into this rank's slot of buffer half ``n % 2`` (a strided input is copied
   as it is: this copy is the "make it contiguous" step);
2. publish ``flag[rank] = n``;
3. wait until every flag is >= n: yield the core while polling, then sleep; after
   ``timeout_s`` raise ``TimeoutError`` naming the ranks whose flag is behind;
4. sum the slots in rank order into the input tensor, ``((s0 + s1) + s2) + ...`` in the input's
   dtype. Every rank runs the same additions on the same bytes, so every rank holds bitwise the
   same result, equal to a rank-order sum computed anywhere else in that dtype.

Why two halves: a rank that finished call n may start call n + 1 while a slower rank is still
summing the slots of call n; call n + 1 writes the other half. It cannot reach call n + 2 (the
first half again) before every rank published n + 1, which each does only after it finished
summing call n.

Memory ordering: the flag store follows the slot copy in program order, and x86-64's total
store order makes the slot visible to the other cores before the flag (loads are not reordered
with loads either). Other architectures need fences that Python cannot issue, so
``is_supported_platform()`` is false there and selection falls back to torch.distributed.

Lifetime and safety: the segment is set up by ``comm/shm.share_segment`` (private to the user,
pages reserved, unlinked as soon as every rank mapped it, so nothing is left behind after a
close, an exception or a killed rank). Each group has its own segment and call counter, so the
tp group and the MoE groups never touch each other's flags or slots.

Waiting (step 3) uses ``comm/spin.py`` with ``ALLREDUCE_WAIT``. Each rank's flag line also holds
its pid, so a waiting rank names a peer that exited within ``CHECK_EVERY_S`` instead of only
after ``timeout_s``.

CUDA tensors are not handled here (no GPU path is built); selection sends them to torch.
"""

from __future__ import annotations

import os
import platform

import torch

from specray.comm.group import TorchGroup
from specray.comm.shm import SHM_DIR, SegmentUnavailable, share_segment
from specray.comm.spin import ALLREDUCE_WAIT, PeerGone, is_alive, spin_until

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLAG_STRIDE_BYTES = 64
"""One cache line per rank's flag (and its pid), so ranks publishing at once do not fight over a line."""
MAX_GROUP_SIZE = 64
HEADER_BYTES = FLAG_STRIDE_BYTES * MAX_GROUP_SIZE
PAGE_BYTES = 4096
MAX_CACHED_SHAPES = 256


def is_supported_platform() -> bool:
    """The flag protocol relies on x86-64 total store order and a Linux /dev/shm."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class OneShotUnavailable(SegmentUnavailable):
    """The segment could not be set up on every rank; the same error is raised on all of them."""


class OneShotAllReduce:
    """Sums CPU tensors of up to ``slot_bytes`` over ``group`` through one shared segment.

    Construction is collective over the group (every member must construct it, in the same
    order as its other collectives). ``close`` unmaps; it is safe to call more than once.
    """

    def __init__(self, group: TorchGroup, slot_bytes: int, timeout_s: float, job_id: str = ""):
        if not 2 <= group.size <= MAX_GROUP_SIZE:
            raise ValueError(f"one-shot all-reduce needs a group of 2 to {MAX_GROUP_SIZE} ranks, got {group.size}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes ({slot_bytes}) must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        self.ranks = group.ranks
        self.me = group.rank_in_group
        self.timeout_s = timeout_s
        self.slot_bytes = -(-slot_bytes // PAGE_BYTES) * PAGE_BYTES
        self.num_calls = 0
        self._map = None
        self._failure: str | None = None
        size = HEADER_BYTES + 2 * group.size * self.slot_bytes
        try:
            name, self._map = share_segment(group, size, job_id, "ar", needs_map=True)
        except SegmentUnavailable as e:
            raise OneShotUnavailable(str(e)) from None
        self.path = os.path.join(SHM_DIR, name)  # unlinked already; names the segment in messages and tests
        self._flags = memoryview(self._map).cast("B")[:HEADER_BYTES].cast("q")
        self._flag_index = [r * FLAG_STRIDE_BYTES // 8 for r in range(group.size)]
        self._everyone = tuple(range(group.size))
        self._flags[self._flag_index[self.me] + 1] = os.getpid()  # the word after a flag: its rank's pid
        self._halves = {dtype: [self._half_view(half, dtype) for half in (0, 1)] for dtype in SUPPORTED_DTYPES}
        self._slot_views: dict[tuple[torch.dtype, torch.Size], tuple[list[torch.Tensor], ...]] = {}

    def _half_view(self, half: int, dtype: torch.dtype) -> torch.Tensor:
        """[group size, slot elements] over one buffer half, so a slot is a row."""
        item = torch.empty((), dtype=dtype).element_size()
        count = len(self.ranks) * self.slot_bytes // item
        offset = HEADER_BYTES + half * len(self.ranks) * self.slot_bytes
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).view(len(self.ranks), -1)

    def _slots(self, dtype: torch.dtype, shape: torch.Size) -> tuple[list[torch.Tensor], ...]:
        """For each half, every rank's slot viewed as `shape`. Cached: a torch view costs ~2.5 us,
        about what a whole decode-sized sum costs, and a decoder uses a handful of shapes."""
        key = (dtype, shape)
        views = self._slot_views.get(key)
        if views is None:
            if len(self._slot_views) >= MAX_CACHED_SHAPES:
                self._slot_views.clear()
            numel = shape.numel()
            views = tuple([row[:numel].view(shape) for row in half] for half in self._halves[dtype])
            self._slot_views[key] = views
        return views

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this path can take x: a CPU tensor of a supported dtype that fits a slot."""
        return (x.device.type == "cpu" and x.dtype in SUPPORTED_DTYPES
                and x.numel() * x.element_size() <= self.slot_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in rank order, in place (like dist.all_reduce), and return it."""
        if not self.fits(x):
            raise ValueError(f"one-shot all-reduce takes CPU {[str(d) for d in SUPPORTED_DTYPES]} tensors of "
                             f"at most {self.slot_bytes} bytes, got {x.dtype} on {x.device} "
                             f"with {x.numel() * x.element_size()} bytes")
        return self.reduce(x)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """__call__ for an x the caller already checked with fits() (saves ~1 us a call)."""
        self._check_usable()
        if x.requires_grad and torch.is_grad_enabled():
            with torch.no_grad():  # like dist.all_reduce: no autograd graph through the shared slots
                return self.reduce(x)  # (not entered by default: the context costs as much as the copy)
        self.num_calls += 1
        n = self.num_calls
        slots = self._slots(x.dtype, x.shape)[n % 2]
        slots[self.me].copy_(x)
        self._flags[self._flag_index[self.me]] = n
        self._wait_for(n, self._everyone)
        self._sum_into(x, slots)
        return x

    @staticmethod
    def _sum_into(x: torch.Tensor, slots: list[torch.Tensor]) -> None:
        torch.add(slots[0], slots[1], out=x)
        for slot in slots[2:]:
            x.add_(slot)

    # reduce_to_first and broadcast_from_first run as a pair (the node steps of comm/hierarchical.py):
    # the first rank's wait in each is what keeps a slower rank's half from being reused under it.
    def reduce_to_first(self, x: torch.Tensor) -> torch.Tensor:
        """The rank-order sum onto the group's first rank (in x, in place); the other ranks
        only publish their input and return x unchanged. Next call: ``broadcast_from_first``."""
        self._check_usable()
        self.num_calls += 1
        n = self.num_calls
        slots = self._slots(x.dtype, x.shape)[n % 2]
        slots[self.me].copy_(x)
        self._flags[self._flag_index[self.me]] = n
        if self.me == 0:
            self._wait_for(n, self._everyone)
            self._sum_into(x, slots)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """The group's first rank's x into x on every rank (bytes copied, not summed)."""
        self._check_usable()
        self.num_calls += 1
        n = self.num_calls
        slot = self._slots(x.dtype, x.shape)[n % 2][0]
        if self.me == 0:
            self._wait_for(n - 1, self._everyone)  # nobody still reads this half from call n - 2
            slot.copy_(x)
            self._flags[self._flag_index[0]] = n
            return x
        self._wait_for(n, (0,))
        x.copy_(slot)
        self._flags[self._flag_index[self.me]] = n
        return x

    def _check_usable(self) -> None:
        if self._map is None:
            raise RuntimeError(f"one-shot all-reduce over ranks {self.ranks} is closed")
        if self._failure is not None:
            raise RuntimeError(f"one-shot all-reduce over ranks {self.ranks} failed earlier: {self._failure}")

    def _arrived(self, n: int, positions: tuple[int, ...]) -> bool:
        flags, index = self._flags, self._flag_index
        return all(flags[index[p]] >= n for p in positions)

    def _wait_for(self, n: int, positions: tuple[int, ...]) -> None:
        """Until the ranks at these group positions published call n (or raise)."""
        spin_until(lambda: self._arrived(n, positions), ALLREDUCE_WAIT, self.timeout_s,
                   lambda: self._check_peers(n, positions),
                   lambda waited: self._fail(n, f" within timeout_s={self.timeout_s} (dead, stuck, or calling "
                                                f"collectives in another order)", TimeoutError, positions))

    def _missing(self, n: int, positions: tuple[int, ...]) -> list[int]:
        """Group positions (of ``positions``) of the ranks that have not published call n."""
        return [p for p in positions if self._flags[self._flag_index[p]] < n]

    def _check_peers(self, n: int, positions: tuple[int, ...]) -> None:
        gone = [(self.ranks[p], pid) for p in self._missing(n, positions)
                if (pid := self._flags[self._flag_index[p] + 1]) and not is_alive(pid)]
        if gone:
            raise self._fail(n, ": " + "; ".join(f"rank {rank} (pid {pid}) has exited" for rank, pid in gone),
                             PeerGone, positions)

    def _fail(self, n: int, why: str, kind: type[Exception], positions: tuple[int, ...]) -> Exception:
        missing = [self.ranks[p] for p in self._missing(n, positions)]
        self._failure = f"ranks {missing} did not arrive at one-shot all-reduce call {n} over ranks {self.ranks}{why}"
        return kind(self._failure)

    def close(self) -> None:
        if self._map is None:
            return
        self._halves.clear()
        self._slot_views.clear()
        self._flags.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view of a slot; the mapping goes when that view does
        self._map = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
