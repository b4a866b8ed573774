"""Adaptive draft lengths in the scheduler (executor/adaptive.py with executor/scheduler.py),
plain Python with made-up tokens: a prefill arriving does not change the running rows'
lengths (and a mutation that lets prefill rows into the decision does); a sequence holds
pages for its tokens plus the length chosen for it, never the ceiling (and a mutation that
reserves the ceiling, as a static k does, is caught); lengths stay put under a steady noisy
load (bounded switches per 100 steps, through the engine's observe path; without the margin
they flap); a request with too few steps left to use a probe is not probed. The step times are
what a known linear cost gives, so the online fit stays on it."""

from __future__ import annotations

import math
import random

import pytest

from specray.config import SamplingParams
from specray.executor.adaptive import AdaptiveDraftLengths, step_shape
from specray.executor.draft_controller import DraftLengthPolicy
from specray.executor.draft_length import draft_forwards
from specray.executor.scheduler import Scheduler, Sequence
from specray.executor.step_cost import StepCost, StepShape
from specray.kv.allocator import BlockAllocator, blocks_needed
from specray.workers.plan import StepPlan

K, PAGE, DRAFT_PAGE = 4, 4, 8  # small pages: a slot past the chosen length shows as a page
TRUE = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0015, c_prefill_token=0.0005,
                c_draft_row=0.0002, c_draft_forward=0.001)
# a step cost dominated by its fixed part: its share per row falls as rows join, so a decision
# that counted an arriving prefill row moves the running rows' lengths (2 each -> 1 each here)
ARRIVAL = StepCost(c_step=0.030, c_decode_row=0.001, c_verify_row=0.001, c_prefill_token=0.0005,
                   c_draft_row=0.0002, c_draft_forward=0.004)


def make(method="draft_model", budget=1 << 20, margin=0.05, prior=TRUE):
    sched = Scheduler(BlockAllocator(8192), PAGE, 16, budget, num_draft_tokens=K,
                      draft_allocator=BlockAllocator(8192), draft_tokens_per_block=DRAFT_PAGE)
    adaptive = AdaptiveDraftLengths(method, K, prior=prior,
                                    policy=DraftLengthPolicy(ceiling=K, switch_margin=margin))
    sched.choose_draft_lengths = adaptive.choose
    return sched, adaptive


def sequence(sid, prompt_len, max_tokens=1000):
    return Sequence(sid, [(sid * 7 + i) % 50 for i in range(prompt_len)], prompt_len,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0)


def shape_of(plan, method):
    decode = [n for ids, n in zip(plan.input_ids, plan.num_drafts) if len(ids) == 1]
    prefill = sum(len(ids) for ids in plan.input_ids if len(ids) > 1)
    return StepShape(num_decode_rows=len(decode), num_verify_rows=sum(decode), num_draft_rows=sum(decode),
                     num_prefill_tokens=prefill, num_draft_forwards=draft_forwards(method, max(decode, default=0)))


def step(sched, adaptive, rngs, method="draft_model", p_accept=0.7, noise=None, true=TRUE):
    """One step: each drafting row accepts each draft with p_accept (its own rng); the step
    takes ``true``'s time (times noise). Returns the plan."""
    plan = sched.schedule()
    tokens = []
    for sid, n in zip(plan.seq_ids, plan.num_drafts):
        if sid in plan.partial:
            tokens.append(None)
            continue
        rng = rngs.setdefault(sid, random.Random(sid))
        accepted = next((i for i in range(n) if rng.random() >= p_accept), n)
        tokens.append([rng.randrange(50) for _ in range(accepted + 1)])
    sched.finish_step(tokens, list(plan.num_drafts))
    seconds = true.predict(shape_of(plan, method)) * (noise() if noise else 1.0)
    adaptive.observe(plan, list(plan.num_drafts), tokens, seconds)
    return plan


def lengths_with_an_arrival(arrival_step, steps=24):
    """The lengths of requests 0 and 1 per step (and, per step, whether request 2 was passed
    to the decision); request 2, a 300-token prompt in 64-token chunks, arrives at
    ``arrival_step`` (None: never)."""
    sched, adaptive = make(budget=64, prior=ARRIVAL, margin=0.0)  # no hysteresis to hide a change
    choose, seen = adaptive.choose, []

    def spy(decoding):
        seen.append([seq.seq_id for seq in decoding])
        return choose(decoding)

    sched.choose_draft_lengths = spy
    for sid in (0, 1):
        sched.add(sequence(sid, 6))
    rngs, lengths, prefilling = {}, [], []
    for i in range(steps):
        if i == arrival_step:
            sched.add(sequence(2, 300))
        plan = step(sched, adaptive, rngs, true=ARRIVAL)
        by_sid = dict(zip(plan.seq_ids, plan.num_drafts))
        lengths.append((by_sid.get(0), by_sid.get(1)))
        prefilling.append(2 in plan.seq_ids and len(plan.input_ids[plan.seq_ids.index(2)]) > 1)
    return lengths, prefilling, seen


def test_a_prefill_arriving_does_not_change_the_running_rows_lengths():
    alone, _, _ = lengths_with_an_arrival(None)
    joined, prefilling, seen = lengths_with_an_arrival(6)
    steps = [i for i, p in enumerate(prefilling) if p]
    assert len(steps) >= 4  # request 2 prefilled in chunks beside the decoding rows
    last = steps[-1]
    assert joined[:last + 1] == alone[:last + 1]
    assert any(k for pair in joined[6:last + 1] for k in pair)  # the running rows drafted meanwhile
    assert all(2 not in ids for ids, p in zip(seen, prefilling) if p)


def test_mutation_a_decision_over_every_scheduled_row_is_caught(monkeypatch):
    # vLLM #49548's trap: lengths keyed on every scheduled request, an arriving prefill included
    def decide_on_every_row(self):
        rows = list(self.running)
        self.draft_lengths = dict(zip((s.seq_id for s in rows), self.choose_draft_lengths(rows)))

    monkeypatch.setattr(Scheduler, "_decide_draft_lengths", decide_on_every_row)
    alone, _, _ = lengths_with_an_arrival(None)
    joined, prefilling, _ = lengths_with_an_arrival(6)
    last = max(i for i, p in enumerate(prefilling) if p)
    assert joined[:last + 1] != alone[:last + 1]


def check_pages(sched, plan):
    """Every scheduled sequence holds pages for its tokens plus its chosen length, no more."""
    for seq in sched.running:
        if seq.seq_id not in plan.seq_ids:
            continue
        n = plan.num_drafts[plan.seq_ids.index(seq.seq_id)]
        assert n == sched.draft_lengths.get(seq.seq_id, 0)
        tokens = len(seq.token_ids) + n
        assert len(seq.block_table) == blocks_needed(tokens, PAGE), (seq.seq_id, n, len(seq.token_ids))
        assert len(seq.draft_block_table) == blocks_needed(tokens, DRAFT_PAGE), (seq.seq_id, n)


def run_checking_pages(steps=60):
    sched, adaptive = make(budget=48)
    rngs, lengths = {}, set()
    for sid in range(4):
        sched.add(sequence(sid, 5 + 9 * sid, max_tokens=30 + 10 * sid))
    for i in range(steps):
        if i in (10, 25):  # prompts arriving mid-run, admitted with pages for their prompt only
            sched.add(sequence(10 + i, 70))
        plan = sched.schedule()
        check_pages(sched, plan)
        lengths.update(plan.num_drafts)
        tokens = [None if sid in plan.partial else [rngs.setdefault(sid, random.Random(sid)).randrange(50)
                                                     for _ in range(1 + (n > 0))]
                  for sid, n in zip(plan.seq_ids, plan.num_drafts)]
        sched.finish_step(tokens, list(plan.num_drafts))
        adaptive.observe(plan, list(plan.num_drafts), tokens, TRUE.predict(shape_of(plan, "draft_model")))
    return lengths


def test_no_lookahead_pages_past_the_chosen_length():
    lengths = run_checking_pages()
    # prefill rows (length 0) and drafting rows below the ceiling: where a static reservation differs
    assert 0 in lengths and lengths - {0, K}, lengths


def test_mutation_pages_for_the_ceiling_are_caught(monkeypatch):
    # the static-k reservation (vLLM #49548 kept it under its per-batch-size k)
    monkeypatch.setattr(Scheduler, "_lookahead", lambda self, seq: self.lookahead_tokens)
    with pytest.raises(AssertionError):
        run_checking_pages()


def switches_in_last_200(margin, seed=5, steps=300):
    """8 requests decoding steadily (ngram, acceptance 0.7), step times with 10% noise: the
    draft-length switches over the last 200 steps (the first 100 let the estimates settle)."""
    prior = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0012)
    sched, adaptive = make("ngram", margin=margin, prior=prior)
    noise_rng = random.Random(seed)
    for sid in range(8):
        sched.add(sequence(sid, 8, max_tokens=10_000))
    rngs = {sid: random.Random(seed * 100 + sid) for sid in range(8)}
    before = 0
    for i in range(steps):
        if i == steps - 200:
            before = adaptive.stats()["num_draft_length_switches"]
        step(sched, adaptive, rngs, "ngram", noise=lambda: max(0.5, 1 + noise_rng.gauss(0, 0.1)), true=prior)
    stats = adaptive.stats()
    assert sum(stats["draft_length_histogram"]) >= 8 * (steps - 1)
    return stats["num_draft_length_switches"] - before


def test_lengths_are_stable_under_a_steady_load():
    assert switches_in_last_200(0.05) <= 4  # at most 2 switches per 100 steps
    # mutation: without the margin the same load flaps (the estimates and the fit move each step)
    assert switches_in_last_200(0.0) > 3 * max(switches_in_last_200(0.05), 1)


def test_a_confidence_gated_step_sends_the_verify_threshold_its_goodput_prices():
    """dspark: a verified draft must add at least lam x c_verify_row tokens, lam the modelled
    goodput (tokens per second) of the lengths chosen; no threshold when nothing drafts or the
    drafter has no confidence head."""
    cost = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.002)
    adaptive = AdaptiveDraftLengths("dspark", K, prior=cost, confidence_gated=True)
    for _ in range(4):
        adaptive.controller.record(0, K, K)  # request 0 accepts everything: it drafts at the ceiling
    seqs = [sequence(0, 6)]
    assert adaptive.choose(seqs) == [K]
    p = adaptive.controller.estimates(0)
    tokens = 1 + sum(math.prod(p[:i + 1]) for i in range(K))
    seconds = 0.010 + 0.003 + 0.002 * K
    assert adaptive.verify_threshold == pytest.approx(tokens / seconds * 0.002, rel=1e-9)
    assert 0.2 < adaptive.verify_threshold < 1
    assert adaptive.choose([]) == [] and adaptive.verify_threshold is None
    plain_head = AdaptiveDraftLengths("dspark", K, prior=cost)
    plain_head.controller.record(0, K, K)
    plain_head.choose(seqs)
    assert plain_head.verify_threshold is None


def test_a_steps_shape_counts_drafter_rows_only_for_a_drafter_that_runs_a_model():
    plan = StepPlan(seq_ids=[0, 1, 2], input_ids=[[5], [6], [1, 2, 3]], num_drafts=[3, 0, 0])
    planned = {0: 3, 1: 2}  # request 1 asked for 2 drafts and its lookup found none; 2 is a prompt
    assert step_shape("ngram", plan, planned, [3, 0, 0]) == StepShape(
        num_decode_rows=2, num_verify_rows=3, num_prefill_tokens=3, num_draft_rows=0, num_draft_forwards=0)
    assert step_shape("draft_model", plan, planned, [3, 0, 0]) == StepShape(
        num_decode_rows=2, num_verify_rows=3, num_prefill_tokens=3, num_draft_rows=5, num_draft_forwards=3)


def test_a_request_too_short_to_use_a_probe_is_not_probed():
    # the scheduler hook passes each row's steps left (max_tokens less its output) to the decision
    adaptive = AdaptiveDraftLengths("ngram", K, prior=TRUE,
                                    policy=DraftLengthPolicy(ceiling=K, probe_interval=4, prior_acceptance=0.0,
                                                            warmup_verifies=1))
    adaptive.controller.record(-1, 1, 0)  # the engine has verified a draft: requests wait their interval
    adaptive.controller.forget(-1)
    short, long = sequence(1, 3, max_tokens=8), sequence(2, 3, max_tokens=100)
    runs = []
    for _ in range(5):
        runs.append(adaptive.choose([short, long]))
        for seq in (short, long):
            seq.token_ids.append(0)
    # at the fifth step both are due; the short one has 4 steps left, no more than the interval
    assert runs == [[0, 0]] * 4 + [[0, 1]], runs


class Scripted:
    """A controller whose lengths come from a script; the rest (records, stats) its own."""

    def __init__(self, controller, lengths):
        self.controller, self.lengths = controller, iter(lengths)

    def __getattr__(self, name):
        return getattr(self.controller, name)

    def decide(self, ids, cost, steps_left=None, resume_seconds=0.0):
        return next(self.lengths) if ids else []


def timings_with_catch_ups(method: str) -> tuple[list[int], AdaptiveDraftLengths]:
    """One request at lengths 2, 2, 0, 2, 2 after its prompt; a step takes the true cost's time,
    50x where the step is one the engine leaves out of the fit. Per step, the timings the fit took."""
    sched, adaptive = make(method=method)
    adaptive.controller = Scripted(adaptive.controller, [[2], [2], [0], [2], [2]])
    sched.add(sequence(0, 6))
    step(sched, adaptive, {}, method=method)  # the prompt: no drafter row, timed
    got = []
    for i in range(5):
        before = adaptive.cost.stats()["by_batch"][1]["num_step_timings"]
        plan = sched.schedule()
        tokens = [[1] * (n + 1) for n in plan.num_drafts]
        sched.finish_step(tokens, list(plan.num_drafts))
        catching_up = method != "ngram" and i in (0, 3)  # the first draft, the first after length 0
        seconds = TRUE.predict(shape_of(plan, method)) * (50 if catching_up else 1)
        adaptive.observe(plan, list(plan.num_drafts), tokens, seconds)
        got.append(adaptive.cost.stats()["by_batch"][1]["num_step_timings"] - before)
    return got, adaptive


@pytest.mark.parametrize("method, fitted", [("draft_model", [0, 1, 1, 0, 1]), ("ngram", [1, 1, 1, 1, 1])])
def test_a_step_whose_drafter_catches_up_is_left_out_of_the_fit(method, fitted, monkeypatch):
    """A row's first draft, and its first after steps at length 0, is where a drafter that runs a
    model catches up on what it has not seen: those steps are not timed into the cost model (they
    take 50x the model's time here, and the fit stays on it). Prompt lookup runs no model: every
    step is timed."""
    got, adaptive = timings_with_catch_ups(method)
    assert got == fitted
    assert adaptive.stats()["step_cost"]["num_steps_not_fitted"] == fitted.count(0)
    two = shape_of(StepPlan(seq_ids=[0], input_ids=[[1]], num_drafts=[2]), method)  # the price of 2 drafts
    assert adaptive.cost.at(1).predict(two) == pytest.approx(TRUE.predict(two), rel=1e-6)  # fitted on TRUE's times
    # what the catch-ups took over the model's price (49x a 2-draft step each), per resumed row:
    # the decision charges it to rows that resume (none for prompt lookup, which never catches up)
    resume = 49 * TRUE.predict(two) if method == "draft_model" else 0.0
    assert adaptive.stats()["step_cost"]["resume_s"] == pytest.approx(resume, rel=1e-6)
    if method == "draft_model":  # mutation: timed in, the catching-up steps move the fit off the model
        monkeypatch.setattr(AdaptiveDraftLengths, "is_fitted", lambda self, planned: True)
        got, adaptive = timings_with_catch_ups(method)
        assert got == [1] * 5 and adaptive.cost.at(1).predict(two) > 1.5 * TRUE.predict(two)
