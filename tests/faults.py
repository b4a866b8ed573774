"""Fault injection shared by the launcher tests: hit a rank in the middle of a call."""

from __future__ import annotations

import os
import threading
import time

from specray import SamplingParams

LONG_CALL = SamplingParams(max_tokens=900, ignore_eos=True)  # many seconds unless interrupted


def fail_mid_call(llm, rank: int, sig: int, join_s: float) -> tuple[BaseException | None, float]:
    """Send ``sig`` to ``rank``'s process one second into a long call; returns what generate
    raised (None if it returned) and the seconds from the signal to the error."""
    result: dict = {}

    def call() -> None:
        try:
            llm.generate([[1, 2, 3]], LONG_CALL)
        except BaseException as e:
            result["error"], result["at"] = e, time.monotonic()

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(1.0)
    hit_at = time.monotonic()
    os.kill(llm._engine.pids[rank], sig)
    thread.join(join_s)
    assert not thread.is_alive(), f"generate still running {join_s:.0f} s after rank {rank} was hit"
    return result.get("error"), result.get("at", time.monotonic()) - hit_at
