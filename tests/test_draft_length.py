"""Per-request draft lengths (executor/draft_length.py): the expected-token rule with literals,
the evidence counts and the population estimate with literals, the exact search against brute
force, a replay of recorded histories and step times whose length is computed by hand, a new
request starting from what earlier ones showed (and deeper positions from shallower ones),
prefill rows outside the decision, stability under a steady noisy load (and a mutation: without
the margin it flaps), the extremes, probes, bad input."""

from __future__ import annotations

import itertools
import random

import pytest

from specray.executor.draft_controller import DraftLengthController, DraftLengthPolicy, Evidence, RequestAcceptance
from specray.executor.draft_length import (best_lengths, cost_per_draft, decode_seconds, draft_forwards, expected_tokens,
                                           goodput)
from specray.executor.step_cost import OnlineStepCost, StepCost, StepShape, fit_step_cost

CPU = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.003)  # about the 34 ms / 8 rows


def test_expected_tokens_is_one_plus_the_surviving_prefixes():
    p = [0.8, 0.5, 0.25]
    assert expected_tokens(p, 0) == 1.0
    assert expected_tokens(p, 1) == pytest.approx(1.8)
    assert expected_tokens(p, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_the_evidence_counts_accepted_drafts_and_the_first_rejection_only():
    ev = Evidence.empty(3, decay=0.5)
    ev.record(proposed=3, accepted=1)  # draft 0 held, draft 1 rejected, draft 2 unseen
    assert (ev.hits, ev.trials) == ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    assert ev.estimate([0.5] * 3, weight=1.0) == [0.75, 0.25, 0.5]  # (1 x 0.5 + hits) / (1 + trials)
    ev.record(proposed=0, accepted=0)  # drafted nothing: nothing seen
    assert (ev.hits, ev.trials) == ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    ev.record(proposed=1, accepted=0)  # position 0 seen again: its old counts weigh half
    assert (ev.hits[0], ev.trials[0]) == (0.5, 1.5)
    assert ev.estimate([0.5] * 3, weight=1.0)[0] == pytest.approx(1.0 / 2.5)


def test_the_population_expects_an_unreached_position_to_do_as_the_one_before():
    ev = Evidence.empty(3, decay=0.0)
    assert ev.population_estimate(0.5) == [0.5, 0.5, 0.5]  # nothing seen: the prior everywhere
    ev.record(proposed=3, accepted=1)
    # p0 = (0.5 + 1) / 2, p1 = (p0 + 0) / 2, p2 = (p1 + 0) / (1 + 0): unseen, as p1
    assert ev.population_estimate(0.5) == [0.75, 0.375, 0.375]
    ev = Evidence.empty(5, decay=0.0)
    ev.record(proposed=1, accepted=1)  # one probe accepted: every deeper position expects as much
    assert ev.population_estimate(0.5) == [0.75] * 5


@pytest.mark.parametrize("method", ["draft_model", "dflash", "ngram"])
def test_the_search_is_exact_against_brute_force(method):
    rng = random.Random(3)
    for _ in range(40):
        ceiling, rows = rng.randint(0, 3), rng.randint(1, 4)
        probs = [[rng.random() for _ in range(ceiling)] for _ in range(rows)]
        cost = StepCost(c_step=rng.uniform(0, 0.02), c_decode_row=rng.uniform(0, 0.005),
                        c_verify_row=rng.uniform(0, 0.005), c_draft_row=rng.uniform(0, 0.002),
                        c_draft_forward=rng.uniform(0, 0.01))
        best = max(goodput(probs, list(k), cost, method)
                   for k in itertools.product(range(ceiling + 1), repeat=rows))
        chosen = best_lengths(probs, cost, method, ceiling)
        assert goodput(probs, chosen, cost, method) == pytest.approx(best, rel=1e-12)


def test_a_replay_of_histories_and_step_times_gives_the_length_the_rule_says():
    # recorded step times (decode rows, verify rows) -> ms: exactly 10 + 3 d + 3 v
    times = [((1, 0), 13.0), ((2, 0), 16.0), ((2, 6), 34.0), ((1, 3), 22.0)]
    samples = [(StepShape(num_decode_rows=d, num_verify_rows=v), ms / 1e3) for (d, v), ms in times]
    # ngram drafts without a model: the drafter's features never varied, a vanishing prior keeps them 0
    cost = fit_step_cost(samples, prior=StepCost(), prior_weight=1e-9)
    assert (cost.c_step, cost.c_decode_row, cost.c_verify_row) == pytest.approx((0.010, 0.003, 0.003), rel=1e-6)
    # population_memory huge: the engine-wide counts do not decay within this replay
    # no warm-up (warmup_verifies=0): the rule alone decides after these few verifies
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, ema_weight=0.5, prior_acceptance=0.5,
                                                  population_weight=1.0, population_memory=10**12,
                                                  warmup_verifies=0), "ngram")
    for proposed, accepted in [(3, 3), (3, 3), (3, 1)]:
        ctl.record(0, proposed, accepted)  # A's own (decay 0.5): hits [1.75, .75, 1.5] over trials [1.75, 1.75, 1.5]
    for proposed, accepted in [(3, 0), (3, 0)]:
        ctl.record(1, proposed, accepted)  # B's own: position 0 hits 0 over 1.5 trials, the rest unseen
    # the population: hits [3, 2, 2] over trials [5, 3, 2]; p0 = 3.5/6, p1 = (p0 + 2)/4, p2 = (p1 + 2)/3
    pop = [3.5 / 6]
    pop += [(pop[0] + 2) / 4]
    pop += [(pop[1] + 2) / 3]
    assert ctl.population_estimate() == pytest.approx(pop, rel=1e-12)
    a = [(pop[0] + 1.75) / 2.75, (pop[1] + 0.75) / 2.75, (pop[2] + 1.5) / 2.5]  # one population trial each
    b = [pop[0] / 2.5, pop[1], pop[2]]  # B never reached positions 1 and 2: the population's
    assert ctl.estimates(0) == pytest.approx(a, rel=1e-12) and ctl.estimates(1) == pytest.approx(b, rel=1e-12)
    # a = [.8485, .5076, .9528], b = [.2333, .6458, .8819]: E_A(k) = 1, 1.8485, 2.2792, 2.6895;
    # E_B(k) = 1, 1.2333, 1.3840, 1.5169; T = 16 + 3 (kA + kB) ms. Tokens per ms: (0,0) 2/16 = .1250,
    # (1,0) 2.8485/19 = .1499, (2,0) 3.2792/22 = .1491, (3,0) .1476, (1,1) 3.0818/22 = .1401:
    # B's first draft adds .23 tokens for 3 ms, A's second .43 for 3 ms, both below .1499
    assert ctl.decide([0, 1], cost) == [1, 0]
    assert goodput([a, b], [1, 0], cost, "ngram") == pytest.approx((1 + a[0] + 1) / 0.019)


def test_a_new_request_starts_from_what_earlier_requests_showed():
    # a drafter whose draft costs ~0.4 plain steps (dflash on SmolLM2 here): at the prior 0.3 it does
    # not pay, at acceptance 1 the ceiling does
    cost = StepCost(c_step=0.005, c_decode_row=0.012, c_verify_row=0.0035, c_draft_row=0.004)
    policy = DraftLengthPolicy(ceiling=5, prior_acceptance=0.3)
    assert best_lengths([[0.3] * 5], cost, "dflash", 5) == [0]
    assert best_lengths([[1.0] * 5], cost, "dflash", 5) == [5]
    ctl = DraftLengthController(policy, "dflash")
    assert ctl.decide([0], cost) == [1]  # the engine has verified nothing: the first request probes at once
    ctl.record(0, 1, 1)  # accepted: position 0 at (0.3 + 1) / 2, every deeper one expects the same
    assert ctl.population_estimate() == pytest.approx([0.65] * 5)
    # each verify raises every position's estimate: the ceiling within a few steps, not one position
    # per probe interval (a deeper position expects what the one before it showed)
    lengths = []
    for _ in range(8):
        lengths += ctl.decide([0], cost)
        ctl.record(0, lengths[-1], lengths[-1])
    assert lengths[4:] == [5] * 4 and lengths == sorted(lengths), lengths
    ctl.forget(0)
    assert ctl.decide([1], cost) == [5]  # a new request drafts at the ceiling from its first step
    fresh = DraftLengthController(policy, "dflash")
    fresh.record(9, 1, 1)  # mutation: what one probe showed, without the verifies at depth
    assert fresh.estimates(1)[0] < ctl.estimates(1)[0]
    # and a request unlike the others moves away within a few verifies
    for _ in range(3):
        ctl.record(1, 5, 0)
        ctl.decide([1], cost)
    assert ctl.decide([1], cost) == [0]


def test_the_decision_ignores_prefill_rows():
    probs = [[0.9, 0.8, 0.7, 0.6]] * 4
    # the prefill coefficient (what a step with a prompt chunk adds) does not enter the decode rows' time
    heavy = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.003, c_prefill_token=0.05)
    assert decode_seconds(heavy, [2, 2, 0, 1], "ngram") == decode_seconds(CPU, [2, 2, 0, 1], "ngram")
    assert best_lengths(probs, heavy, "ngram", 4) == best_lengths(probs, CPU, "ngram", 4)
    # a request arriving as a prefill row is not a decode row: the running rows keep their lengths
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=4), "draft_model")
    for sid in range(4):
        for _ in range(8):
            ctl.record(sid, 4, 2)
    before = ctl.decide([0, 1, 2, 3], CPU)
    assert ctl.decide([0, 1, 2, 3], heavy) == before  # the step also runs request 4's prompt chunk
    assert 4 not in ctl.requests


def _steady_run(margin: float, seed: int = 11, steps: int = 300) -> int:
    """Switches over the last 200 of ``steps`` steps: 8 requests accepting each draft w.p. 0.7,
    a CPU-like machine whose step times carry 10% noise, the cost fitted online. A near tie on
    purpose: the true model gives 329 tok/s at k = 2 and 323 at k = 3 (235 plain)."""
    rng = random.Random(seed)
    true = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.0012)
    online = OnlineStepCost(true, window=64)
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=4, switch_margin=margin), "ngram")
    ids = list(range(8))
    switches_before = 0
    for step in range(steps):
        if step == steps - 200:
            switches_before = ctl.num_switches
        lengths = ctl.decide(ids, online.cost)
        for sid, k in zip(ids, lengths):
            accepted = next((i for i in range(k) if rng.random() >= 0.7), k)
            ctl.record(sid, k, accepted)
        shape = StepShape(num_decode_rows=len(ids), num_verify_rows=sum(lengths))
        online.record(shape, true.predict(shape) * max(0.5, 1 + rng.gauss(0, 0.1)))
    return ctl.num_switches - switches_before


def test_lengths_are_stable_under_a_steady_load():
    assert _steady_run(margin=0.05) <= 4  # at most 2 switches per 100 steps
    # mutation: without the margin the same load flaps (the estimates and the fit move every step)
    assert _steady_run(margin=0.0) > 3 * max(_steady_run(margin=0.05), 1)


def test_acceptance_zero_gives_length_zero_and_one_with_cheap_verify_the_ceiling():
    cheap = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=1e-5, c_draft_row=1e-5, c_draft_forward=1e-5)
    for method in ("draft_model", "dflash", "ngram"):
        assert best_lengths([[0.0] * 5] * 3, cheap, method, 5) == [0, 0, 0]
        assert best_lengths([[1.0] * 5] * 3, cheap, method, 5) == [5, 5, 5]
        assert best_lengths([[1.0] * 5] * 3, cheap, method, 0) == [0, 0, 0]  # ceiling 0: plain steps
    # a verify row costing three plain rows: even drafts certain to hold lose to plain steps
    costly = StepCost(c_step=0.0, c_decode_row=0.003, c_verify_row=0.009)
    assert best_lengths([[1.0] * 4] * 8, costly, "ngram", 4) == [0] * 8


def test_a_request_at_length_zero_probes_after_the_interval():
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, probe_interval=4, prior_acceptance=0.0,
                                                  warmup_verifies=1), "ngram")
    # nothing verified yet anywhere (a warm-up of one verify): the first request probes from its
    # first step until a verify
    assert [ctl.decide([7], CPU) for _ in range(2)] == [[1], [1]]
    ctl.record(7, 1, 0)  # the probe was verified (and rejected): the interval starts again
    assert [ctl.decide([7], CPU) for _ in range(5)] == [[0], [0], [0], [0], [1]]
    assert ctl.decide([8], CPU) == [0]  # a later request waits its interval: the engine has seen drafts
    stats = ctl.stats()
    assert stats["draft_length_histogram"] == [5, 3, 0, 0]
    assert stats["num_steps_without_drafting"] == 5
    assert stats["population_acceptance"] == [0.0, 0.0, 0.0]
    ctl.forget(7)
    assert 7 not in ctl.requests and 7 not in ctl.chosen


def test_draft_forwards_per_method():
    assert [draft_forwards(m, 3) for m in ("draft_model", "eagle3", "mtp", "dflash", "dspark", "ngram")] == \
        [3, 3, 3, 1, 1, 0]
    assert draft_forwards("dflash", 0) == 0


def test_prompt_lookup_drafts_cost_their_verify_rows_only():
    # the online fit can put timing noise on the drafter-row coefficient (ngram's draft rows follow
    # its verify rows): prompt lookup runs no model, so that coefficient never prices its drafts
    noisy = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.001, c_draft_row=0.010)
    assert cost_per_draft(noisy, "ngram") == 0.001 and cost_per_draft(noisy, "dflash") == pytest.approx(0.011)
    assert decode_seconds(noisy, [3, 1], "ngram") == pytest.approx(0.010 + 2 * 0.003 + 4 * 0.001)
    assert decode_seconds(noisy, [3, 1], "dflash") == pytest.approx(0.010 + 2 * 0.003 + 4 * 0.011)
    assert best_lengths([[0.5] * 3], noisy, "ngram", 3) == [3]  # 0.5 tokens for 1 ms: pays
    assert best_lengths([[0.5] * 3], noisy, "dflash", 3) == [0]  # 0.5 tokens for 11 ms: does not


@pytest.mark.parametrize("make, match", [
    (lambda: best_lengths([[0.5]], CPU, "ngram", -1), r"ceiling \(-1\) must be an integer >= 0"),
    (lambda: best_lengths([[0.5, 1.5]], CPU, "ngram", 2), r"position 1 \(1.5\) must be in \[0, 1\]"),
    (lambda: best_lengths([[-0.1]], CPU, "ngram", 1), r"position 0 \(-0.1\) must be in \[0, 1\]"),
    (lambda: best_lengths([[0.5]], CPU, "ngram", 2), r"1 acceptance estimates cannot rate lengths up to the ceiling"),
    (lambda: expected_tokens([0.5], 2), r"draft length \(2\) must be in \[0, 1\]"),
    (lambda: DraftLengthPolicy(ceiling=-2), r"ceiling \(-2\) must be an integer >= 0"),
    (lambda: DraftLengthPolicy(ceiling=4, ema_weight=0.0), r"ema_weight \(0.0\) must be in \(0.0, 1.0\]"),
    (lambda: DraftLengthPolicy(ceiling=4, prior_acceptance=2), r"prior_acceptance \(2\) must be in \[0.0, 1.0\]"),
    (lambda: DraftLengthPolicy(ceiling=4, switch_margin=-0.1), r"switch_margin \(-0.1\) must be >= 0"),
    (lambda: DraftLengthPolicy(ceiling=4, probe_interval=0), r"probe_interval \(0\) must be an integer >= 1"),
    (lambda: DraftLengthPolicy(ceiling=4, population_probe_interval=0),
     r"population_probe_interval \(0\) must be an integer >= 1"),
    (lambda: DraftLengthPolicy(ceiling=4, population_weight=-1), r"population_weight \(-1\) must be >= 0"),
    (lambda: DraftLengthPolicy(ceiling=4, population_memory=0), r"population_memory \(0\) must be an integer >= 1"),
    (lambda: DraftLengthPolicy(ceiling=4, warmup_verifies=-1), r"warmup_verifies \(-1\) must be an integer >= 0"),
    (lambda: Evidence.empty(1, 0.5).record(1, 2), r"accepted \(2\) <= proposed \(1\) <= ceiling \(1\)"),
    (lambda: DraftLengthController(DraftLengthPolicy(ceiling=2), "medusa").decide([0], CPU),
     r"spec method 'medusa' must be one of"),
])
def test_bad_input_names_the_value_and_the_rule(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_request_without_the_steps_to_use_a_probe_does_not_probe():
    # a probe pays only through the steps after it: a request with probe_interval steps or fewer
    # left stays at 0, unless no draft was verified engine-wide for population_probe_interval steps
    policy = DraftLengthPolicy(ceiling=3, probe_interval=4, population_probe_interval=10, prior_acceptance=0.0,
                               warmup_verifies=1)
    ctl = DraftLengthController(policy, "ngram")
    ctl.record(-1, 1, 0)  # the engine has verified a draft: new requests wait their interval
    ctl.forget(-1)
    runs = [ctl.decide([1, 2], CPU, steps_left=[20 - step, 4 - step]) for step in range(4)]
    assert runs == [[0, 0], [0, 0], [0, 0], [0, 0]]  # step 4: request 1 due next, request 2 never can use it
    assert ctl.decide([1, 2], CPU, steps_left=[16, 1]) == [1, 0]  # 1 probes; 2 (1 step left) is not taken along
    ctl.record(1, 1, 0)
    ctl.record(2, 0, 0)
    # request 3 (3 steps left each time it is asked) is due from step 4 but never probes while the
    # population is fresh; at 10 steps without a verified draft engine-wide it probes
    lengths = [ctl.decide([3], CPU, steps_left=[3])[0] for _ in range(11)]
    assert lengths == [0] * 10 + [1], lengths
    ctl.record(3, 1, 0)
    assert ctl.steps_since_verify == 0
    # unbounded (None): due after its interval, it probes as before
    assert [ctl.decide([4], CPU, steps_left=[None])[0] for _ in range(5)] == [0, 0, 0, 0, 1]


@pytest.mark.parametrize("resume_ms, due_at", [(0.0, 10), (6.5, 10), (26.0, 20), (32.5, 25)])
def test_a_population_probe_waits_as_many_intervals_as_its_catch_up_costs_plain_steps(resume_ms, due_at):
    # a row that cannot use a probe of its own (3 steps left) probes once no draft was verified
    # engine-wide for population_probe_interval (10) steps, stretched by the catch-up over the
    # modelled plain step (13 ms at one row here: 26 ms -> 2x, 32.5 ms -> 2.5x; under 1x: none)
    policy = DraftLengthPolicy(ceiling=3, probe_interval=4, population_probe_interval=10, prior_acceptance=0.0,
                               warmup_verifies=1)
    ctl = DraftLengthController(policy, "eagle3")
    ctl.record(-1, 1, 0)  # warmed up; the population has seen a draft rejected
    ctl.forget(-1)
    lengths = [ctl.decide([3], CPU, steps_left=[3], resume_seconds=resume_ms / 1e3)[0] for _ in range(due_at + 1)]
    assert lengths == [0] * due_at + [1], lengths


def test_a_fresh_engine_probes_every_row_at_length_zero_until_it_has_warmed_up():
    # the 12-07 cold start (draft_controller's docstring): one rejected probe set the population's
    # p_0 from the prior's 0.5 to 0.25, every later request started at 0, and none had the steps
    # left to probe. Here a draft pays from p_0 ~0.46 (6 ms more on a 13 ms step), and
    # short requests (3 steps each) follow one whose first draft was rejected; every later draft
    # would hold.
    costly = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.006)

    def lengths_after_a_rejection(warmup: int) -> list[int]:
        ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, probe_interval=4, warmup_verifies=warmup), "ngram")
        assert ctl.decide([1], costly, steps_left=[3]) == [1]  # the prior's 0.5: the rule drafts one
        ctl.record(1, 1, 0)
        ctl.forget(1)
        got = []
        for seq in (2, 3, 4):
            for left in (3, 2, 1):
                (k,) = ctl.decide([seq], costly, steps_left=[left])
                got.append(k)
                ctl.record(seq, k, k)
            ctl.forget(seq)
        return got

    # warming up (3 verifies): request 2 probes twice, both drafts hold, and the rule drafts from
    # there (1, and 2 once the population has seen more of them held)
    warmed = lengths_after_a_rejection(3)
    assert warmed[:2] == [1, 1] and min(warmed) >= 1, warmed
    # the mutation, no warm-up past the first verify: the engine never learns that drafts hold
    assert lengths_after_a_rejection(1) == [0] * 9
    # a row whose drafter proposed nothing (prompt lookup without a match) shows nothing: still warming
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, prior_acceptance=0.0, warmup_verifies=2), "ngram")
    assert ctl.decide([1], CPU, steps_left=[1]) == [1]
    ctl.record(1, 0, 0)
    for _ in range(2):
        assert ctl.decide([1], CPU, steps_left=[1]) == [1] and ctl.is_warming_up
        ctl.record(1, 1, 0)
    # warmed up on two rejections: a row at 0 waits its interval, and a short one never probes
    assert not ctl.is_warming_up and ctl.decide([2], CPU, steps_left=[3]) == [0]


def test_a_resumed_rows_catch_up_is_charged_where_it_drafts():
    # two rows at 0.5 a position, 13 ms plain, 3 ms a verify row: both draft one without a charge
    # ((1, 1): 3 tokens in 22 ms beats (0, 1): 2.5 in 19); with 6 ms charged to the first row
    # (its drafter would catch up), only the second drafts
    probs = [[0.5] * 3, [0.5] * 3]
    assert best_lengths(probs, CPU, "ngram", 3) == [1, 1]
    assert best_lengths(probs, CPU, "ngram", 3, resume=[0.006, 0.0]) == [0, 1]
    assert best_lengths(probs[:1], CPU, "ngram", 3, resume=[0.006]) == [0]  # one row: 1.5 / 22 < 1 / 13
    assert goodput(probs, [1, 0], CPU, "ngram", [0.006, 0.0]) == pytest.approx(2.5 / 0.025)
    with pytest.raises(ValueError, match=r"resume .* one number of seconds >= 0 per decode row \(2\)"):
        best_lengths(probs, CPU, "ngram", 3, resume=[0.006])
    # the controller charges a row that did not draft at its last step, spread over the steps it
    # can draft from here (at most probe_interval); none once it drafts
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, probe_interval=4, warmup_verifies=0), "ngram")
    assert ctl.resume_charges([1, 2, 3], [10, 2, None], 0.008) == pytest.approx([0.002, 0.004, 0.002])
    assert ctl.resume_charges([1], [10], 0.0) == [0.0]
    assert ctl.decide([1], CPU, steps_left=[10], resume_seconds=0.008) == [1]  # 1.5 / 18 ms > 1 / 13
    assert ctl.resume_charges([1], [9], 0.008) == [0.0]  # it drafted at its last step
    assert ctl.decide([2], CPU, steps_left=[1], resume_seconds=0.008) == [0]  # 8 ms on its one step left


def test_probes_fall_due_together():
    # rows at length 0 join a step that probes anyway once past half their interval, so the
    # drafter runs on few steps: 16 requests arriving a step apart, every draft rejected
    interval, steps = 8, 160
    ctl = DraftLengthController(DraftLengthPolicy(ceiling=3, probe_interval=interval, prior_acceptance=0.0,
                                                  warmup_verifies=1), "ngram")
    ctl.record(-1, 1, 0)  # the engine has verified a draft: new requests wait their interval
    ctl.forget(-1)
    probing_steps = 0
    for step in range(steps):
        ids = list(range(min(step + 1, 16)))
        lengths = ctl.decide(ids, CPU)
        assert set(lengths) <= {0, 1}
        for seq, k in zip(ids, lengths):
            ctl.record(seq, k, 0)
        probing_steps += any(lengths)
    # one probing step per half interval at most (plus the arrivals' first): unaligned, the 16
    # requests' phases stay apart and two steps in every interval's 8 probe
    assert probing_steps <= steps // (interval // 2) + 2, probing_steps
    first = DraftLengthController(DraftLengthPolicy(ceiling=3, probe_interval=4, prior_acceptance=0.0,
                                                    warmup_verifies=1), "ngram")
    first.record(-1, 1, 0)
    first.requests[1] = RequestAcceptance(Evidence.empty(3, 0.5), steps_unverified=4)  # due
    first.requests[2] = RequestAcceptance(Evidence.empty(3, 0.5), steps_unverified=2)  # half-way: joins
    first.requests[3] = RequestAcceptance(Evidence.empty(3, 0.5), steps_unverified=1)  # too early
    assert first.decide([1, 2, 3], CPU) == [1, 1, 0]
    first.requests[1].steps_unverified = 0
    assert first.decide([2, 3], CPU) == [0, 0]  # no row due: nobody probes early
