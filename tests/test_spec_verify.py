"""The verification maths (pure functions) and the scheduler's rollback, without a model."""

from __future__ import annotations

import torch

from specray.config import SamplingParams
from specray.executor.scheduler import Scheduler, Sequence
from specray.workers.verify import accept_greedy, accept_rejection, forced_num_emitted
from specray.kv.allocator import BlockAllocator


def test_greedy_accepts_the_longest_matching_prefix():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_greedy([5, 6, 7, 8], [5, 9, 7]) == 1
    assert accept_greedy([5, 6], [4]) == 0


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_reproduces_the_target_distribution():
    # Small vocabulary, a target p and a deliberately different draft q at two positions.
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                      [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
                      [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
    q = torch.tensor([[0.10, 0.10, 0.30, 0.30, 0.10, 0.10],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    gen = torch.Generator().manual_seed(1234)
    trials = 20000
    first = torch.zeros(6)
    second_given_first_accepted = torch.zeros(6)
    accepted_any = 0
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        n, bonus = accept_rejection(p, q, drafts, gen)
        emitted = drafts[:n] + [bonus]
        first[emitted[0]] += 1
        if n >= 1:
            accepted_any += 1
            second_given_first_accepted[emitted[1]] += 1
    # Chi-square with 5 degrees of freedom: 20.5 is the 0.999 quantile, so a correct
    # sampler fails this fixed-seed test with probability 0.1%; a sampler that emitted
    # the draft's own law fails it by orders of magnitude (checked below).
    threshold = 20.5
    assert _chi_square(first, p[0]) < threshold
    # The second token is the target's law at position 1 whatever the first was.
    assert _chi_square(second_given_first_accepted, p[1]) < threshold
    assert _chi_square(first, q[0]) > 50 * threshold  # the test can tell p from q
    assert 0.2 * trials < accepted_any < 0.9 * trials  # both branches ran


def test_identical_draft_and_target_always_accept():
    p = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[j], 1, generator=gen)) for j in range(3)]
        n, _ = accept_rejection(p, p[:3], drafts, gen)
        assert n == 3


def test_forced_acceptance_draws_the_integer_part_plus_one_with_the_fraction():
    gen = torch.Generator().manual_seed(7)
    draws = [forced_num_emitted(2.25, 3, gen) for _ in range(8000)]
    assert set(draws) == {2, 3}
    # mean 2.25, per-draw std sqrt(0.25 * 0.75) = 0.433: 4 standard errors is 0.019
    assert abs(sum(draws) / len(draws) - 2.25) < 0.02
    assert {forced_num_emitted(4.0, 3, gen) for _ in range(50)} == {4}


def test_scheduler_rolls_back_rejected_drafts_and_frees_empty_pages():
    target, draft = BlockAllocator(16), BlockAllocator(8)
    sched = Scheduler(target, 8, max_num_seqs=4, max_num_batched_tokens=1024, num_draft_tokens=4,
                      draft_allocator=draft, draft_tokens_per_block=16)
    seq = Sequence(0, list(range(15)), 15, SamplingParams(max_tokens=50), seed=0)
    sched.add(seq)
    plan = sched.schedule()  # prefill 15 tokens + 4 lookahead: 3 target pages of 8, 2 draft pages of 16
    assert plan.num_drafts == [0] and len(seq.block_table) == 3 and len(seq.draft_block_table) == 2
    sched.finish_step([[100]])  # 16 tokens, 15 cached
    plan = sched.schedule()
    assert plan.num_drafts == [4] and plan.input_ids == [[100]]
    sched.finish_step([[101]])  # every draft rejected: the bonus only; 16 tokens cached
    # pages past the 16 verified tokens held only rejected drafts: target keeps 2 of 3, draft 1 of 2
    assert len(seq.block_table) == 2 and len(seq.draft_block_table) == 1
    assert seq.num_computed == 16 and seq.accepted_counts == [0]
    plan = sched.schedule()
    assert plan.truncated == {0: (2, 1)}
    assert plan.start_positions == [16] and len(plan.new_blocks[0]) == 1 and len(plan.new_draft_blocks[0]) == 1
    sched.finish_step([[1, 2, 3, 4, 5]])  # all four accepted plus the bonus
    assert seq.num_computed == 21 and seq.accepted_counts == [0, 4]
    assert target.num_free + len(seq.block_table) == 16 and draft.num_free + len(seq.draft_block_table) == 8
