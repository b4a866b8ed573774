"""Sharded runs under the ``mp`` launcher (CPU, gloo, tiny checkpoints).

Reference: the same checkpoint on one rank (``local``), which the foundation tests hold equal
to Hugging Face transformers. Greedy tokens must match exactly: the shards compute the same
sums in a different order, and these tiny random models have no near-ties in 6 tokens (a
tolerance would hide a wrong shard). Every run uses ``check_every_step``, so every rank's
tokens are compared after every step, besides the digest every call compares.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from faults import fail_mid_call
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.comm.shm import leftover_segments
from specray.launch.procs import RankFailure

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41], [300, 9, 27, 1, 77]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=50, seed=7)
KV = KVConfig(tokens_per_block=16, capacity_tokens=1024)


def config(model, tp=1, moe_tp=None, moe_ep=None, launcher="local", timeout_s=30.0, **parallel) -> EngineConfig:
    return EngineConfig(model=str(model), kv=KV, parallel=ParallelConfig(
        tp_size=tp, moe_tp_size=moe_tp, moe_ep_size=moe_ep, launcher=launcher, timeout_s=timeout_s,
        check_every_step=True, **parallel))


def single_rank_tokens(model) -> list[list[int]]:
    with LLM(config(model)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_nothing_left(llm_engine) -> None:
    for pid in llm_engine.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert leftover_segments(llm_engine.job_id) == []


@pytest.mark.parametrize("family, tp, moe_tp, moe_ep", [
    ("llama", 4, None, None),  # 2 kv heads over 4 ranks: kv heads replicated
    ("qwen3", 2, None, None),
    ("qwen3_moe", 2, 2, 1),  # every expert split in two
    ("qwen3_moe", 2, 1, 2),  # two contiguous groups of whole experts
    ("qwen3_moe", 4, 2, 2),
])
def test_sharded_greedy_equals_single_rank(tiny_checkpoints, family, tp, moe_tp, moe_ep):
    model = tiny_checkpoints(family)
    expected = single_rank_tokens(model)
    llm = LLM(config(model, tp, moe_tp, moe_ep, launcher="mp"))
    engine = llm._engine
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        sampled = llm.generate(PROMPTS, SAMPLED)  # ranks must agree on sampled tokens too (checked)
    finally:
        llm.close()
    assert got == expected
    assert all(len(o.token_ids) == 6 for o in sampled)
    assert_nothing_left(engine)



def test_two_jobs_on_one_host_run_at_once(tiny_checkpoints):
    """Llama TP=2, twice at once: own store port, own shared memory, same exact tokens."""
    model = tiny_checkpoints("llama")
    expected = single_rank_tokens(model)
    llms: list[LLM] = [None, None]
    outputs: list[list[list[int]]] = [None, None]

    def job(i: int) -> None:
        llms[i] = LLM(config(model, 2, launcher="mp"))
        outputs[i] = [o.token_ids for o in llms[i].generate(PROMPTS, GREEDY)]

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engines = [llm._engine for llm in llms]
    try:
        assert outputs == [expected, expected]
        assert engines[0].job_id != engines[1].job_id
        with pytest.raises(ValueError, match="request 0: the prompt is empty"):
            llms[0].generate([[]], GREEDY)  # rejected before any step: the job goes on
        assert [o.token_ids for o in llms[0].generate(PROMPTS, GREEDY)] == expected
    finally:
        for llm in llms:
            llm.close()
            llm.close()  # safe twice
    for engine in engines:
        assert_nothing_left(engine)


def test_killed_follower_fails_generate_naming_the_rank(tiny_checkpoints, step_dir):
    model = tiny_checkpoints("llama")
    timeout_s = 10.0
    llm = LLM(config(model, 2, launcher="mp", timeout_s=timeout_s))
    engine = llm._engine
    error, after_s = fail_mid_call(llm, 1, signal.SIGKILL, join_s=3 * timeout_s, step_dir=step_dir)
    assert isinstance(error, RankFailure), f"generate returned or raised {error!r}"
    assert error.ranks == [1] and "rank 1" in str(error) and "SIGKILL" in str(error)
    # the driver sees the death through the process's sentinel at once (then settles 1 s), while
    # a peer's collective would only give up after timeout_s: half of it tells the two apart
    assert after_s < timeout_s / 2
    llm.close()
    llm.close()
    assert_nothing_left(engine)


def test_stopped_follower_fails_generate_naming_the_rank(tiny_checkpoints, step_dir):
    """A rank that hangs without dying (SIGSTOP) is named once rank 0's gloo all-reduce times
    out (the one-shot all-reduce names it itself; this is the torch.distributed path)."""
    model = tiny_checkpoints("llama")
    timeout_s = 5.0
    llm = LLM(config(model, 2, launcher="mp", timeout_s=timeout_s, allreduce="torch"))
    engine = llm._engine
    error, after_s = fail_mid_call(llm, 1, signal.SIGSTOP, join_s=6 * timeout_s, step_dir=step_dir)
    assert isinstance(error, RankFailure), f"generate returned or raised {error!r}"
    assert error.ranks == [1], str(error)
    assert f"rank 1 (pid {engine.pids[1]}) is alive but reported nothing" in str(error)
    assert after_s < 3 * timeout_s
    llm.close()
    assert_nothing_left(engine)  # the stopped rank was killed with the rest


def test_idle_longer_than_the_timeout_is_not_death(tiny_checkpoints):
    """Followers wait for plans with the group timeout; rank 0's heartbeats keep an idle job alive."""
    model = tiny_checkpoints("llama")
    expected = single_rank_tokens(model)
    timeout_s = 5.0
    with LLM(config(model, 2, launcher="mp", timeout_s=timeout_s)) as llm:
        time.sleep(timeout_s * 1.5)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
