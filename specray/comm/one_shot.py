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

Lifetime and safety: rank 0 of the group creates ``/dev/shm/specray-[<job id>-]ar-<pid>-<token>``
with O_CREAT | O_EXCL and mode 0600 (the job's user only; a fresh random name per job and group,
never a fixed one), reserves its pages (``posix_fallocate``: a full /dev/shm fails here, not as
a SIGBUS later), every rank opens and maps it, the ranks agree that all of them mapped it, and
the creator unlinks the name at once. From then on the segment has no name: the kernel frees it
when the last rank unmaps it or exits, so nothing is left behind after a close, an exception or
a killed rank. The one window is start-up itself: a creator killed between create and unlink
(one gloo round trip) leaves its file. Each group has its own segment and call counter, so the
tp group and the MoE groups never touch each other's flags or slots.

CUDA tensors are not handled here (no GPU path is built); selection sends them to torch.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import stat
import time

import torch

from specray.comm.group import TorchGroup

SHM_DIR = "/dev/shm"
NAME_PREFIX = "specray-ar-"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLAG_STRIDE_BYTES = 64
"""One cache line per rank's flag, so ranks publishing at once do not fight over a line."""
MAX_GROUP_SIZE = 64
HEADER_BYTES = FLAG_STRIDE_BYTES * MAX_GROUP_SIZE
PAGE_BYTES = 4096
YIELD_SECONDS = 1e-3
"""A waiting rank first yields its core (sched_yield) for this long, then sleeps, doubling from
MIN to MAX. sched_yield returns at once on an idle core, so this polls as fast as a spin does
(world 2, 4 KB: ~13 us either way), but on a loaded machine it hands the core to the rank being
waited for, where a spin of even 200 checks made the median call 20x slower (60-380 us)."""
MIN_SLEEP_SECONDS, MAX_SLEEP_SECONDS = 1e-5, 2e-4
"""Capped low: the ranks of a step do the same work, so a long wait is rare and is not idle time."""
MAX_CACHED_SHAPES = 256


def is_supported_platform() -> bool:
    """The flag protocol relies on x86-64 total store order and a Linux /dev/shm."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class OneShotUnavailable(RuntimeError):
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
        self.path, self._map = "", None
        self._failure: str | None = None
        size = HEADER_BYTES + 2 * group.size * self.slot_bytes
        prefix = f"specray-{job_id}-ar-" if job_id else NAME_PREFIX
        self.path, self._map = _map_shared_segment(group, size, prefix)
        self._flags = memoryview(self._map).cast("B")[:HEADER_BYTES].cast("q")
        self._flag_index = [r * FLAG_STRIDE_BYTES // 8 for r in range(group.size)]
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
        if self._map is None:
            raise RuntimeError(f"one-shot all-reduce over ranks {self.ranks} is closed")
        if self._failure is not None:
            raise RuntimeError(f"one-shot all-reduce over ranks {self.ranks} failed earlier: {self._failure}")
        if x.requires_grad and torch.is_grad_enabled():
            with torch.no_grad():  # like dist.all_reduce: no autograd graph through the shared slots
                return self.reduce(x)  # (not entered by default: the context costs as much as the copy)
        self.num_calls += 1
        n = self.num_calls
        slots = self._slots(x.dtype, x.shape)[n % 2]
        slots[self.me].copy_(x)
        self._flags[self._flag_index[self.me]] = n
        self._wait_for_all(n)
        torch.add(slots[0], slots[1], out=x)
        for slot in slots[2:]:
            x.add_(slot)
        return x

    def _arrived(self, n: int) -> bool:
        flags = self._flags
        return all(flags[i] >= n for i in self._flag_index)

    def _wait_for_all(self, n: int) -> None:
        if self._arrived(n):
            return
        start = time.monotonic()
        sleep_s = MIN_SLEEP_SECONDS
        while not self._arrived(n):
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                self._fail(n)
            if waited < YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, MAX_SLEEP_SECONDS)

    def _fail(self, n: int) -> None:
        missing = [self.ranks[r] for r, i in enumerate(self._flag_index) if self._flags[i] < n]
        self._failure = (f"ranks {missing} did not arrive at one-shot all-reduce call {n} over ranks {self.ranks} "
                         f"within timeout_s={self.timeout_s} (dead, stuck, or calling collectives in another order)")
        raise TimeoutError(self._failure)

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


def _map_shared_segment(group: TorchGroup, size: int, prefix: str) -> tuple[str, mmap.mmap]:
    """Create (group rank 0), open and map one segment on every rank, then unlink its name.

    Every rank reports success or its error through the group, so all ranks return together
    or all raise OneShotUnavailable together; the creator unlinks in every case.
    """
    path, error = "", None
    if group.rank_in_group == 0:
        path = os.path.join(SHM_DIR, f"{prefix}{os.getpid()}-{secrets.token_hex(12)}")
        try:
            _create(path, size)
        except OSError as e:
            error = f"cannot create {path} ({size} bytes): {e}"
    path, error = group.broadcast_object((path, error))
    segment = None
    try:
        if error is None:
            try:
                segment = _open_and_map(path, size)
            except OSError as e:
                error = f"rank {group.ranks[group.rank_in_group]} cannot map {path}: {e}"
        errors = [e for e in group.all_gather_object(error) if e is not None]
    finally:
        if group.rank_in_group == 0 and path:
            _unlink_quietly(path)
    if errors:
        if segment is not None:
            segment.close()
        raise OneShotUnavailable("; ".join(dict.fromkeys(errors)))
    return path, segment


def _create(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        _unlink_quietly(path)
        raise
    os.close(fd)


def _open_and_map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid() or mode != 0o600 or st.st_size != size:
            raise PermissionError(f"segment has uid {st.st_uid}, mode {mode:o}, {st.st_size} bytes; "
                                  f"expected uid {os.getuid()}, mode 600, {size} bytes")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
