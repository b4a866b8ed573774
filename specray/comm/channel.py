"""The control channel: rank 0 sends each step plan to every follower.

Two transports, chosen per reader by node:

- **Shared-memory ring** (followers on rank 0's host), in the manner of vLLM's MessageQueue:
  one writer, N readers, ``num_slots`` fixed-size slots. A message is pickled and written
  into one or more consecutive slots (chunks); each slot header carries the chunk's sequence
  number, written last, so a reader that sees the number sees the payload. Every reader
  publishes how many chunks it consumed; the writer reuses a slot only when every reader
  has passed it. Waiting spins briefly, then yields, then sleeps with a growing pause; every
  wait has a deadline and checks that the peer it waits on is alive.
- **CPU group** (followers on other hosts): ``broadcast_object`` over ``ctx.control`` (gloo),
  which carries the group timeout.

Rules: messages are small (plans carry deltas); an empty message is a heartbeat that readers
skip (rank 0 sends one when idle so a waiting follower can tell "idle" from "dead"); the
ring assumes x86-64 or another platform where aligned 8-byte stores are atomic; the fence
(a lock round trip) orders the payload before the sequence number elsewhere too.
"""

from __future__ import annotations

import mmap
import os
import pickle
import threading
import time

import logging

import numpy as np

from specray.comm.group import Group
from specray.comm.shm import attach_segment, create_segment, segment_name, unlink_segment

log = logging.getLogger(__name__)
SLOT_HEADER = 64  # bytes: [seq + 1, message length, chunk length], padded to a cache line
HEARTBEAT = None  # what ``recv`` returns for a heartbeat
_FENCE = threading.Lock()


def _fence() -> None:
    # A lock round trip issues a full memory barrier (as vLLM's MessageQueue does).
    _FENCE.acquire()
    _FENCE.release()


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PeerGone(RuntimeError):
    """The process on the other side of a wait has exited."""


def wait_until(ready, timeout_s: float | None, peers_alive, what: str) -> None:
    """Spin ~50 us, yield up to 1 ms, then sleep (20 us doubling to 2 ms; to 20 ms once the
    wait passes 100 ms, i.e. rank 0 is idle, not planning) until ``ready()``."""
    if ready():
        return
    start = time.monotonic()
    next_check, pause, spins = start + 0.2, 20e-6, 0
    while not ready():
        spins += 1
        if spins < 50:
            continue
        now = time.monotonic()
        if now - start < 1e-3:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 2e-3 if now - start < 0.1 else 20e-3)
        if now >= next_check:
            peers_alive()
            next_check = now + 0.2
            if timeout_s is not None and now - start > timeout_s:
                raise TimeoutError(f"{what}: nothing after {timeout_s:.1f} s (ParallelConfig.timeout_s)")


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
    def create(cls, name: str, num_readers: int, num_slots: int, slot_bytes: int) -> ShmRing:
        size = cls._header_bytes(num_readers) + num_slots * (SLOT_HEADER + slot_bytes)
        buf = create_segment(name, size)
        np.frombuffer(buf, dtype=np.int64, count=4)[:] = (os.getpid(), num_readers, num_slots, slot_bytes)
        return cls(buf, None)

    @classmethod
    def attach(cls, name: str, reader_index: int) -> ShmRing:
        ring = cls(attach_segment(name), reader_index)
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
            wait_until(lambda: seq - int(self.consumed.min()) < self.num_slots, timeout_s,
                       self._readers_alive, "waiting for followers to read a step plan")
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
            wait_until(lambda: int(header[0]) == seq + 1, timeout_s, self._writer_alive,
                       "waiting for rank 0's next step plan")
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
    name, ring = None, None
    if ctx.rank == 0 and local:
        name = segment_name(ctx.job_id, "plans")
        ring = ShmRing.create(name, len(local), num_slots, slot_bytes)
    name = ctx.cpu.broadcast_object(name)
    try:
        if ctx.rank in local:
            ring = ShmRing.attach(name, local.index(ctx.rank))
        ctx.cpu.barrier()
    finally:
        if ctx.rank == 0 and name is not None:
            unlink_segment(name)
    end = PlanSender(ring, ctx.control, ctx.timeout_s) if ctx.rank == 0 else PlanReceiver(ring, ctx.control)
    log.info("step plans reach %s by shared memory and %s by the CPU group", local or "no rank",
             [r for r in range(1, ctx.world_size) if r not in local] or "no rank")
    return end
