"""How the CPU kernels' OpenMP threads wait at a barrier: spin while the cores are free, sleep
while other processes want them.

libgomp (torch's OpenMP runtime on Linux, shared by specray's kernels) ends every parallel
region at a barrier. A thread that gets there first spins (about 3 ms) before it sleeps on a
futex, unless the process holds more OpenMP threads than CPUs: then it sleeps after ~100 spins
(GCC manual, GOMP_SPINCOUNT). A decode step ends 120+ regions, and which wait serves it decides
its speed (SmolLM2-135M F32 on 2 cores, docs/cpu-kernels.md "Engine overhead per step"):

| cores                       | spin       | sleep   |
|-----------------------------|------------|---------|
| free                        | ~21 ms     | ~33 ms  |
| another process wants one   | ~700 ms    | ~33 ms  |

A spinning thread whose partner the scheduler parked burns its whole time slice at every
barrier; a sleeping one gives the core back. libgomp reads its wait policy once, when it loads,
but it counts its threads at every wait, and that count Python can move: a parked thread that
ran one parallel region owns a pool of OpenMP threads, which lifts the count above the CPUs
(sleep); letting it end frees the pool (spin). Only where the kernels' threads fill every CPU
the process may use does the count decide (elsewhere a spare core absorbs the competition).

``WaitChooser`` decides from how long the stepping thread waited on the run queue during its
steps (``/proc/thread-self/schedstat``), which is ~0 on free cores whatever the policy. It
observes windows of steps of at least ``WINDOW_S`` (one step where a step is longer): reading
that file cost ~25 us in the stepping thread, two reads a step 1.4% of a 3.6 ms decode step
(12-07, mid-llama Q4_K_M in fast mode); a window reads it twice.
- it starts asleep (a first step that spun on contended cores could take seconds);
- spinning, a step that waited >= 25% of its time (and >= 2 ms) was contended: sleep;
- sleeping, after ``hold_s`` it spins again if the run-queue wait stayed under 5% meanwhile;
- ``hold_s`` starts at 1 s and doubles (to 60 s) each time spinning lasted under 60 s before
  the next contended step, so a recurrent competitor costs one slow step a minute at most.
``SPECRAY_CPU_BARRIER_WAITS`` = ``spin`` or ``sleep`` fixes the policy (measurements);
``auto`` (the default) chooses. A process that already holds another OpenMP pool (a caller's
thread that ran torch ops) sleeps whatever is chosen.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CONTENDED_SHARE, CONTENDED_MIN_S = 0.25, 0.002  # a spinning step that waited this much: sleep
CALM_SHARE = 0.05  # sleeping, a hold whose run-queue wait stayed under this share: spin again
MIN_HOLD_S, MAX_HOLD_S, RESET_HOLD_AFTER_S = 1.0, 60.0, 60.0
WINDOW_S = 0.02  # steps observed together (the chooser's decisions take a second or more)
POLICIES = ("auto", "spin", "sleep")


@dataclass(slots=True)
class WaitChooser:
    """The spin/sleep decision (pure: the caller passes the clock and the step's waits)."""

    is_sleeping: bool = False
    since_s: float = 0.0  # when the current policy began (sleeping: the current hold)
    hold_s: float = MIN_HOLD_S
    window_wait_s: float = 0.0  # run-queue wait and wall time of the steps of the current hold
    window_wall_s: float = 0.0

    def observe(self, now_s: float, wall_s: float, wait_s: float) -> bool:
        """Record a step or a window of steps (their wall time and run-queue wait); True when the
        next sleeps."""
        if not self.is_sleeping:
            if wait_s >= CONTENDED_MIN_S and wait_s >= CONTENDED_SHARE * wall_s:
                spun_s = now_s - self.since_s
                self.hold_s = MIN_HOLD_S if spun_s >= RESET_HOLD_AFTER_S else min(2 * self.hold_s, MAX_HOLD_S)
                self._switch(now_s, True)
            return self.is_sleeping
        self.window_wait_s += wait_s
        self.window_wall_s += wall_s
        if now_s - self.since_s >= self.hold_s:
            is_calm = self.window_wait_s < CALM_SHARE * self.window_wall_s
            self._switch(now_s, not is_calm)
        return self.is_sleeping

    def _switch(self, now_s: float, is_sleeping: bool) -> None:
        self.is_sleeping, self.since_s = is_sleeping, now_s
        self.window_wait_s = self.window_wall_s = 0.0


def barrier_policy() -> str:
    policy = os.environ.get("SPECRAY_CPU_BARRIER_WAITS", "auto").strip() or "auto"
    if policy not in POLICIES:
        raise ValueError(f"SPECRAY_CPU_BARRIER_WAITS={policy!r} must be one of {', '.join(POLICIES)}")
    return policy


def threads_fill_the_cpus() -> bool:
    """Whether torch's (and the kernels') threads occupy every CPU this process may use."""
    threads = torch.get_num_threads()
    return threads >= 2 and threads >= len(os.sched_getaffinity(0))


class ParkedPool:
    """A thread that owns an OpenMP pool while it is parked, so libgomp counts more threads than
    CPUs and its barrier waits sleep. ``release`` lets it end; it also ends when ``owner`` does."""

    def __init__(self, owner: threading.Thread):
        self._release = threading.Event()
        self._ready = threading.Event()
        self._owner = owner
        self.thread = threading.Thread(target=self._park, name="specray-omp-parked-pool", daemon=True)
        self.thread.start()
        self._ready.wait(10.0)  # one small torch op; the policy holds either way

    def _park(self) -> None:
        torch.ones(1 << 20).sum()  # one parallel region over torch's threads: this thread's pool
        self._ready.set()
        while not self._release.wait(1.0):
            if not self._owner.is_alive():
                return

    def release(self) -> None:
        self._release.set()


class BarrierWaits:
    """Watches the steps of one stepping thread and holds a ``ParkedPool`` while it sleeps."""

    def __init__(self, policy: str):
        self.policy = policy
        # auto starts asleep: a first step that spun on contended cores could take seconds
        self.chooser = WaitChooser(is_sleeping=policy != "spin", since_s=time.perf_counter())
        self._pool: ParkedPool | None = None
        self._stat = None  # /proc/thread-self/schedstat of ``_stat_thread``
        self._stat_thread: threading.Thread | None = None
        self._step_start = 0.0
        self._window: tuple[float, int] | None = None  # the window's start and run-queue wait then
        self._window_wall_s = 0.0  # the wall time of its steps

    @classmethod
    def for_device(cls, device: torch.device) -> BarrierWaits | None:
        """Where the choice matters (CPU, Linux, threads on every CPU), else None."""
        policy = barrier_policy()
        if device.type != "cpu" or not os.path.exists("/proc/thread-self/schedstat") or not threads_fill_the_cpus():
            return None
        return cls(policy)

    @property
    def is_sleeping(self) -> bool:
        return self._pool is not None

    def _wait_ns(self) -> int:
        if self._stat_thread is not threading.current_thread():  # the file belongs to the thread that opened it
            if self._stat is not None:
                self._stat.close()
            self._stat = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115 (kept open)
            self._stat_thread = threading.current_thread()
        self._stat.seek(0)
        return int(self._stat.read().split()[1])  # time spent runnable but not running, ns

    def begin(self) -> None:
        """Call before a step, on the stepping thread."""
        self._apply()
        self._step_start = time.perf_counter()
        if self.policy == "auto" and self._window is None:
            self._window, self._window_wall_s = (self._step_start, self._wait_ns()), 0.0

    def end(self) -> None:
        """Call after the step, on the same thread."""
        if self._window is None:  # a fixed policy observes nothing
            return
        now = time.perf_counter()
        self._window_wall_s += now - self._step_start
        if now - self._window[0] < WINDOW_S:
            return
        wait_s = (self._wait_ns() - self._window[1]) / 1e9
        self._window = None
        was = self.chooser.is_sleeping
        self.chooser.observe(now, self._window_wall_s, wait_s)
        if self.chooser.is_sleeping != was:
            log.debug("CPU barrier waits now %s", "sleep" if self.chooser.is_sleeping else "spin")

    def _apply(self) -> None:
        if self.chooser.is_sleeping and self._pool is None:
            self._pool = ParkedPool(threading.current_thread())
        elif not self.chooser.is_sleeping and self._pool is not None:
            self._pool.release()
            self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.release()
            self._pool = None
        if self._stat is not None:
            self._stat.close()
            self._stat = None
