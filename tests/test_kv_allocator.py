"""Allocator and scheduler page accounting, checked as properties with hypothesis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specray.config import SamplingParams
from specray.executor.scheduler import Scheduler, Sequence
from specray.kv.allocator import BlockAllocator, OutOfBlocks, blocks_needed


@given(st.integers(1, 64), st.lists(st.tuples(st.booleans(), st.integers(0, 8)), max_size=200))
def test_allocator_never_hands_out_a_page_twice(num_blocks, ops):
    alloc = BlockAllocator(num_blocks)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            try:
                held.append(alloc.allocate(n))
            except OutOfBlocks:
                assert n > alloc.num_free
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = [b for blocks in held for b in blocks]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(owned) + alloc.num_free == num_blocks
    for blocks in held:
        alloc.free(blocks)
    assert alloc.num_free == num_blocks


def _run_scheduler(num_blocks, block, requests, max_num_seqs):
    """Drive the scheduler with a fake model; returns it and every step's plan."""
    alloc = BlockAllocator(num_blocks)
    sched = Scheduler(alloc, block, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    for i, (prompt_len, max_tokens) in enumerate(requests):
        sched.add(Sequence(i, list(range(prompt_len)), prompt_len, SamplingParams(max_tokens=max_tokens), 0))
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned)), "two running requests share a page"
        assert len(owned) + alloc.num_free == num_blocks, "a page is neither free nor owned"
        for s in sched.running:
            assert len(s.block_table) >= blocks_needed(len(s.token_ids), block)
        assert plan.seq_ids, "the scheduler stalled with work left"
        sched.finish_step([7] * len(plan.seq_ids))
        steps += 1
        assert steps < 10_000
    return sched, alloc


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 24), st.sampled_from([8, 16]),
       st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12), st.integers(1, 8))
def test_every_page_returns_after_all_requests_end(num_blocks, block, requests, max_num_seqs):
    capacity = num_blocks * block
    requests = [(p, m) for p, m in requests if p + m <= capacity] or [(1, 1)]
    sched, alloc = _run_scheduler(num_blocks, block, requests, max_num_seqs)
    assert alloc.num_free == num_blocks


def test_preemption_picks_the_most_recently_admitted():
    # 6 pages of 8 tokens; three 15-token prompts take 2 pages each; once they hold 17
    # tokens the oldest needs a third page, so the newest is preempted.
    alloc = BlockAllocator(6)
    sched = Scheduler(alloc, 8, max_num_seqs=8, max_num_batched_tokens=256)
    seqs = [Sequence(i, list(range(15)), 15, SamplingParams(max_tokens=4), 0) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.finish_step([1] * len(sched.schedule().seq_ids))  # prefill all three: 16 tokens each
    sched.finish_step([1] * len(sched.schedule().seq_ids))  # decode: 17 tokens each
    sched.schedule()  # token 17's KV needs a third page
    assert seqs[2].num_preemptions >= 1 and seqs[0].num_preemptions == 0
    assert sched.waiting[0] is seqs[2]
