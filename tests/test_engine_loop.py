"""The engine loop takes requests at any step: joins, aborts, streams, idleness, failure.

Every check is on greedy decoding of tiny random models, so a request's tokens are the same
however it is batched: a request that joins a running batch, or streams, must produce
exactly its solo tokens (no tolerance: batched rows are independent in the kernels, and
greedy on these models has no near-ties; test_engine.py holds batched equal to solo).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from checkpoints import make_checkpoint

from specray import LLM, AsyncLLM, EngineConfig, KVConfig, ParallelConfig, RankFailure, SamplingParams, SpecConfig
from specray.models.drafter_presets import write_drafter_for

KV = KVConfig(tokens_per_block=16, capacity_tokens=4096)
LONG = SamplingParams(max_tokens=48, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def config(launcher="local", tp=1, timeout_s=30.0, **kw) -> EngineConfig:
    return EngineConfig(model="tiny-llama", kv=KV, parallel=ParallelConfig(tp_size=tp, launcher=launcher,
                                                                            timeout_s=timeout_s), **kw)


def run(coro, timeout_s: float = 180.0):
    """Run a test coroutine with a bound: a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def tokens_of(llm: AsyncLLM, prompt, params, request_id=None) -> list[int]:
    out = []
    async for delta in llm.generate(prompt, params, request_id):
        out += delta.new_token_ids
    return out


def assert_all_pages_free(engine) -> None:
    core = engine.core
    assert core.allocator.num_free == core.allocator.num_blocks
    if core.draft_allocator is not None:
        assert core.draft_allocator.num_free == core.draft_allocator.num_blocks
    assert not core.scheduler.running and not core.scheduler.waiting and not core.live


def test_a_request_added_mid_generation_joins_the_running_batch():
    async def main():
        llm = AsyncLLM(config())
        try:
            solo_a = await tokens_of(llm, [1, 2, 3], LONG)
            solo_b = await tokens_of(llm, [7, 8], SHORT)
            order, got = [], {"a": [], "b": []}

            async def a():
                async for d in llm.generate([1, 2, 3], LONG, "a"):
                    got["a"] += d.new_token_ids
                    if len(got["a"]) == 3:  # A is surely running: B joins now
                        b_task.set_result(asyncio.create_task(b()))
                order.append("a")

            async def b():
                async for d in llm.generate([7, 8], SHORT, "b"):
                    got["b"] += d.new_token_ids
                order.append("b")

            b_task = asyncio.get_running_loop().create_future()
            await a()
            await (await b_task)
            assert order == ["b", "a"]  # B (4 tokens) ran beside A (48) and finished first
            assert got == {"a": solo_a, "b": solo_b}
            assert_all_pages_free(llm._engine)
        finally:
            await llm.close()

    run(main())


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop-spec")
    target = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3)
    return EngineConfig(model=str(target), kv=KVConfig(tokens_per_block=32, capacity_tokens=4096),
                        spec=SpecConfig(method="draft_model", num_draft_tokens=3,
                                        draft_model=str(write_drafter_for(target, "draft_model", root / "d"))))


@pytest.mark.parametrize("kind", ["plain", "standalone drafter"])
def test_abort_mid_stream_frees_every_page_and_the_others_go_on(kind, standalone):
    cfg = config() if kind == "plain" else standalone

    async def main():
        llm = AsyncLLM(cfg)
        try:
            solo = await tokens_of(llm, [5, 6, 7], LONG)
            if kind != "plain":
                assert llm._engine.core.draft_allocator is not None  # the drafter has its own pool
            victim = llm.generate([1, 2, 3], LONG, "victim")
            other = asyncio.create_task(tokens_of(llm, [5, 6, 7], LONG, "other"))
            seen = [d async for d, _ in zip_first(victim, 3)]
            await victim.aclose()  # the client went away: abort
            aborted = llm.generate([9, 9, 9], LONG, "aborted")
            first = await aborted.__anext__()
            await llm.abort("aborted")
            last = [d async for d in aborted]
            assert last[-1].finish_reason == "abort" and first.finish_reason is None
            assert await other == solo  # the other request kept going, unchanged
            assert len(seen) == 3
            stats = llm.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert set(stats.kv_usage.values()) == {0.0}
            assert_all_pages_free(llm._engine)
        finally:
            await llm.close()

    run(main())


async def zip_first(stream, n: int):
    """The first ``n`` deltas of ``stream`` (as (delta, i) pairs), leaving it open."""
    for i in range(n):
        yield await stream.__anext__(), i


@pytest.mark.parametrize("launcher, tp", [("local", 1), ("mp", 2), ("ray", 2)])
def test_32_concurrent_streams_with_a_third_cancelled(launcher, tp, request):
    if launcher == "ray":
        request.getfixturevalue("ray_cluster")
    prompts = [[1 + i % 7, 2 + i, 3] for i in range(32)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def main():
        llm = AsyncLLM(config(launcher, tp))
        try:
            solo = [o.token_ids for o in llm._engine.generate(prompts, [params] * 32)]  # LLM.generate's path

            async def client(i: int):
                stream = llm.generate(prompts[i], params, f"c{i}")
                got = []
                async for delta in stream:
                    got += delta.new_token_ids
                    if i % 3 == 0 and len(got) >= 2:
                        await stream.aclose()  # cancelled mid-stream
                        return None
                return got

            results = await asyncio.gather(*[client(i) for i in range(32)])
            for i, got in enumerate(results):
                assert (got is None) == (i % 3 == 0)
                if got is not None:
                    assert got == solo[i], i
            # the aborts reach the loop after the streams ended: wait for the stats to say so
            deadline = time.monotonic() + 30
            while llm.stats().num_running + llm.stats().num_waiting and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stats = llm.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert set(stats.kv_usage.values()) == {0.0}  # every page of every pool is free
            if launcher == "local":
                assert_all_pages_free(llm._engine)
        finally:
            await llm.close()

    run(main())


def test_streamed_tokens_and_text_equal_the_batch_call():
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop=["e"]),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=5),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    prompts = ["hello world", [40, 41, 42], "the cat"]

    async def main():
        llm = AsyncLLM(config())
        try:
            batch = llm._engine.generate(prompts, params)
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                deltas = [d async for d in llm.generate(prompt, p)]
                assert sum((d.new_token_ids for d in deltas), []) == batch[i].token_ids
                assert "".join(d.new_text for d in deltas) == batch[i].text
                assert deltas[0].prompt_token_ids == batch[i].prompt_token_ids
                assert [d.num_output_tokens for d in deltas] == list(range(1, len(batch[i].token_ids) + 1))
                assert deltas[-1].finish_reason == batch[i].finish_reason
                assert deltas[-1].stop_reason == batch[i].stop_reason
                assert all(d.finish_reason is None for d in deltas[:-1])
                assert deltas[-1].metrics["num_output_tokens"] == len(batch[i].token_ids)
            with pytest.raises(ValueError, match=r"request 'bad': token id 9999 is outside the vocabulary"):
                await llm.generate([9999], SHORT, "bad").__anext__()
        finally:
            await llm.close()

    run(main())


IDLE_S = 2.0
IDLE_CPU_S = 0.2
"""CPU rank 0 may use over 2 idle seconds. An idle loop blocks on its inbox and wakes every
timeout_s / 4 to send a heartbeat (a few ms each); a busy spin would burn ~2 s. 0.2 s (10%)
leaves room for the interpreter's own threads and a loaded 2-core machine."""


@pytest.mark.parametrize("launcher, tp", [("local", 1), ("mp", 2)])
def test_the_loop_does_not_spin_when_idle(launcher, tp):
    with LLM(config(launcher, tp, timeout_s=4.0)) as llm:  # heartbeats every 1 s
        llm.generate([[1, 2, 3]], SHORT)
        rank0 = psutil.Process(llm._engine.pids[0] if launcher == "mp" else os.getpid())
        before = rank0.cpu_times()
        time.sleep(IDLE_S)
        after = rank0.cpu_times()
        used = (after.user + after.system) - (before.user + before.system)
        assert used < IDLE_CPU_S, f"rank 0 used {used:.2f} s of CPU in {IDLE_S} idle seconds"
        assert len(llm.generate([[1, 2, 3]], SHORT)[0].token_ids) == 4  # still serving


def test_a_killed_rank_fails_every_request_in_flight_and_turns_unhealthy():
    timeout_s = 10.0

    async def main():
        llm = AsyncLLM(config("mp", 2, timeout_s=timeout_s))
        try:
            assert llm.is_healthy
            streams = [llm.generate([1, 2, i], SamplingParams(max_tokens=900, ignore_eos=True)) for i in range(4)]
            for s in streams:
                await s.__anext__()  # every request is running
            killed_at = time.monotonic()
            os.kill(llm._engine.pids[1], signal.SIGKILL)
            errors = await asyncio.gather(*[drain(s) for s in streams], return_exceptions=True)
            after_s = time.monotonic() - killed_at
            assert all(isinstance(e, RankFailure) and e.ranks == [1] for e in errors), errors
            # the driver sees the death through the process's sentinel (then settles 1 s); a
            # collective timing out would take timeout_s
            assert after_s < timeout_s / 2
            assert not llm.is_healthy
            with pytest.raises(RankFailure, match="rank 1"):
                await llm.generate([1, 2], SHORT).__anext__()
        finally:
            await llm.close()

    run(main())


async def drain(stream):
    async for _ in stream:
        pass


def test_scheduler_abort_frees_both_pools_and_tells_the_ranks_only_what_they_saw():
    from specray.executor.scheduler import Scheduler, Sequence
    from specray.kv.allocator import BlockAllocator

    target, draft = BlockAllocator(8), BlockAllocator(16)
    sched = Scheduler(target, 16, max_num_seqs=1, max_num_batched_tokens=512, num_draft_tokens=2,
                      draft_allocator=draft, draft_tokens_per_block=8)
    running, waiting = (Sequence(i, list(range(1, 20)), 19, SHORT, seed=i) for i in range(2))
    sched.add(running)
    sched.add(waiting)
    sched.schedule()  # max_num_seqs=1: the first runs (pages in both pools), the second waits
    assert sched.running == [running] and target.num_free < 8 and draft.num_free < 16
    sched.abort(waiting)
    sched.abort(running)
    assert (target.num_free, draft.num_free) == (8, 16)
    assert not sched.has_work and running.finish_reason == waiting.finish_reason == "abort"
    assert sched.schedule().finished == [0]  # the ranks never saw request 1


def test_spec_counters_count_as_vllm():
    from specray.executor.spec_metrics import SpecCounters

    c = SpecCounters(3)
    for accepted, proposed in [(3, 3), (0, 3), (1, 2)]:
        c.record(accepted, proposed)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 8, 4)
    assert c.accepted_per_position == [2, 1, 1]  # never increases with the position
