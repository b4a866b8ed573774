"""The step-cost model per batch class: one online fit (``step_cost.OnlineStepCost``) per range
of decode rows, each with a prior priced at its own batch from the start-up probe (plain
Python, no torch). ``StepCostByBatch``'s docstring says why a step's cost needs more than one
line on this CPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from specray.errors import ConfigError
from specray.executor.one_row import OneRowVerify
from specray.executor.step_cost import OnlineStepCost, StepCost, StepShape


def batch_class(num_decode_rows: int) -> int:
    """The batch class of a step: 0 for at most one decode row, then 1 (2 rows), 2 (3-4),
    3 (5-8), ...: each class's rows up to 2 ** class."""
    return max(num_decode_rows - 1, 0).bit_length()


def interpolate_slope(slopes: dict[int, float], num_rows: int) -> float:
    """The verify-row cost at ``num_rows`` decode rows from the ones measured at some batch sizes:
    linear between them, the nearest one's beyond them. Written as a weighted mean of the two
    measured slopes, so it lies between them in floating point too (``s0 + (s1 - s0) * t`` can
    land a few ulps below 0 when s1 is 0, which ``StepCost`` rightly refuses)."""
    points = sorted(slopes.items())
    if num_rows <= points[0][0]:
        return points[0][1]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if num_rows <= n1:
            t = (num_rows - n0) / (n1 - n0)
            return (1 - t) * s0 + t * s1
    return points[-1][1]


def plain_line(seconds_by_rows: dict[int, float], num_rows: int) -> tuple[float, float]:
    """(c_step, c_decode_row) of a plain step at ``num_rows`` decode rows from plain steps timed at
    some batch sizes: the line through the two around it (the nearest two beyond them), its
    slope kept >= 0 and its time at ``num_rows`` kept: a class's choices compare lengths at its
    own rows, so the time there is what must hold. Where the line crosses 0 above 0 rows (steep,
    as when the upper batch is compute-bound), the intercept is 0 and the slope that time over
    the rows."""
    points = sorted(seconds_by_rows.items())
    if len(points) < 2 or any(n < 1 or not (math.isfinite(t) and t >= 0) for n, t in points):
        raise ConfigError(f"plain step times {seconds_by_rows!r} must be given at two or more batch sizes (decode "
                          f"rows >= 1), each time finite and >= 0 (seconds)")
    (n0, t0), (n1, t1) = next((pair for pair in zip(points, points[1:]) if num_rows <= pair[1][0]), points[-2:])
    raw = (t1 - t0) / (n1 - n0)
    at, slope = max(t0 + raw * (num_rows - n0), 0.0), max(raw, 0.0)  # the time at num_rows on that line
    if at - slope * num_rows < 0:
        return 0.0, at / num_rows
    return at - slope * num_rows, slope


class StepCostByBatch:
    """One online fit per batch class (``batch_class``), each over its own steps.

    Why: a step's cost is not linear in its rows over the whole range. On this CPU a plain step
    of SmolLM2 takes 21 ms at 1 row and at 4 (memory-bound: the weights are read once), a verify
    of 1 + 5 rows 26 ms (0.9 ms per verified draft), and 4 x (1 + 5) rows 100 ms (3.9 ms per
    draft: compute-bound). One linear fit over both prices a batch-1 draft at the mixture, about
    3 ms, four times its cost, and a request then does not draft where drafting pays most. Each
    class's fit is the local slope at its operating point. Its prior is ``prior`` with the verify
    row priced at that class's batch (``verify_slopes``: seconds per verified draft measured at
    some decode-row counts, by the start-up probe; interpolated, ``interpolate_slope``) and, where
    the probe timed plain steps at two or more batch sizes (``plain_seconds``), the per-step and
    per-row costs of the plain line there (``plain_line``). A step of one decode row prices its
    verify by ``one_row`` where given (``executor/one_row.py``), a step of two by ``two_rows``
    (indexed by the drafts both verify).

    Why a prior per class, not one fit's: a class whose steps all draft the same length (16
    requests at length 5) varies decode and verify rows together, so its steps fix their sum and
    the prior alone splits it. With one prior fitted at batches 1 and 4 (memory-bound rows), the
    12-07 grid's batch-16 fit priced a plain step of 16 rows at 108 ms where the runs implied ~67,
    and dflash at forced acceptance stayed at length 5 where k = 1 and plain ran faster."""

    def __init__(self, prior: StepCost, *, verify_slopes: dict[int, float] | None = None,
                 plain_seconds: dict[int, float] | None = None, window: int = 256, refit_every: int = 1,
                 one_row: OneRowVerify | None = None, two_rows: OneRowVerify | None = None,
                 per_draft: Callable[[StepCost], float] | None = None):
        """``per_draft``: a draft's seconds on a cost's line (its verify row and the drafting it adds,
        which depend on the spec method: ``draft_length.per_draft_seconds``), for the one- and two-row
        tables past the lengths they timed; without it, ``c_verify_row``."""
        for n, slope in (verify_slopes or {}).items():
            if not (isinstance(n, int) and n >= 1 and math.isfinite(slope) and slope >= 0):
                raise ConfigError(f"verify slope {slope!r} at {n!r} decode rows: rows must be an integer >= 1 and "
                                  f"the slope finite and >= 0 (seconds per verified draft)")
        if plain_seconds:
            plain_line(plain_seconds, 1)  # bad times fail here, not at the first step of a class
        self.prior, self.verify_slopes = prior, dict(verify_slopes or {})
        self.plain_seconds = dict(plain_seconds or {})
        self.window, self.refit_every = window, refit_every
        self.one_row, self.two_rows = one_row, two_rows
        self.per_draft = per_draft or (lambda cost: cost.c_verify_row)
        self._fits: dict[int, OnlineStepCost] = {}
        self._last = 0  # the class of the last step planned or recorded (for stats)

    def _fit(self, cls: int) -> OnlineStepCost:
        if cls not in self._fits:
            prior = self.prior
            if self.verify_slopes:
                prior = replace(prior, c_verify_row=interpolate_slope(self.verify_slopes, 2 ** cls))
            if self.plain_seconds:
                c_step, c_decode_row = plain_line(self.plain_seconds, 2 ** cls)
                prior = replace(prior, c_step=c_step, c_decode_row=c_decode_row)
            self._fits[cls] = OnlineStepCost(prior, window=self.window, refit_every=self.refit_every)
        return self._fits[cls]

    def at(self, num_decode_rows: int) -> StepCost:
        """The model of a step with this many decode rows."""
        self._last = batch_class(num_decode_rows)
        cost = self._fit(self._last).cost
        if num_decode_rows == 1 and self.one_row is not None:
            cost = replace(cost, one_row_verify=self.one_row.table(self.per_draft(cost)))
        elif num_decode_rows == 2 and self.two_rows is not None:
            cost = replace(cost, two_row_verify=self.two_rows.table(self.per_draft(cost)))
        return cost

    def record(self, shape: StepShape, seconds: float) -> StepCost:
        """A step's shape and time (a step of one or two decode rows also in its table)."""
        table = {1: self.one_row, 2: self.two_rows}.get(shape.num_decode_rows)
        if table is not None and not shape.num_prefill_tokens:
            table.record(shape.num_verify_rows, seconds)
        return self._fit(batch_class(shape.num_decode_rows)).record(shape, seconds)

    def stats(self) -> dict:
        by_batch = {2 ** c: {**f.cost.as_dict(), "num_step_timings": f.stats()["num_step_timings"]}
                    for c, f in sorted(self._fits.items())}
        out = {**self._fit(self._last).stats(), "batch": 2 ** self._last, "by_batch": by_batch}
        if self.one_row is not None:
            one = self._fit(batch_class(1)).cost
            out["one_row_verify_s"] = list(self.one_row.table(self.per_draft(one)))
            out["one_row_timed"] = self.one_row.stats()["num_timed"]  # fresh times per length
        if self.two_rows is not None:
            two = self._fit(batch_class(2)).cost
            out["two_row_verify_s"] = list(self.two_rows.table(self.per_draft(two)))
            out["two_row_timed"] = self.two_rows.stats()["num_timed"]
        return out
