"""The control channel: rank 0 sends each step plan to every follower.

Two transports, chosen per reader by node:

- **Shared-memory ring** (followers on rank 0's host), in the manner of vLLM's MessageQueue:
  one writer, N readers, ``num_slots`` fixed-size slots. A message is pickled and written
  into one or more consecutive slots (chunks); each slot header carries the chunk's sequence
  number, written last, so a reader that sees the number sees the payload. Every reader
  publishes how many chunks it consumed; the writer reuses a slot only when every reader
  has passed it. Waiting is ``comm/spin.py``'s (``PLAN_WAIT``): every wait has a deadline and
  checks that the peer it waits on is alive. The segment comes from ``comm/shm.py``.
- **CPU group** (followers on other hosts): ``broadcast_object`` over ``ctx.control`` (gloo),
  which carries the group timeout.

Rules: messages are small (plans carry deltas); an empty message is a heartbeat that readers
skip (rank 0 sends one when idle so a waiting follower can tell "idle" from "dead"); the
ring assumes x86-64 or another platform where aligned 8-byte stores are atomic; the fence
(a lock round trip) orders the payload before the sequence number elsewhere too.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import threading
from collections.abc import Callable

import numpy as np

from specray.comm.group import Group
from specray.comm.shm import attach_segment, create_segment, share_segment
from specray.comm.spin import PLAN_WAIT, PeerGone, is_alive, spin_until

log = logging.getLogger(__name__)
SLOT_HEADER = 64  # bytes: [seq + 1, message length, chunk length], padded to a cache line
HEARTBEAT = None  # what ``recv`` returns for a heartbeat
_FENCE = threading.Lock()


def _fence() -> None:
    # A lock round trip issues a full memory barrier (as vLLM's MessageQueue does).
    _FENCE.acquire()
    _FENCE.release()


def _timed_out(what: str, timeout_s: float | None) -> Callable[[float], Exception]:
    return lambda waited: TimeoutError(f"{what}: nothing after {timeout_s:.1f} s (ParallelConfig.timeout_s)")


class ShmRing:
    """One writer, ``num_readers`` readers, over a shared-memory segment (see module doc)."""

    def __init__(self, buf: mmap.mmap, reader_index: int | None):
        self.buf = buf
        head = np.frombuffer(buf, dtype=np.int64, count=4)
        self.num_readers, self.num_slots, self.slot_bytes = int(head[1]), int(head[2]), int(head[3])
        r = self.num_readers
        self.header = np.frombuffer(buf, dtype=np.int64, count=4 + 2 * r)
        self.reader_pids = self.header[4:4 + r]
        self.consumed = self.header[4 + r:4 + 2 * r]
        self.slots_at = self._header_bytes(r)
        self.slot_headers = [np.frombuffer(buf, dtype=np.int64, count=3, offset=self._slot(i))
                             for i in range(self.num_slots)]
        self.reader_index = reader_index
        self.next_seq = 0  # the writer's next chunk, or this reader's next chunk

    @staticmethod
    def _header_bytes(num_readers: int) -> int:
        return -(-(8 * (4 + 2 * num_readers)) // 64) * 64

    def _slot(self, i: int) -> int:
        return self.slots_at + i * (SLOT_HEADER + self.slot_bytes)

    @classmethod
    def num_bytes(cls, num_readers: int, num_slots: int, slot_bytes: int) -> int:
        return cls._header_bytes(num_readers) + num_slots * (SLOT_HEADER + slot_bytes)

    @staticmethod
    def write_header(buf: mmap.mmap, num_readers: int, num_slots: int, slot_bytes: int) -> None:
        """The writer's part of a new segment, before any reader maps it."""
        np.frombuffer(buf, dtype=np.int64, count=4)[:] = (os.getpid(), num_readers, num_slots, slot_bytes)

    @classmethod
    def create(cls, name: str, num_readers: int, num_slots: int, slot_bytes: int) -> ShmRing:
        buf = create_segment(name, cls.num_bytes(num_readers, num_slots, slot_bytes))
        cls.write_header(buf, num_readers, num_slots, slot_bytes)
        return cls(buf, None)

    @classmethod
    def attach(cls, name: str, reader_index: int) -> ShmRing:
        return cls.reader(attach_segment(name), reader_index)

    @classmethod
    def reader(cls, buf: mmap.mmap, reader_index: int) -> ShmRing:
        ring = cls(buf, reader_index)
        ring.reader_pids[reader_index] = os.getpid()
        return ring

    @property
    def writer_pid(self) -> int:
        return int(self.header[0])

    def _readers_alive(self) -> None:
        for i, pid in enumerate(self.reader_pids.tolist()):
            if pid and not is_alive(pid):
                raise PeerGone(f"shared-memory plan reader {i} (pid {pid}) has exited")

    def _writer_alive(self) -> None:
        if not is_alive(self.writer_pid):
            raise PeerGone(f"the plan writer (rank 0, pid {self.writer_pid}) has exited")

    def send_bytes(self, data: bytes, timeout_s: float) -> None:
        view, total, offset = memoryview(data), len(data), 0
        while True:
            seq = self.next_seq
            spin_until(lambda: seq - int(self.consumed.min()) < self.num_slots, PLAN_WAIT, timeout_s,
                       self._readers_alive, _timed_out("waiting for followers to read a step plan", timeout_s))
            chunk = view[offset:offset + self.slot_bytes]
            start = self._slot(seq % self.num_slots) + SLOT_HEADER
            self.buf[start:start + len(chunk)] = chunk
            header = self.slot_headers[seq % self.num_slots]
            header[1], header[2] = total, len(chunk)
            _fence()
            header[0] = seq + 1  # publishes the chunk
            self.next_seq, offset = seq + 1, offset + len(chunk)
            if offset >= total:
                return

    def recv_bytes(self, timeout_s: float | None) -> bytes:
        parts: list[bytes] = []
        received, total = 0, None
        while total is None or received < total:
            seq = self.next_seq
            header = self.slot_headers[seq % self.num_slots]
            spin_until(lambda: int(header[0]) == seq + 1, PLAN_WAIT, timeout_s, self._writer_alive,
                       _timed_out("waiting for rank 0's next step plan", timeout_s))
            _fence()
            total, size = int(header[1]), int(header[2])
            start = self._slot(seq % self.num_slots) + SLOT_HEADER
            parts.append(self.buf[start:start + size])
            received += size
            self.next_seq = seq + 1
            self.consumed[self.reader_index] = seq + 1  # frees the slot for the writer
        return b"".join(parts)

    def close(self) -> None:
        self.header = self.reader_pids = self.consumed = None
        self.slot_headers = []
        try:
            self.buf.close()
        except BufferError:  # a numpy view is still alive somewhere; the mapping goes at exit
            pass


class PlanSender:
    """Rank 0's end: each message reaches the local followers by ring, the others by gloo."""

    def __init__(self, ring: ShmRing | None, control: Group, timeout_s: float):
        self.ring, self.control, self.timeout_s = ring, control, timeout_s
        self.transport = "+".join(t for t, on in (("shm", ring is not None), ("cpu-group", control.size > 1)) if on)

    def send(self, message: object) -> None:
        if self.ring is not None:
            data = b"" if message is HEARTBEAT else pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            self.ring.send_bytes(data, self.timeout_s)
        if self.control.size > 1:
            self.control.broadcast_object(message)

    def heartbeat(self) -> None:
        self.send(HEARTBEAT)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


class PlanReceiver:
    """A follower's end: the ring when on rank 0's host, the CPU group otherwise."""

    def __init__(self, ring: ShmRing | None, control: Group):
        self.ring, self.control = ring, control
        self.transport = "shm" if ring is not None else "cpu-group"

    def recv(self, timeout_s: float | None) -> object:
        """The next message, or ``HEARTBEAT``; over gloo the group timeout applies instead."""
        if self.ring is None:
            return self.control.broadcast_object(None)
        data = self.ring.recv_bytes(timeout_s)
        return pickle.loads(data) if data else HEARTBEAT

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


def open_channel(ctx, num_slots: int = 8, slot_bytes: int = 64 << 10) -> PlanSender | PlanReceiver | None:
    """Collective over ``ctx.cpu``: rank 0 creates the ring for its host's followers, they
    map it, and rank 0 unlinks the name at once (see comm/shm.py). None on a single rank."""
    if ctx.world_size == 1:
        return None
    local = [r for r in ctx.local_ranks_of(ctx.node_of_rank[0]) if r != 0]
    ring = None
    if local:  # every rank knows `local`, so all take part in share_segment or none does
        geometry = (len(local), num_slots, slot_bytes)
        _, buf = share_segment(ctx.cpu, ShmRing.num_bytes(*geometry), ctx.job_id, "plans", needs_map=ctx.rank in local,
                            init=lambda b: ShmRing.write_header(b, *geometry))
        if ctx.rank == 0:
            ring = ShmRing(buf, None)
        elif buf is not None:
            ring = ShmRing.reader(buf, local.index(ctx.rank))
    end = PlanSender(ring, ctx.control, ctx.timeout_s) if ctx.rank == 0 else PlanReceiver(ring, ctx.control)
    log.info("step plans reach %s by shared memory and %s by the CPU group", local or "no rank",
             [r for r in range(1, ctx.world_size) if r not in local] or "no rank")
    return end
