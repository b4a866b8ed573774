"""The ``ray`` launcher on the session's shared local Ray instance (CPU, gloo).

One actor per rank in a placement group; the driver talks to rank 0 only. Parity reference:
the same checkpoint on one rank, token for token (see test_ranks_mp.py for why exact)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from faults import fail_mid_call
from specray import LLM
from specray.comm.shm import leftover_segments
from specray.launch.procs import RankFailure
from test_ranks_mp import GREEDY, PROMPTS, config, single_rank_tokens


def assert_nothing_left(ray, engine, pg) -> None:
    deadline = time.monotonic() + 20
    alive = list(engine.pids)
    while alive and time.monotonic() < deadline:  # Ray reaps killed actors asynchronously
        alive = [pid for pid in alive if _is_alive(pid)]
        time.sleep(0.1)
    assert alive == []
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert leftover_segments(engine.job_id) == []


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def test_ray_moe_expert_parallel_equals_single_rank(ray_cluster, tiny_checkpoints):
    model = tiny_checkpoints("qwen3_moe")
    expected = single_rank_tokens(model)
    llm = LLM(config(model, tp=2, moe_tp=1, moe_ep=2, launcher="ray"))
    engine, pg = llm._engine, llm._engine._pg
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[10**6]], GREEDY)
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == expected[:1]
    finally:
        llm.close()
        llm.close()
    assert_nothing_left(ray_cluster, engine, pg)


def test_ray_killed_follower_fails_generate_naming_the_rank(ray_cluster, tiny_checkpoints, step_dir):
    timeout_s = 20.0
    llm = LLM(config(tiny_checkpoints("llama"), tp=2, launcher="ray", timeout_s=timeout_s))
    engine, pg = llm._engine, llm._engine._pg
    error, after_s = fail_mid_call(llm, 1, signal.SIGKILL, join_s=3 * timeout_s, step_dir=step_dir)
    assert isinstance(error, RankFailure), f"generate returned or raised {error!r}"
    assert error.ranks == [1] and "rank 1" in str(error), str(error)
    # rank 0's gloo sees the peer's socket close at once and its loop ends; the driver then waits
    # at most min(5 s, failure_timeout_s / 8) for the dead actor to show. A collective timing out
    # would take timeout_s: half of it tells the two apart
    assert after_s < timeout_s / 2
    llm.close()
    llm.close()
    assert_nothing_left(ray_cluster, engine, pg)
