"""The spin/sleep choice for OpenMP barrier waits (workers/barrier_waits.py).

The decision is a pure function of the clock and each step's run-queue wait, checked with
literals; the parked pool is checked by the thread it owns, which must end when released
and when its owner thread ends."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specray.workers.barrier_waits import (MAX_HOLD_S, MIN_HOLD_S, WINDOW_S, BarrierWaits, ParkedPool, WaitChooser,
                                           barrier_policy)


def test_a_contended_spinning_step_switches_to_sleep():
    c = WaitChooser(is_sleeping=False, since_s=0.0)
    assert not c.observe(1.0, wall_s=0.020, wait_s=0.0001)  # the driver thread's wake-up: still spin
    assert not c.observe(1.1, wall_s=0.020, wait_s=0.0019)  # under 2 ms: noise on a short step
    assert not c.observe(1.2, wall_s=0.800, wait_s=0.100)  # 12.5% of a long step: not contended
    assert c.observe(1.3, wall_s=0.700, wait_s=0.350)  # half the step on the run queue: sleep
    assert c.hold_s == 2 * MIN_HOLD_S  # it spun for 1.3 s only: the next hold doubles


def test_sleep_holds_then_spins_again_only_after_a_calm_hold():
    c = WaitChooser(is_sleeping=True, since_s=10.0, hold_s=1.0)
    assert c.observe(10.5, wall_s=0.03, wait_s=0.0)  # the hold has not passed
    assert c.observe(11.0, wall_s=0.03, wait_s=0.012)  # window: 12 ms wait of 60 ms (20%): contended
    assert c.since_s == 11.0 and c.window_wall_s == 0.0  # a new hold began
    assert c.observe(11.5, wall_s=0.03, wait_s=0.0005)
    assert not c.observe(12.0, wall_s=0.03, wait_s=0.0005)  # 1 ms of 60 ms (1.7%): calm, spin again
    assert c.since_s == 12.0


def test_the_hold_doubles_to_its_cap_and_resets_after_a_long_spin():
    c = WaitChooser(is_sleeping=False, since_s=0.0, hold_s=MAX_HOLD_S / 2)
    c.observe(5.0, wall_s=1.0, wait_s=0.5)
    assert c.hold_s == MAX_HOLD_S
    c = WaitChooser(is_sleeping=False, since_s=0.0, hold_s=MAX_HOLD_S)
    c.observe(5.0, wall_s=1.0, wait_s=0.5)
    assert c.hold_s == MAX_HOLD_S  # capped
    c = WaitChooser(is_sleeping=False, since_s=0.0, hold_s=MAX_HOLD_S)
    c.observe(61.0, wall_s=1.0, wait_s=0.5)  # it spun a minute before this contended step
    assert c.hold_s == MIN_HOLD_S


def test_the_policy_variable_names_its_values(monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_BARRIER_WAITS", "sleep")
    assert barrier_policy() == "sleep"
    monkeypatch.setenv("SPECRAY_CPU_BARRIER_WAITS", "fast")
    with pytest.raises(ValueError, match=r"SPECRAY_CPU_BARRIER_WAITS='fast' must be one of auto, spin, sleep"):
        barrier_policy()


def parked_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specray-omp-parked-pool"]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_parked_pool_ends_when_released_and_when_its_owner_ends():
    assert not parked_threads()
    pool = ParkedPool(threading.current_thread())
    assert pool.thread.is_alive()
    pool.release()
    assert wait_until(lambda: not pool.thread.is_alive())

    pools = []
    owner = threading.Thread(target=lambda: pools.append(ParkedPool(threading.current_thread())))
    owner.start()
    owner.join(10.0)
    assert pools and wait_until(lambda: not pools[0].thread.is_alive())  # its owner ended without releasing


def test_barrier_waits_hold_a_pool_while_sleeping(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # threads on every CPU, whatever this host has
    monkeypatch.setenv("SPECRAY_CPU_BARRIER_WAITS", "sleep")
    waits = BarrierWaits.for_device(torch.device("cpu"))
    assert waits is not None and waits.policy == "sleep"
    waits.begin()
    waits.end()
    assert waits.is_sleeping and len(parked_threads()) == 1
    waits.close()
    assert not waits.is_sleeping and wait_until(lambda: not parked_threads())
    monkeypatch.setenv("SPECRAY_CPU_BARRIER_WAITS", "spin")
    spinning = BarrierWaits.for_device(torch.device("cpu"))
    spinning.begin()
    spinning.end()
    assert not spinning.is_sleeping and not parked_threads()
    spinning.close()


def test_no_choice_where_a_spare_cpu_absorbs_the_competition(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert BarrierWaits.for_device(torch.device("cpu")) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert BarrierWaits.for_device(torch.device("meta")) is None


def test_auto_reads_the_run_queue_wait_once_per_window_of_steps(monkeypatch):
    # reading schedstat cost ~25 us a read in the stepping thread: steps are observed in windows of
    # WINDOW_S, each read twice, and the chooser sees the window's step time (not the gaps between)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    monkeypatch.setenv("SPECRAY_CPU_BARRIER_WAITS", "auto")
    waits = BarrierWaits.for_device(torch.device("cpu"))
    reads, seen = [], []
    monkeypatch.setattr(waits, "_wait_ns", lambda: reads.append(1) or 10_000_000 * len(reads))
    monkeypatch.setattr(WaitChooser, "observe", lambda self, now, wall, wait: seen.append((wall, wait)) or False)
    try:
        for _ in range(5):  # quick steps: one window, opened by the first
            waits.begin()
            waits.end()
        assert len(reads) == 1 and not seen
        time.sleep(WINDOW_S)  # a gap between steps is not step time
        waits.begin()
        time.sleep(0.002)
        waits.end()
        assert len(reads) == 2 and len(seen) == 1
        wall, wait = seen[0]
        assert 0.002 <= wall < WINDOW_S and wait == 0.01  # 10 ms more run-queue wait at the second read
        waits.begin()  # the next window opens with a read of its own
        assert len(reads) == 3
    finally:
        waits.close()
