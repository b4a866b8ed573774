"""Per-request draft lengths that maximise expected goodput (plain Python, no torch).

The decision of adaptive speculation (issue 27); executor/adaptive.py wires it into the step loop.

Each request has a per-position acceptance estimate p_i: the probability that draft i is
accepted given that drafts before it were (``draft_controller.py`` keeps them, from what the
verifies show). A length k then yields ``expected_tokens(p, k) = 1 + sum_{i<k} prod_{j<=i} p_j``
tokens.

Each step the decode rows (only they: prefill rows are not an argument, so an arriving
prefill cannot change the choice) get the lengths k_r in [0, ceiling] that maximise

    goodput(k) = sum_r expected_tokens(p_r, k_r) / T(k)

with T the decode part of the modelled step time (``step_cost.StepCost``): the per-step and
per-decode-row costs, one verify row plus one drafter row per draft token (no drafter row for
ngram, which runs no model), and the drafter's sequential forwards (the longest length for a
one-token-per-forward drafter, one for a block drafter, none for ngram). Length 0 is a plain
step for that request.

The search is exact (Dinkelbach's method for a ratio): for a rate lam, max N(k) - lam T(k)
splits per request once the longest length m is fixed, so it is solved for every m in
0..ceiling; lam is raised to the best ratio found until nothing beats it (a few rounds,
O(rounds x rows x ceiling)). A step of one decode row rates each length directly: there T
prices the verify from a measured table (``StepCost.one_row_verify``, not a line in k); a step
of two rates every pair of lengths where it has one (``StepCost.two_row_verify``, by the drafts
both verify: (ceiling + 1)^2 pairs). Ties go to the shorter length (for two rows, the fewer
drafts, then the longer draft on the second row).

``resume``: seconds a row adds to T when it drafts at all (k >= 1), per row: the share of the
drafter's catch-up charged to this step for a row that did not draft at its last step (the
controller spreads a catch-up over the steps a resumed row can draft; ``draft_controller``). It
is a fixed cost per drafting row, so the split per request above still holds.

``draft_controller.DraftLengthController`` applies this to each step's decode rows, with
hysteresis and probes.
"""

from __future__ import annotations

import math

from specray.errors import ConfigError
from specray.executor.step_cost import StepCost

# how many sequential drafter forwards a longest length m costs, per spec method
_ONE_PER_POSITION = ("draft_model", "eagle3", "mtp")
_ONE_PER_BLOCK = ("dflash", "dspark")
_NO_FORWARD = ("ngram",)


def draft_forwards(method: str, longest: int) -> int:
    """The drafter's sequential forwards for a step whose longest draft is ``longest``."""
    if method in _ONE_PER_POSITION:
        return longest  # one token per forward
    if method in _ONE_PER_BLOCK:
        return 1 if longest else 0  # a whole block in one forward
    if method in _NO_FORWARD:
        return 0  # prompt lookup runs no model
    raise ConfigError(f"draft_forwards: spec method {method!r} must be one of "
                      f"{_ONE_PER_POSITION + _ONE_PER_BLOCK + _NO_FORWARD}")


def draft_rows(method: str, num_drafts: int) -> int:
    """The drafter rows ``num_drafts`` drafts compute: none for prompt lookup, which runs no model
    (so timing noise that the online fit puts on that feature cannot price its drafts)."""
    return 0 if method in _NO_FORWARD else num_drafts


def cost_per_draft(cost: StepCost, method: str) -> float:
    """Seconds one more verified draft adds: its verify row, and its drafter row where one runs."""
    return cost.c_verify_row + cost.c_draft_row * draft_rows(method, 1)


def per_draft_seconds(cost: StepCost, method: str) -> float:
    """Seconds one more draft adds on the line, past the first: its verify row, its drafter row,
    and for a one-token-per-forward drafter one more forward."""
    return cost_per_draft(cost, method) + cost.c_draft_forward * (draft_forwards(method, 2) - draft_forwards(method, 1))


def check_ceiling(ceiling: int) -> None:
    if not isinstance(ceiling, int) or ceiling < 0:
        raise ConfigError(f"the draft length ceiling ({ceiling!r}) must be an integer >= 0 (num_draft_tokens)")


def _check_probs(probs) -> None:
    for i, p in enumerate(probs):
        if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
            raise ConfigError(f"acceptance probability of draft position {i} ({p!r}) must be in [0, 1]")


def expected_tokens(probs, length: int) -> float:
    # tokens a verify of `length` drafts yields: the bonus plus each draft whose prefix all held
    _check_probs(probs)
    if not 0 <= length <= len(probs):
        raise ConfigError(f"draft length ({length}) must be in [0, {len(probs)}] (one estimate per position)")
    total, alive = 1.0, 1.0
    for p in probs[:length]:
        alive *= p
        total += alive
    return total


def decode_seconds(cost: StepCost, lengths: list[int], method: str) -> float:
    """Modelled seconds of the decode part of a step whose decode rows draft ``lengths``."""
    n = sum(lengths)
    return cost.seconds(len(lengths), n, 0, draft_rows(method, n), draft_forwards(method, max(lengths, default=0)))


def goodput(probs_by_row, lengths: list[int], cost: StepCost, method: str, resume=None) -> float:
    """Expected tokens per modelled second of the decode rows at these lengths (``resume``: the
    module docstring)."""
    tokens = sum(expected_tokens(p, k) for p, k in zip(probs_by_row, lengths))
    seconds = decode_seconds(cost, lengths, method) + _resumed(resume, lengths)
    return tokens / seconds if seconds > 0 else math.inf


def _resumed(resume, lengths: list[int]) -> float:
    # the resume seconds of the rows that draft
    return sum(r for r, k in zip(resume, lengths) if k) if resume else 0.0


def best_lengths(probs_by_row, cost: StepCost, method: str, ceiling: int, resume=None) -> list[int]:
    """The lengths (one per decode row, each in [0, ceiling]) of the highest modelled goodput
    (``resume``: seconds per row, added where it drafts; the module docstring)."""
    check_ceiling(ceiling)
    resume = list(resume) if resume else [0.0] * len(probs_by_row)
    if len(resume) != len(probs_by_row) or any(not (isinstance(r, (int, float)) and r >= 0) for r in resume):
        raise ConfigError(f"resume ({resume!r}) must hold one number of seconds >= 0 per decode row "
                          f"({len(probs_by_row)})")
    for probs in probs_by_row:
        _check_probs(probs)
        if len(probs) < ceiling:
            raise ConfigError(f"{len(probs)} acceptance estimates cannot rate lengths up to the ceiling ({ceiling})")
    if not probs_by_row:
        return []
    gains = [_expected_by_length(p, ceiling) for p in probs_by_row]
    per_token = cost_per_draft(cost, method)
    fixed = cost.c_step + cost.c_decode_row * len(gains)
    lengths = [0] * len(gains)
    rate = _rate(gains, lengths, cost, method, resume)
    if math.isinf(rate):  # a plain step modelled free: draft only if drafting is free too
        full = [ceiling] * len(gains)
        return full if decode_seconds(cost, full, method) + _resumed(resume, full) == 0 else lengths
    # one row, and two with their table, rate every length (pair) as modelled: the tables are not
    # lines in the drafts. Written out per row count: one loop over itertools.product for both
    # took 16 us a decision at one row and 66-80 at two, against 8 and 33 (12-07, this CPU)
    if len(gains) == 1:
        (g,), (r,) = gains, resume
        rates = [g[k] / (cost.seconds(1, k, 0, draft_rows(method, k), draft_forwards(method, k)) + (r if k else 0.0))
                 for k in range(ceiling + 1)]  # each > 0: the plain step's rate above is finite
        return [max(range(ceiling + 1), key=lambda k: (rates[k], -k))]
    if len(gains) == 2 and cost.two_row_verify:
        (g, h), (r, s) = gains, resume
        pairs = [(a, b) for a in range(ceiling + 1) for b in range(ceiling + 1)]
        rates = [(g[a] + h[b]) / (cost.seconds(2, a + b, 0, draft_rows(method, a + b), draft_forwards(method, max(a, b)))
                                  + (r if a else 0.0) + (s if b else 0.0)) for a, b in pairs]
        return list(pairs[max(range(len(pairs)), key=lambda i: (rates[i], -sum(pairs[i]), -pairs[i][0]))])
    for _ in range(64):  # Dinkelbach converges in a few rounds; the bound is a guard
        best, best_value = None, 1e-12 * len(gains)  # N - lam T is 0 at the current lengths
        # for each row, the best k <= m at this rate, as m grows (a running argmax)
        pick = [0] * len(gains)
        for m in range(ceiling + 1):
            for r, g in enumerate(gains):
                row_seconds = per_token * m + (resume[r] if m else 0.0)
                picked_seconds = per_token * pick[r] + (resume[r] if pick[r] else 0.0)
                if g[m] - rate * row_seconds > g[pick[r]] - rate * picked_seconds:
                    pick[r] = m
            seconds = fixed + per_token * sum(pick) + _resumed(resume, pick) + \
                cost.c_draft_forward * draft_forwards(method, m)
            value = sum(g[k] for g, k in zip(gains, pick)) - rate * seconds
            if value > best_value:
                best, best_value = list(pick), value
        if best is None:
            return lengths
        lengths, rate = best, _rate(gains, best, cost, method, resume)
    return lengths


def _expected_by_length(probs, ceiling: int) -> list[float]:
    # expected_tokens(probs, k) for k = 0..ceiling in one pass (probs already checked: this runs every step)
    out, alive = [1.0], 1.0
    for p in probs[:ceiling]:
        alive *= p
        out.append(out[-1] + alive)
    return out


def _rate(gains: list[list[float]], lengths: list[int], cost: StepCost, method: str, resume=None) -> float:
    # goodput from precomputed expected tokens per length
    seconds = decode_seconds(cost, lengths, method) + _resumed(resume, lengths)
    tokens = sum(g[k] for g, k in zip(gains, lengths))
    return tokens / seconds if seconds > 0 else math.inf
