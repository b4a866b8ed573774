"""The start-up probe of adaptive speculation's step-cost model (executor/probe.py, issue 27):
its fit of a synthetic timing table against literals; on tiny models, that it runs at
start-up through the plan path, leaves every page and state slot free and nothing in the
prefix cache, keeps greedy output equal to plain decoding, and works at TP 2 under ``mp``
and on a hybrid target; the fixed prior only when the probe is off or cannot run."""

from __future__ import annotations

import logging
import math
import re

import pytest

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.adaptive import PRIOR_COST
from specray.executor.draft_length import decode_seconds
from specray.executor.probe import ProbeSize
from specray.executor.probe_fit import (PhaseTiming, fit_probe, one_row_seconds, phase_timing, plain_seconds,
                                       probe_samples, verify_slopes)
from specray.executor.step_cost import StepCost, StepShape, probe_shapes
from specray.executor.step_cost_by_batch import StepCostByBatch

# seconds per unit, distinct so that a swapped coefficient shows (as test_step_cost.py's)
TRUE = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0025, c_prefill_token=0.0004,
                c_draft_row=0.001, c_draft_forward=0.002)
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11, 12, 13], list(range(20, 40))]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _phases(cost: StepCost, forwards: int) -> dict[str, PhaseTiming]:
    """A timing table of the probe's phases (batches 4 and 16, k 3, prompt 32) that ``cost`` gives
    exactly; a verify's drafting time is the drafter's part of it."""
    def timed(shape: StepShape) -> PhaseTiming:
        drafting = cost.c_draft_row * shape.num_draft_rows + cost.c_draft_forward * shape.num_draft_forwards
        return PhaseTiming(shape, cost.predict(shape), drafting)

    return {"prefill": timed(StepShape(num_prefill_tokens=32)),
            "plain_one": timed(StepShape(num_decode_rows=1)), "plain_4": timed(StepShape(num_decode_rows=4)),
            "plain_16": timed(StepShape(num_decode_rows=16)),
            "verify_one": timed(StepShape(num_decode_rows=1, num_verify_rows=3, num_draft_rows=3,
                                          num_draft_forwards=forwards)),
            "verify_4": timed(StepShape(num_decode_rows=4, num_verify_rows=12, num_draft_rows=12,
                                        num_draft_forwards=forwards)),
            "verify_16": timed(StepShape(num_decode_rows=16, num_verify_rows=48, num_draft_rows=48,
                                         num_draft_forwards=forwards))}


@pytest.mark.parametrize("forwards", [3, 1])  # a drafter forward per position (draft_model), one per block
def test_the_probe_fit_recovers_the_coefficients_of_a_timing_table(forwards):
    fitted = fit_probe(_phases(TRUE, forwards))
    assert fitted.coefficients == pytest.approx(TRUE.coefficients, rel=1e-9), fitted  # exact (rounding aside)
    # the drafter alone: the plain step of its rows plus the verify's drafting (12 ms + 3 ms + 2 ms x forwards)
    samples = probe_samples(_phases(TRUE, forwards))
    assert samples[3] == (StepShape(num_decode_rows=1, num_draft_rows=3, num_draft_forwards=forwards),
                          pytest.approx(0.013 + 0.003 + 0.002 * forwards))
    # the samples are step_cost.probe_shapes' six at the largest batch, then the verify of one
    # sequence, then batch 4's plain step, drafter alone and verify
    shapes = probe_shapes(max_num_seqs=16, ceiling=3, prefill_tokens=32, per_position=forwards == 3)
    four = [StepShape(num_decode_rows=4), StepShape(num_decode_rows=4, num_draft_rows=12, num_draft_forwards=forwards),
            _phases(TRUE, forwards)["verify_4"].shape]
    assert [shape for shape, _ in samples] == shapes + [_phases(TRUE, forwards)["verify_one"].shape] + four


def test_the_probe_prices_a_verified_draft_at_each_of_its_batch_sizes():
    # a linear table: the same slope at every batch (its verify rows at 2.5 ms, drafting apart)
    assert verify_slopes(_phases(TRUE, 3)) == pytest.approx({1: 0.0025, 4: 0.0025, 16: 0.0025})
    assert plain_seconds(_phases(TRUE, 3)) == pytest.approx({1: 0.013, 4: 0.022, 16: 0.058})  # 10 ms + 3 ms a row
    # SmolLM2 here (ngram, k = 5): 21.2 ms plain and 25.7 ms with 5 drafts at batch 1 (memory-bound),
    # 21.4 ms and 100.3 ms with 4 x 5 at batch 4 (compute-bound); 0.06 ms of lookup each
    phases = {"plain_one": PhaseTiming(StepShape(num_decode_rows=1), 0.0212, 0.0),
              "verify_one": PhaseTiming(StepShape(num_decode_rows=1, num_verify_rows=5), 0.0257, 0.00006),
              "plain_4": PhaseTiming(StepShape(num_decode_rows=4), 0.0214, 0.0),
              "verify_4": PhaseTiming(StepShape(num_decode_rows=4, num_verify_rows=20), 0.1003, 0.00006)}
    assert verify_slopes(phases) == pytest.approx({1: 0.000888, 4: 0.003942})  # (25.7 - 21.2 - 0.06) / 5, .../ 20
    # a lookup that found nothing to verify gives no slope at that batch
    phases["verify_one"] = PhaseTiming(StepShape(num_decode_rows=1), 0.0213, 0.00006)
    assert set(verify_slopes(phases)) == {4}


def _compute_bound(rows: int) -> float:
    """A target step's seconds by its rows (decode and verified drafts alike): 21 ms up to 4
    (memory-bound), then 4 ms a row up to 24 and 5 ms beyond (a batch's KV outgrows the cache)."""
    return 0.021 if rows <= 4 else 0.021 + 0.004 * (rows - 4) if rows <= 24 else 0.101 + 0.005 * (rows - 24)


def _timed_phase(num_seqs: int, drafts: int) -> PhaseTiming:
    """A phase of ``num_seqs`` rows each verifying ``drafts`` (a block drafter: 1 ms a draft row
    and 4 ms a forward) on the target above."""
    rows = num_seqs * drafts
    drafting = 0.001 * rows + (0.004 if rows else 0.0)
    shape = StepShape(num_decode_rows=num_seqs, num_verify_rows=rows, num_draft_rows=rows,
                      num_draft_forwards=1 if rows else 0)
    return PhaseTiming(shape, _compute_bound(num_seqs + rows) + drafting, drafting)


def test_a_batch_whose_steps_all_draft_one_length_keeps_its_plain_price():
    """Sixteen requests drafting 5 every step vary decode and verify rows together: the class's
    steps fix their sum, and the prior splits it. With the probe timing batch 16 the prior is
    right there and the fit keeps a plain step's price; with batches 1 and 4 only (before 12-07),
    a plain step of 16 was priced from memory-bound rows and the window's error spread over
    every feature (the grid's batch-16 fit: 108 ms for a plain step the runs put at ~67)."""
    phases = {"prefill": PhaseTiming(StepShape(num_prefill_tokens=32), _compute_bound(32), 0.0),
              "plain_one": _timed_phase(1, 0), "verify_one": _timed_phase(1, 5)}
    for size in (4, 16):
        phases[f"plain_{size}"], phases[f"verify_{size}"] = _timed_phase(size, 0), _timed_phase(size, 5)
    busy = _timed_phase(16, 5)
    plain, one_each = _compute_bound(16), _compute_bound(32) + 0.016 + 0.004  # 69 and 161 ms

    def priced(phases: dict[str, PhaseTiming], **kw) -> tuple[float, float]:
        costs = StepCostByBatch(fit_probe(phases), verify_slopes=verify_slopes(phases), **kw)
        for _ in range(256):  # a full window of steps at length 5
            costs.record(busy.shape, busy.seconds)
        cost = costs.at(16)
        return cost.predict(StepShape(num_decode_rows=16)), decode_seconds(cost, [1] * 16, "dflash")

    # 5%: the class prior's plain line and verify slope are the truth's at 16, but its drafter
    # terms come from the probe's one fit over every batch (a line through a piecewise truth),
    # and the window's small error reaches the plain price through the ridge (95.5% of it here)
    assert priced(phases, plain_seconds=plain_seconds(phases)) == pytest.approx((plain, one_each), rel=0.05)
    # mutation: the probe stops at batch 4 (the plain line from batches 1 and 4)
    upto4 = {name: phase for name, phase in phases.items() if not name.endswith("_16")}
    wrong_plain, _ = priced(upto4, plain_seconds=plain_seconds(upto4))
    assert abs(wrong_plain / plain - 1) > 0.2, wrong_plain


def test_the_probe_seeds_the_one_row_table_with_each_lengths_step_time():
    one = StepShape(num_decode_rows=1)
    phases = {"plain_one": PhaseTiming(one, 0.0105, 0.0),
              "verify_one_1": PhaseTiming(StepShape(num_decode_rows=1, num_verify_rows=1), 0.0112, 0.0001),
              "verify_one_2": PhaseTiming(one, 0.0107, 0.0001),  # the lookup found nothing: a plain step
              "verify_one": PhaseTiming(StepShape(num_decode_rows=1, num_verify_rows=3), 0.0130, 0.0004)}
    # each with its drafting (the table prices both); the phase whose lookup proposed nothing is left out
    assert one_row_seconds(phases) == pytest.approx({0: 0.0105, 1: 0.0112, 3: 0.0130})


def test_a_feature_no_probe_step_varies_keeps_the_fixed_prior():
    ngram = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0025, c_prefill_token=0.0004,
                     c_draft_row=0.0001)
    fitted = fit_probe(_phases(ngram, 0))  # prompt lookup runs no drafter forward
    assert fitted.c_draft_forward == pytest.approx(PRIOR_COST.c_draft_forward)
    # the rest as timed, but for the pull towards the prior (1e-6 steps)
    assert fitted.coefficients[:5] == pytest.approx(ngram.coefficients[:5], rel=1e-4), fitted


@pytest.mark.parametrize("sizes", [(), (1, 4), (16, 4), (4, 4)])
def test_probe_batch_sizes_must_increase_from_2(sizes):
    with pytest.raises(ValueError, match=r"batch_sizes .* must be one or more increasing batch sizes >= 2"):
        ProbeSize(batch_sizes=sizes, prompt_tokens=32, period=8)


def test_a_phase_is_the_median_of_its_most_common_shape():
    full, short = StepShape(num_decode_rows=1, num_verify_rows=3), StepShape(num_decode_rows=1, num_verify_rows=2)
    steps = [(full, 0.010, 0.001), (short, 0.001, 0.0), (full, 0.050, 0.002), (full, 0.012, 0.004)]
    # the step that drafted less is not a sample of the phase; a stall (50 ms) moves the median only to 12 ms
    assert phase_timing(steps) == PhaseTiming(full, 0.012, 0.002)


def _config(method, model="tiny-llama", **kw) -> EngineConfig:
    draft = {"draft_model": model} if method == "draft_model" else {}
    spec = SpecConfig(method=method, num_draft_tokens=3, adaptive=True, **draft, **kw.pop("spec", {}))
    return EngineConfig(model=model, spec=spec, **kw)


def _plain(model="tiny-llama", **kw) -> list[list[int]]:
    with LLM(EngineConfig(model=model, **kw)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """Plain decoding's tokens; its first forward also builds the CPU kernels (once a session,
    models/cpu_kernels.py), which a probe run first would otherwise time."""
    return _plain()


def _check_clean(core) -> None:
    """Every page and state slot free, and nothing published in the prefix cache."""
    for allocator in (core.allocator, core.draft_allocator):
        if allocator is not None:
            assert allocator.num_free == allocator.num_blocks
            assert getattr(allocator, "num_published", 0) == 0
    if core.state_allocator is not None:
        assert core.state_allocator.num_free == core.state_allocator.num_slots


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_probe_runs_at_start_up_and_leaves_nothing_behind(method, plain, caplog):
    caplog.set_level(logging.INFO, logger="specray.executor.adaptive")
    with LLM(_config(method)) as llm:
        core = llm._engine.core
        prior = core.adaptive.cost.prior
        assert core.adaptive.prior_source == "probed" and prior != PRIOR_COST
        assert all(math.isfinite(c) and c >= 0 for c in prior.coefficients)
        # the target was timed (a coefficient may fit 0 on a busy 2-core host: only the sum is sure)
        assert prior.predict(StepShape(num_decode_rows=4, num_verify_rows=12, num_draft_rows=12)) > 0
        assert core.worker.num_steps >= 20  # the probe's steps ran on the rank, through plans
        _check_clean(core)
        probe_prompt = [1 + i % 8 for i in range(32)]  # the probe's own dummy tokens: no hit on them
        outs = llm.generate(PROMPTS + [probe_prompt], PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs[:3]] == plain
    assert set(stats.kv_usage.values()) == {0.0}
    assert sum(stats.prefix_cache_hits.values()) == 0
    step_cost = stats.adaptive["step_cost"]
    assert step_cost["prior"] == "probed" and step_cost["prior_cost"] == prior.as_dict()
    [line] = [r.getMessage() for r in caplog.records if "adaptive speculation" in r.getMessage()]
    ms = float(re.search(r"probed in (\d+) ms", line).group(1))
    # bounded: 100-200 ms on this host when idle; the bound leaves room for a loaded shared CPU
    assert "step cost (ms)" in line and ms < 10_000, line


@pytest.mark.parametrize("kw, batches", [
    (dict(), {1, 4, 16}),  # up to MAX_PROBE_BATCH
    (dict(max_num_seqs=8), {1, 4, 8}),
    (dict(max_num_seqs=3), {1, 3}),
    # 16 sequences of the probe's longest need 240 pages of 16 tokens: halved to 8 (104 pages)
    (dict(kv=KVConfig(tokens_per_block=16, capacity_tokens=2048)), {1, 4, 8}),
])
def test_the_probe_times_the_largest_batch_the_engine_allows(kw, batches, plain):
    with LLM(_config("ngram", **kw)) as llm:
        adaptive = llm._engine.core.adaptive
        assert set(adaptive.cost.plain_seconds) == batches
        assert set(adaptive.cost.verify_slopes) <= batches
        _check_clean(llm._engine.core)


def test_the_probe_at_tp_2_under_mp(plain):
    cfg = _config("ngram", parallel=ParallelConfig(tp_size=2, launcher="mp", check_every_step=True, timeout_s=60))
    with LLM(cfg) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == plain
    assert stats.adaptive["step_cost"]["prior"] == "probed"
    assert set(stats.kv_usage.values()) == {0.0}


def test_the_probe_on_a_hybrid_target_gives_its_state_slots_back():
    reference = _plain("tiny-qwen3-next")
    with LLM(_config("ngram", model="tiny-qwen3-next")) as llm:
        core = llm._engine.core
        assert core.adaptive.prior_source == "probed" and core.state_allocator is not None
        _check_clean(core)
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("kw", [dict(spec=dict(adaptive_probe=False)), dict(max_num_seqs=1)])
def test_the_fixed_prior_only_when_the_probe_is_off_or_cannot_run(kw, plain, caplog):
    caplog.set_level(logging.INFO, logger="specray.executor.adaptive")
    with LLM(_config("ngram", **kw)) as llm:
        core = llm._engine.core
        assert core.adaptive.prior_source == "fixed" and core.adaptive.cost.prior == PRIOR_COST
        assert core.worker.num_steps == 0
    reason = "adaptive_probe=False" if "spec" in kw else "needs 2"
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_adaptive_probe_must_be_a_bool():
    with pytest.raises(ValueError, match=r"adaptive_probe \('yes'\) must be True or False"):
        SpecConfig(method="ngram", adaptive=True, adaptive_probe="yes")
