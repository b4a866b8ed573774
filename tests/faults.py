"""Fault injection shared by the launcher tests: hit a rank in the middle of a call.

"In the middle" is a condition, not a delay: the ranks write their step counts to files
(``SPECRAY_TEST_STEP_DIR``, set before the LLM starts its ranks), and the signal goes out
once the rank to hit has run steps of the call."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from specray import SamplingParams

LONG_CALL = SamplingParams(max_tokens=900, ignore_eos=True)  # many seconds unless interrupted
STEP_DIR_VAR = "SPECRAY_TEST_STEP_DIR"
STEPS_INTO_THE_CALL = 3  # prefill, then decode steps: the call is surely under way
START_TIMEOUT_S = 120.0  # generous: a loaded 2-core machine; only a broken call waits this long


def steps_done(step_dir: Path, rank: int) -> int:
    """The steps ``rank`` has run so far (0 before its first; a half-written file reads as 0)."""
    try:
        return int((Path(step_dir) / f"rank{rank}.steps").read_text())
    except (OSError, ValueError):
        return 0


def wait_for_steps(step_dir: Path, rank: int, at_least: int, is_running, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once ``rank`` has run ``at_least`` steps; fail if the call ends or times out first."""
    deadline = time.monotonic() + timeout_s
    while steps_done(step_dir, rank) < at_least:
        assert is_running(), f"the call ended before rank {rank} ran {at_least} steps"
        assert time.monotonic() < deadline, f"rank {rank} did not run {at_least} steps within {timeout_s:.0f} s"
        time.sleep(0.005)  # polling the file, not a stand-in for the condition


def fail_mid_call(llm, rank: int, sig: int, join_s: float, step_dir: Path) -> tuple[BaseException | None, float]:
    """Send ``sig`` to ``rank``'s process once it has run a few steps of a long call; returns
    what generate raised (None if it returned) and the seconds from the signal to the error.
    ``step_dir`` must have been ``SPECRAY_TEST_STEP_DIR`` when ``llm`` started its ranks."""
    result: dict = {}

    def call() -> None:
        try:
            llm.generate([[1, 2, 3]], LONG_CALL)
        except BaseException as e:
            result["error"], result["at"] = e, time.monotonic()

    before = steps_done(step_dir, rank)
    thread = threading.Thread(target=call)
    thread.start()
    wait_for_steps(step_dir, rank, before + STEPS_INTO_THE_CALL, thread.is_alive)
    hit_at = time.monotonic()
    os.kill(llm._engine.pids[rank], sig)
    thread.join(join_s)
    assert not thread.is_alive(), f"generate still running {join_s:.0f} s after rank {rank} was hit"
    return result.get("error"), result.get("at", time.monotonic()) - hit_at
