"""The step-cost model (executor/step_cost.py): exact fits of synthetic timing tables, the
start-up probe's shapes determining every coefficient, the online fit tracking a change,
and bad input named with its rule. Plain Python: no model, no torch."""

from __future__ import annotations

import random

import pytest

from specray.executor.step_cost import FEATURES, OnlineStepCost, StepCost, StepShape, fit_step_cost, probe_shapes
from specray.executor.step_cost_by_batch import StepCostByBatch, batch_class, interpolate_slope, plain_line

# seconds per unit, chosen distinct so that a swapped coefficient shows
TRUE = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0025, c_prefill_token=0.0004,
                c_draft_row=0.001, c_draft_forward=0.002)


def _close(a: StepCost, b: StepCost, tol: float) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a.coefficients, b.coefficients))


def test_a_timing_table_fits_exactly_to_its_coefficients():
    # each row: (decode rows, verify rows, prefill tokens, draft rows, draft forwards) -> ms, by hand:
    # 10 + 3 d + 2.5 v + 0.4 p + 1 r + 2 f
    table = [((1, 0, 0, 0, 0), 13.0), ((8, 0, 0, 0, 0), 34.0), ((0, 0, 64, 0, 0), 35.6),
             ((1, 0, 0, 4, 4), 25.0), ((8, 0, 0, 32, 4), 74.0), ((8, 32, 0, 32, 4), 154.0),
             ((1, 4, 0, 4, 4), 35.0)]
    samples = [(StepShape(num_decode_rows=d, num_verify_rows=v, num_prefill_tokens=p, num_draft_rows=r,
                          num_draft_forwards=f), ms / 1e3) for (d, v, p, r, f), ms in table]
    fitted = fit_step_cost(samples)
    assert _close(fitted, TRUE, 1e-12), fitted
    assert fitted.predict(StepShape(num_decode_rows=4, num_verify_rows=8, num_draft_rows=8, num_draft_forwards=2)) \
        == pytest.approx((10 + 12 + 20 + 8 + 4) / 1e3)


@pytest.mark.parametrize("per_position", [True, False])
def test_the_probe_shapes_determine_every_coefficient(per_position):
    shapes = probe_shapes(max_num_seqs=8, ceiling=4, prefill_tokens=64, per_position=per_position)
    assert _close(fit_step_cost([(s, TRUE.predict(s)) for s in shapes]), TRUE, 1e-12)
    # mutation: drop any one shape and the table no longer determines the model
    for i in range(len(shapes)):
        rest = shapes[:i] + shapes[i + 1:]
        with pytest.raises(ValueError, match="do not determine"):
            fit_step_cost([(s, TRUE.predict(s)) for s in rest])


def test_a_fitted_negative_coefficient_counts_as_zero():
    # a table whose exact fit has c_prefill_token < 0 (prefill made the step faster)
    samples = [(StepShape(num_decode_rows=1), 0.005), (StepShape(num_decode_rows=2), 0.007),
               (StepShape(num_decode_rows=1, num_prefill_tokens=10), 0.004)]
    cost = fit_step_cost([(s, t) for s, t in samples], prior=StepCost(), prior_weight=1e-9)
    assert cost.c_prefill_token == 0.0
    assert cost.c_decode_row == pytest.approx(0.002, rel=1e-6)


def test_the_prior_holds_what_the_timings_do_not_show():
    prior = StepCost(c_step=0.01, c_decode_row=0.003, c_verify_row=0.003, c_draft_row=0.0, c_draft_forward=0.0)
    online = OnlineStepCost(prior, window=64, prior_weight=4.0)
    # only plain steps, 5 ms per decode row instead of 3: the verify coefficient keeps its prior
    for n in (1, 2, 4, 8) * 16:
        cost = online.record(StepShape(num_decode_rows=n), 0.01 + 0.005 * n)
    # 64 timings against a prior worth 4 steps: most of the way to the timings (ridge keeps a few %)
    assert 0.0045 < cost.c_decode_row < 0.005
    assert cost.c_verify_row == pytest.approx(0.003, rel=1e-9)
    assert online.stats()["num_step_timings"] == 64
    assert "decode_row" in online.describe()


def test_the_online_fit_tracks_a_change_within_its_window():
    rng = random.Random(7)
    online = OnlineStepCost(StepCost(c_step=0.01, c_decode_row=0.003, c_verify_row=0.003), window=100)
    slow = StepCost(c_step=0.02, c_decode_row=0.003, c_verify_row=0.006)

    def run(true: StepCost, steps: int) -> StepCost:
        for _ in range(steps):
            shape = StepShape(num_decode_rows=rng.randint(1, 8), num_verify_rows=rng.randint(0, 32))
            cost = online.record(shape, true.predict(shape) * (1 + rng.gauss(0, 0.02)))
        return cost

    first = run(TRUE, 300)
    assert first.c_verify_row == pytest.approx(0.0025, rel=0.1)
    second = run(slow, 300)  # the machine got slower (another job): the old steps left the window
    assert second.c_verify_row == pytest.approx(0.006, rel=0.1)
    assert second.c_step == pytest.approx(0.02, rel=0.2)


def test_a_refit_every_n_steps_is_the_every_step_fit_at_those_steps():
    rng = random.Random(2)
    every, sparse = OnlineStepCost(StepCost(), window=16), OnlineStepCost(StepCost(), window=16, refit_every=5)
    for i in range(1, 41):
        shape = StepShape(num_decode_rows=rng.randint(1, 8), num_verify_rows=rng.randint(0, 24))
        a, b = every.record(shape, TRUE.predict(shape)), sparse.record(shape, TRUE.predict(shape))
        if i % 5 == 0:
            assert b == a
        elif i > 5:
            assert b is previous  # held between refits
        previous = b


def test_the_planners_unchecked_seconds_are_predict_of_the_same_shape():
    # StepCost.seconds skips building a checked StepShape (the planner rates every length of every
    # step); it must price exactly as predict, the one- and two-row tables' lengths included
    one_row = StepCost(**{f"c_{n}": c for n, c in zip(FEATURES, TRUE.coefficients)},
                       one_row_verify=(0.0, 0.004, 0.0045, 0.009), two_row_verify=(0.0, 0.002, 0.0025))
    rng = random.Random(5)
    for cost in (TRUE, one_row):
        for _ in range(300):
            counts = (rng.choice([0, 1, 1, 2, 5]), rng.randint(0, 5), rng.choice([0, 0, 17]), rng.randint(0, 5),
                      rng.randint(0, 5))
            shape = StepShape(**dict(zip(("num_decode_rows", "num_verify_rows", "num_prefill_tokens",
                                          "num_draft_rows", "num_draft_forwards"), counts)))
            assert cost.seconds(*counts) == pytest.approx(cost.predict(shape), rel=1e-12, abs=1e-15)
    # a one-row step of 2 verified drafts: the plain one-row step plus the table's 4.5 ms; a two-row
    # step the plain two-row step plus the two-row table's 2.5 ms
    assert one_row.seconds(1, 2, 0, 2, 2) == pytest.approx(0.010 + 0.003 + 0.0045)
    assert one_row.seconds(2, 2, 0, 2, 1) == pytest.approx(0.010 + 0.006 + 0.0025)


def test_the_online_sums_equal_a_fit_of_the_window_from_scratch():
    # the running sums skip a step's zero features and subtract the steps leaving the window
    rng = random.Random(11)
    prior = StepCost(c_step=0.01, c_decode_row=0.002, c_verify_row=0.001)
    online, samples = OnlineStepCost(prior, window=20), []
    for _ in range(57):  # past two window rebuilds (every 20 records) and between them
        shape = StepShape(num_decode_rows=rng.randint(0, 4), num_verify_rows=rng.choice([0, 0, 3]),
                          num_prefill_tokens=rng.choice([0, 0, 0, 40]))
        samples.append((shape, TRUE.predict(shape) * (1 + rng.gauss(0, 0.05))))
        got = online.record(*samples[-1])
    want = fit_step_cost(samples[-20:], prior=prior, prior_weight=online.prior_weight)
    assert got.coefficients == pytest.approx(want.coefficients, rel=1e-9, abs=1e-12)


def test_stats_and_describe_name_every_coefficient():
    assert list(TRUE.as_dict()) == [f"c_{n}_s" for n in FEATURES]
    assert TRUE.describe().startswith("step cost (ms): step 10")


@pytest.mark.parametrize("make, match", [
    (lambda: StepShape(num_decode_rows=-1), r"num_decode_rows \(-1\) must be an integer >= 0"),
    (lambda: StepCost(c_verify_row=-0.1), r"c_verify_row \(-0.1\) must be a finite number >= 0"),
    (lambda: StepCost(c_step=float("nan")), r"c_step \(nan\) must be a finite"),
    (lambda: fit_step_cost([(StepShape(), -1.0)]), r"step time \(-1.0\) must be a finite number of seconds >= 0"),
    (lambda: fit_step_cost([], prior_weight=1.0), r"prior_weight \(1.0\) must be >= 0, and > 0 only with a prior"),
    (lambda: OnlineStepCost(StepCost(), prior_weight=0), r"prior_weight \(0\) > 0"),
    (lambda: OnlineStepCost(StepCost(), refit_every=0), r"refit_every \(0\) must be an integer >= 1"),
    (lambda: probe_shapes(max_num_seqs=1, ceiling=4, prefill_tokens=8, per_position=True),
     r"max_num_seqs \(1\) >= 2"),
])
def test_bad_input_names_the_value_and_the_rule(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_batch_classes_and_the_slope_between_measured_batches():
    assert [batch_class(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]
    slopes = {1: 0.001, 4: 0.004}
    assert [interpolate_slope(slopes, n) for n in (1, 2, 3, 4, 8, 16)] == pytest.approx(
        [0.001, 0.002, 0.003, 0.004, 0.004, 0.004])  # linear between, the nearest beyond
    assert interpolate_slope({4: 0.004}, 1) == 0.004
    # A slope measured as 0 stays 0, not a few ulps below it (CI met s0 + (0 - s0) * 3 / 3 < 0,
    # and StepCost refused the prior): at every s0, the ends are exact and nothing goes negative.
    for s0 in (0.00010235019577568971, 0.000199, 1e-3 / 3, 0.1):
        between = [interpolate_slope({1: s0, 4: 0.0}, n) for n in (1, 2, 3, 4, 8)]
        assert between[0] == s0 and between[3:] == [0.0, 0.0] and min(between) >= 0


def test_each_batch_class_fits_its_own_steps_from_its_own_prior():
    prior = StepCost(c_step=0.020, c_decode_row=0.0005, c_verify_row=0.003)
    costs = StepCostByBatch(prior, verify_slopes={1: 0.001, 4: 0.004}, window=64)
    assert [costs.at(n).c_verify_row for n in (1, 2, 4, 16)] == pytest.approx([0.001, 0.002, 0.004, 0.004])
    assert costs.at(3) == costs.at(4)  # one class: 3-4 rows, priced at 4
    # batch 1 runs verifies at 0.5 ms a draft: its class learns that, batch 4's keeps its prior
    for v in [0, 5, 0, 3, 1] * 20:
        costs.record(StepShape(num_decode_rows=1, num_verify_rows=v), 0.0205 + 0.0005 * v)
    assert 0.0005 <= costs.at(1).c_verify_row < 0.0006  # from 1 ms, but for the ridge's pull towards it
    assert costs.at(4).c_verify_row == pytest.approx(0.004)
    stats = costs.stats()
    assert stats["batch"] == 4 and stats["by_batch"][1]["num_step_timings"] == 100
    assert stats["by_batch"][4]["num_step_timings"] == 0


def test_a_plain_step_is_priced_by_the_line_through_the_batches_around_it():
    # SmolLM2 here: 21 ms at 1 row and 21.4 at 4 (memory-bound), 67 ms at 16 (compute-bound)
    timed = {1: 0.021, 4: 0.0214, 16: 0.067}
    step, row = plain_line(timed, 2)  # between 1 and 4: 0.13 ms a row
    assert (step, row) == pytest.approx((0.021 - 0.0004 / 3, 0.0004 / 3))
    for n in (8, 16, 32):  # from 4 up (and beyond 16) the line through 4 and 16: 3.8 ms a row
        assert plain_line(timed, n) == pytest.approx((0.0214 - 4 * 0.0038, 0.0038))
    assert plain_line(timed, 16)[0] + 16 * plain_line(timed, 16)[1] == pytest.approx(0.067)
    # a line through 0 ms above 0 rows (10 ms at 1 row, 50 at 2): no step cost, the time at 2 rows kept
    assert plain_line({1: 0.010, 2: 0.050}, 2) == pytest.approx((0.0, 0.025))
    assert plain_line({1: 0.030, 2: 0.020}, 2) == pytest.approx((0.020, 0.0))  # a faster batch: no negative row
    for bad in ({4: 0.02}, {1: 0.02, 4: -0.01}, {0: 0.02, 4: 0.03}):
        with pytest.raises(ValueError, match=r"two or more batch sizes \(decode rows >= 1\), each time finite and >= 0"):
            plain_line(bad, 4)
    with pytest.raises(ValueError, match=r"plain step times \{4: 0.02\}"):
        StepCostByBatch(TRUE, plain_seconds={4: 0.02})


def test_each_batch_class_takes_its_plain_line_from_the_probe():
    costs = StepCostByBatch(TRUE, plain_seconds={1: 0.021, 4: 0.0214, 16: 0.067})
    plain = [costs.at(n).predict(StepShape(num_decode_rows=n)) for n in (1, 4, 16)]
    assert plain == pytest.approx([0.021, 0.0214, 0.067])
    assert costs.at(8).predict(StepShape(num_decode_rows=8)) == pytest.approx(0.0214 + 4 * 0.0038)
    assert costs.at(16).c_verify_row == TRUE.c_verify_row  # the rest of the prior as given
    # without plain times, every class starts from the one prior
    assert StepCostByBatch(TRUE).at(16).predict(StepShape(num_decode_rows=16)) == pytest.approx(0.010 + 16 * 0.003)


def test_a_draft_that_pays_at_batch_1_is_declined_at_batch_4():
    # prompt lookup at acceptance 0.1 with the SmolLM2 probe's slopes: at batch 1 a verified draft
    # costs 0.9 ms against a 21 ms step (0.11 tokens a ms against 0.047), at batch 4 3.9 ms
    # against 5.4 ms a row (0.026 against 0.19)
    from specray.executor.draft_length import best_lengths

    one_fit = StepCost(c_step=0.021, c_decode_row=0.0001, c_verify_row=0.003)
    costs = StepCostByBatch(one_fit, verify_slopes={1: 0.0009, 4: 0.0039})
    assert best_lengths([[0.1] * 5], costs.at(1), "ngram", 5) == [1]
    assert best_lengths([[0.1] * 5] * 4, costs.at(4), "ngram", 5) == [0] * 4
    # mutation: one fit's mixture (3 ms a draft) declines the draft at batch 1 as well
    assert best_lengths([[0.1] * 5], one_fit, "ngram", 5) == [0]
