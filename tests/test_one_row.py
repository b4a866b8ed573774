"""A one-row step's drafting and verify priced per length (executor/one_row.py): the table from
timings with literals, the model predicting from it (the drafter's line replaced as well), the
batch-class fit carrying it, and the decisions it changes: the grid's measured table chooses 3
drafts for prompt lookup at batch 1 where the line through the same timings chooses 5, and an
EAGLE-3 whose drafting the line underprices stays at 0 (each with its mutation); two-row steps'
table, by the drafts both verify, and the pair it drafts where the line declines. Plain Python:
no model, no torch."""

from __future__ import annotations

import pytest

from specray.errors import ConfigError
from specray.executor.adaptive import AdaptiveDraftLengths
from specray.executor.draft_length import best_lengths, decode_seconds, per_draft_seconds
from specray.executor.one_row import OneRowVerify
from specray.executor.step_cost import StepCost, StepShape
from specray.executor.step_cost_by_batch import StepCostByBatch

MS = 1e-3


def one_row(verify: int, prefill: int = 0) -> StepShape:
    return StepShape(num_decode_rows=1, num_verify_rows=verify, num_prefill_tokens=prefill)


def test_the_table_is_each_length_over_the_plain_step_between_and_past_the_lengths_seen():
    rows = OneRowVerify(5, seeds={0: 10 * MS, 1: 10.6 * MS, 3: 12.8 * MS})
    # 2: halfway between 1 and 3; 4 and 5: the last seen plus c_verify_row (2 ms) per draft
    assert rows.table(2 * MS) == pytest.approx((0.0, 0.6 * MS, 1.7 * MS, 2.8 * MS, 4.8 * MS, 6.8 * MS))
    for seconds in (11.0, 11.0, 30.0):  # a median over the window: the one stall does not move it
        rows.record(1, seconds * MS)
    assert rows.table(2 * MS)[1] == pytest.approx(1.0 * MS)  # median of 10.6, 11, 11, 30


def test_a_length_timed_faster_than_a_shorter_one_costs_as_much_as_it():
    rows = OneRowVerify(3, seeds={0: 10 * MS, 1: 11 * MS, 2: 10.5 * MS, 3: 13 * MS})
    assert rows.table(1 * MS) == pytest.approx((0.0, 1 * MS, 1 * MS, 3 * MS))
    assert OneRowVerify(3, seeds={1: 11 * MS}).table(1 * MS) == ()  # no plain step timed yet


def test_a_length_not_run_for_max_age_steps_forgets_its_times_and_takes_the_line():
    rows = OneRowVerify(3, seeds={0: 10 * MS, 2: 11 * MS, 3: 30 * MS}, max_age=4)
    assert rows.table(1 * MS) == pytest.approx((0.0, 0.5 * MS, 1 * MS, 20 * MS))
    for _ in range(2):  # the planner now runs 2 drafts and plain steps only
        rows.record(0, 10 * MS)
        rows.record(2, 11 * MS)
    # 3's time (from before) is forgotten: past the lengths seen, 1 ms a draft (the line)
    assert rows.table(1 * MS) == pytest.approx((0.0, 0.5 * MS, 1 * MS, 2 * MS))
    assert rows.stats() == {"num_timed": [2, 0, 2, 0]}


def test_past_the_lengths_seen_a_draft_costs_at_least_the_dearest_one_seen_from_1_up():
    # 1 and 2 drafts ride along (0.5 ms each), a third costs 3 ms: 4 and 5 are priced at 3 ms a
    # draft, not at the line's 1 ms; the first draft's price (the verify path's fixed cost) is no bound
    rows = OneRowVerify(5, seeds={0: 10 * MS, 1: 10.5 * MS, 2: 11 * MS, 3: 14 * MS})
    table = rows.table(1 * MS)
    assert table == pytest.approx(tuple(x * MS for x in (0.0, 0.5, 1.0, 4.0, 7.0, 10.0)))
    assert OneRowVerify(3, seeds={0: 10 * MS, 1: 16 * MS}).table(1 * MS) == pytest.approx((0.0, 6 * MS, 7 * MS, 8 * MS))
    # at 0.9 a position, 2 drafts (2.71 tokens for 11 ms) beat 5 on the table; on the line's
    # price past 3, 5 drafts (4.69 tokens for 16 ms) would win: the mutation
    probs = [[0.9] * 5]
    assert best_lengths(probs, StepCost(c_step=10 * MS, c_verify_row=1 * MS, one_row_verify=table), "ngram", 5) == [2]
    line_past = tuple(x * MS for x in (0.0, 0.5, 1.0, 4.0, 5.0, 6.0))
    assert best_lengths(probs, StepCost(c_step=10 * MS, c_verify_row=1 * MS, one_row_verify=line_past),
                        "ngram", 5) == [5]


def test_the_model_prices_a_one_row_step_from_its_table_and_every_other_step_by_the_line():
    cost = StepCost(c_step=10 * MS, c_decode_row=1 * MS, c_verify_row=2 * MS, one_row_verify=(0.0, 0.6 * MS, 5 * MS))
    assert cost.predict(one_row(2)) == pytest.approx(16 * MS)  # 10 + 1 + the table's 5
    assert cost.predict(one_row(1)) == pytest.approx(11.6 * MS)
    assert cost.predict(one_row(3)) == pytest.approx(17 * MS)  # past the table: 2 ms a draft
    assert cost.predict(StepShape(num_decode_rows=2, num_verify_rows=2)) == pytest.approx(16 * MS)
    assert cost.predict(one_row(2, prefill=4)) == pytest.approx(15 * MS)  # a prefill chunk: the line (c 0)


@pytest.mark.parametrize("table", [(0.001,), (0.0, -1.0), (0.0, float("nan"))])
def test_a_bad_table_names_the_value_and_the_rule(table):
    with pytest.raises(ConfigError, match="one_row_verify .* start at 0"):
        StepCost(one_row_verify=table)


def test_the_batch_fit_gives_one_row_steps_the_table_of_their_time():
    by_batch = StepCostByBatch(StepCost(c_step=10 * MS, c_verify_row=1 * MS), one_row=OneRowVerify(2))
    assert by_batch.at(1).one_row_verify == ()
    by_batch.record(one_row(0), 10 * MS)
    by_batch.record(one_row(2), 14 * MS)
    by_batch.record(StepShape(num_decode_rows=2, num_verify_rows=2), 99 * MS)  # not a one-row step
    by_batch.record(one_row(1, prefill=8), 99 * MS)  # nor is a step with a prefill chunk
    assert by_batch.at(1).one_row_verify == pytest.approx((0.0, 2 * MS, 4 * MS))
    assert by_batch.at(2).one_row_verify == ()
    assert by_batch.stats()["one_row_verify_s"] == pytest.approx([0.0, 2 * MS, 4 * MS])
    assert by_batch.stats()["one_row_timed"] == [1, 0, 1]


def test_the_measured_table_chooses_what_the_line_through_it_misses():
    # measured in the engine (SmolLM2, batch 1, prompt lookup on HumanEval chats): a plain step
    # 10.53 ms, verifying 1..5 drafts 11.07, 11.12, 12.24, 14.60, 17.45 ms; prompt lookup's
    # acceptance per position there 0.396, 0.787, 0.91, 0.858, 0.95. Goodput by hand, tokens/ms:
    # 1.396 / 11.07 = .126, 1.708 / 11.12 = .154, 1.991 / 12.24 = .163, 2.235 / 14.60 = .153,
    # 2.466 / 17.45 = .141: 3 drafts. The line through 0 and 5 drafts (1.384 ms a draft) gives
    # 3 drafts .136 and 5 drafts .141: it chooses 5, which ran 3-6% slower than 3 in the grid.
    table = tuple(x * MS for x in (0.0, 0.54, 0.59, 1.71, 4.07, 6.92))
    line = StepCost(c_step=10.53 * MS, c_verify_row=6.92 / 5 * MS)
    probs = [0.396, 0.787, 0.91, 0.858, 0.95]
    assert best_lengths([probs], StepCost(c_step=10.53 * MS, c_verify_row=6.92 / 5 * MS, one_row_verify=table),
                        "ngram", 5) == [3]
    assert best_lengths([probs], line, "ngram", 5) == [5]  # the mutation: the line alone


def drafted(verify: int, forwards: int) -> StepShape:
    """A one-row step whose drafter ran one row a draft and ``forwards`` forwards."""
    return StepShape(num_decode_rows=1, num_verify_rows=verify, num_draft_rows=verify, num_draft_forwards=forwards)


def test_the_table_prices_the_drafting_too_and_the_line_past_it():
    cost = StepCost(c_step=10 * MS, c_decode_row=1 * MS, c_verify_row=2 * MS, c_draft_row=0.2 * MS,
                    c_draft_forward=0.6 * MS, one_row_verify=(0.0, 6 * MS, 9 * MS))
    assert cost.predict(drafted(1, 1)) == pytest.approx(17 * MS)  # 10 + 1 + the table's 6: no drafter line on top
    assert cost.predict(drafted(2, 1)) == pytest.approx(20 * MS)
    assert cost.predict(drafted(3, 3)) == pytest.approx((11 + 3 * 2.8) * MS)  # past the table: the line
    # a draft's price on the line, past the first: verify row, drafter row, and a forward where a
    # drafter runs one a token
    assert per_draft_seconds(cost, "eagle3") == pytest.approx(2.8 * MS)
    assert per_draft_seconds(cost, "dflash") == pytest.approx(2.2 * MS)
    assert per_draft_seconds(cost, "ngram") == pytest.approx(2 * MS)
    by_batch = StepCostByBatch(cost, one_row=OneRowVerify(3, seeds={0: 11 * MS, 1: 17 * MS}),
                               per_draft=lambda c: per_draft_seconds(c, "eagle3"))
    assert by_batch.at(1).one_row_verify == pytest.approx((0.0, 6 * MS, 8.8 * MS, 11.6 * MS))


def test_an_eagle3_whose_drafting_the_line_underprices_stays_at_0():
    """The 12-07 13:32 grid at concurrency 1: a plain step of 12.9 ms, the drafter at the probe's
    0.2 ms a row and 0.6 ms a forward, 2.8 ms a verified draft on the line; a steady k = 1 step
    took ~1.5x a plain one (19.4 ms). At the population's p_0 (0.27) and a request's own 0.4, the
    table's 6.5 ms declines the draft (1.4 / 19.4 < 1 / 12.9); the line's 3.6 ms takes it."""
    line = StepCost(c_step=12.9 * MS, c_verify_row=2.8 * MS, c_draft_row=0.2 * MS, c_draft_forward=0.6 * MS)
    by_batch = StepCostByBatch(line, one_row=OneRowVerify(5), per_draft=lambda c: per_draft_seconds(c, "eagle3"))
    for _ in range(8):
        by_batch.record(StepShape(num_decode_rows=1), 12.9 * MS)
        by_batch.record(drafted(1, 1), 19.4 * MS)
    cost = by_batch.at(1)
    assert cost.one_row_verify[1] == pytest.approx(6.5 * MS)
    # the plain part is the class fit's (a ridge over both kinds of step: ~13.2 ms), the rest the table's
    assert decode_seconds(cost, [1], "eagle3") == pytest.approx(19.4 * MS, rel=0.03)
    for p0 in (0.27, 0.4):
        assert best_lengths([[p0] * 5], cost, "eagle3", 5) == [0]
        # mutation: the table as it was before 12-07 14:40, the target's part only (19.4 - 12.9 -
        # 4 ms of drafting = 2.5 ms), with the drafter's line on top (0.8 ms): both take the draft
        old = StepCost(c_step=12.9 * MS, c_verify_row=2.8 * MS, c_draft_row=0.2 * MS, c_draft_forward=0.6 * MS,
                       one_row_verify=(0.0, 3.3 * MS, 6.1 * MS, 8.9 * MS, 11.7 * MS, 14.5 * MS))
        assert decode_seconds(old, [1], "eagle3") == pytest.approx(16.2 * MS)
        assert best_lengths([[p0] * 5], old, "eagle3", 5) == [1]


def two_rows(verify: int, prefill: int = 0) -> StepShape:
    return StepShape(num_decode_rows=2, num_verify_rows=verify, num_prefill_tokens=prefill)


def test_two_row_steps_keep_a_table_by_the_drafts_both_verify():
    by_batch = StepCostByBatch(StepCost(c_step=7 * MS, c_decode_row=1 * MS, c_verify_row=2 * MS),
                               two_rows=OneRowVerify(4))
    assert by_batch.at(2).two_row_verify == ()
    by_batch.record(two_rows(0), 9 * MS)
    by_batch.record(two_rows(2), 12 * MS)
    by_batch.record(one_row(1), 99 * MS)  # not a two-row step
    by_batch.record(two_rows(1, prefill=8), 99 * MS)  # nor is one with a prefill chunk
    cost = by_batch.at(2)
    # 1: halfway to 2's 3 ms; past 2 a draft's price on the class's line, fitted now (no two lengths
    # from 1 up were timed to bound it)
    slope = cost.c_verify_row
    assert cost.two_row_verify == pytest.approx((0.0, 1.5 * MS, 3 * MS, 3 * MS + slope, 3 * MS + 2 * slope))
    assert cost.predict(two_rows(2)) - cost.predict(two_rows(0)) == pytest.approx(3 * MS)
    assert by_batch.at(1).two_row_verify == () and by_batch.at(3).two_row_verify == ()
    assert by_batch.stats()["two_row_timed"] == [1, 0, 1, 0, 0]


def test_at_two_rows_the_measured_table_drafts_where_the_line_through_it_declines():
    """Measured 12-07 in the engine (prompt lookup, two HumanEval chats at a time): two decode rows
    took 9.27 ms plain and 10.45, 12.40, 16.26, 18.88 ms verifying 1..4 drafts together; the batch-2
    line priced a verified draft at ~2 ms, and the engine ran plain at 83% of its rows where static
    k = 1 ran 4-10% faster than plain. By hand at p = (0.42, 0.7) each row, tokens per ms: plain
    2 / 9.27 = .216; one row drafting one 2.42 / 10.45 = .232; both 2.84 / 12.40 = .229; one row
    drafting two 2.71 / 12.40 = .219. On the line (2 ms a draft) one draft is 2.42 / 11.27 = .215:
    plain."""
    table = tuple(x * MS for x in (0.0, 1.18, 3.13, 6.99, 9.61))
    probs = [[0.42, 0.7], [0.42, 0.7]]
    measured = StepCost(c_step=7.27 * MS, c_decode_row=1 * MS, c_verify_row=2 * MS, two_row_verify=table)
    assert best_lengths(probs, measured, "ngram", 2) == [0, 1]  # a tie between the rows: the second drafts
    assert best_lengths(probs, StepCost(c_step=7.27 * MS, c_decode_row=1 * MS, c_verify_row=2 * MS),
                        "ngram", 2) == [0, 0]  # the mutation: the line alone
    # a row resuming a model drafter pays its catch-up where it drafts: the other row drafts
    assert best_lengths(probs, measured, "dflash", 2, resume=[0.0, 5 * MS]) == [1, 0]


@pytest.mark.parametrize("method, has_table", [("ngram", True), ("dflash", True), ("eagle3", False)])
def test_two_rows_keep_a_table_where_the_drafting_does_not_follow_the_longest_row(method, has_table):
    # by the drafts both rows verify, 2 + 2 and 4 + 0 are one entry: right where the drafter runs
    # one forward whatever the lengths, not for one that runs a forward per position of the longest
    assert (AdaptiveDraftLengths(method, 3).cost.two_rows is not None) == has_table
