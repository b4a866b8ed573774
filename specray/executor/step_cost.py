"""The step-cost model adaptive speculation plans with (plain Python, no torch).

The modelled time of one step is linear in what the step computes:

    t = c_step + c_decode_row * decode_rows + c_verify_row * verify_rows
        + c_prefill_token * prefill_tokens + c_draft_row * draft_rows + c_draft_forward * draft_forwards

- ``decode_rows``: sequences that decode this step, plain or verifying (each feeds one token);
- ``verify_rows``: drafts the target verifies, the rows a verifying sequence adds to its one;
- ``prefill_tokens``: prompt tokens computed by prefill chunks;
- ``draft_rows``: draft positions x sequences the drafter computes;
- ``draft_forwards``: the drafter's sequential forwards (the longest draft for a drafter that
  proposes one token per forward, one for a block drafter, none for ngram): its per-forward
  overhead (launches, Python, reading its weights once), which a batch shares.

Why rows: on this CPU a target row costs about the same whether it is a plain decode or a
verified draft (compute-bound: 105 ms for 8 x 4 verify rows against 34 ms for 8 plain rows,
about 3 ms per extra row), so the verify cost is per row, not per sequence. On a GPU a verify
is memory-bound and rows are nearly free up to a knee; the fit below is windowed, so it tracks
the local slope at the operating point, which is what a choice between nearby lengths needs
(a knee far from the operating point is not modelled). ``verify_rows`` and ``draft_rows`` are
nearly collinear (equal when the drafter proposes what it was asked); the planner only uses
their sum per draft token, which the timings do determine, and the prior keeps each defined.

Fitting: ridge least squares over the last ``window`` steps towards a prior (a start-up
measurement, ``probe_shapes``), the prior counting as ``prior_weight`` steps in every
feature's direction; a coefficient fitted below 0 counts as 0 (no work makes a step faster).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from specray.errors import ConfigError

FEATURES = ("step", "decode_row", "verify_row", "prefill_token", "draft_row", "draft_forward")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShape:
    """What one step computes, in the model's units (see the module docstring)."""

    num_decode_rows: int = 0
    num_verify_rows: int = 0
    num_prefill_tokens: int = 0
    num_draft_rows: int = 0
    num_draft_forwards: int = 0

    def __post_init__(self) -> None:
        for name in ("num_decode_rows", "num_verify_rows", "num_prefill_tokens", "num_draft_rows",
                     "num_draft_forwards"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"StepShape.{name} ({value!r}) must be an integer >= 0")

    def features(self) -> tuple[float, ...]:
        """The feature vector, in FEATURES order (1 for the per-step constant)."""
        return (1.0, self.num_decode_rows, self.num_verify_rows, self.num_prefill_tokens,
                self.num_draft_rows, self.num_draft_forwards)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """Seconds per unit of each feature (the model's coefficients), each finite and >= 0."""

    c_step: float = 0.0
    c_decode_row: float = 0.0
    c_verify_row: float = 0.0
    c_prefill_token: float = 0.0
    c_draft_row: float = 0.0
    c_draft_forward: float = 0.0
    one_row_verify: tuple[float, ...] = ()
    """Seconds drafting and verifying L drafts adds to a step of one decode row and no prefill, at
    index L (``OneRowVerify``, measured); empty, or past its end: the line's verify and drafter
    rows and forwards."""
    two_row_verify: tuple[float, ...] = ()
    """The same for a step of two decode rows, at index V: the drafts the two verify together."""

    def __post_init__(self) -> None:
        for name, value in zip(FEATURES, self.coefficients):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"StepCost.c_{name} ({value!r}) must be a finite number >= 0 (seconds per unit)")
        for name, table in (("one_row_verify", self.one_row_verify), ("two_row_verify", self.two_row_verify)):
            if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) for v in table) or \
                    table[:1] not in ((), (0.0,)):
                raise ConfigError(f"StepCost.{name} ({table!r}) must be empty or start at 0 (verifying no draft "
                                  f"adds no time), every entry finite and >= 0 (seconds)")

    @classmethod
    def from_coefficients(cls, coefficients) -> "StepCost":
        # a coefficient fitted below 0 counts as 0: no work makes a step faster
        return cls(**{f"c_{n}": max(float(c), 0.0) for n, c in zip(FEATURES, coefficients)})

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.c_step, self.c_decode_row, self.c_verify_row, self.c_prefill_token, self.c_draft_row,
                self.c_draft_forward)

    def predict(self, shape: StepShape) -> float:
        """Modelled seconds of a step of this shape."""
        return self.seconds(shape.num_decode_rows, shape.num_verify_rows, shape.num_prefill_tokens,
                            shape.num_draft_rows, shape.num_draft_forwards)

    def seconds(self, decode_rows: int, verify_rows: int, prefill_tokens: int, draft_rows: int,
                draft_forwards: int) -> float:
        """``predict`` of the shape these counts make, unchecked: the planner rates every length of
        every step with it, where building a checked ``StepShape`` each time was most of its cost."""
        if 0 < decode_rows <= 2 and not prefill_tokens and verify_rows:
            table = self.one_row_verify if decode_rows == 1 else self.two_row_verify
            if verify_rows < len(table):  # the measured drafting and verify in place of the line's
                return self.c_step + self.c_decode_row * decode_rows + table[verify_rows]
        return (self.c_step + self.c_decode_row * decode_rows + self.c_verify_row * verify_rows
                + self.c_prefill_token * prefill_tokens + self.c_draft_row * draft_rows
                + self.c_draft_forward * draft_forwards)

    def as_dict(self) -> dict[str, float]:
        return {f"c_{n}_s": c for n, c in zip(FEATURES, self.coefficients)}

    def describe(self) -> str:
        """One log line, in milliseconds."""
        return "step cost (ms): " + ", ".join(f"{n} {c * 1e3:.3g}" for n, c in zip(FEATURES, self.coefficients))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b by Gaussian elimination with partial pivoting; None when a is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _check_seconds(seconds: float) -> None:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"a step time ({seconds!r}) must be a finite number of seconds >= 0")


def _ridge(gram: list[list[float]], moment: list[float], count: int, prior: StepCost | None,
           prior_weight: float) -> list[float] | None:
    """Solve (G + L) c = m + L c_prior, L_jj = prior_weight * (1 + mean x_j^2): the prior as
    ``prior_weight`` steps in each feature's direction, whatever the feature's scale."""
    n = len(moment)
    a = [row[:] for row in gram]
    b = moment[:]
    if prior is not None and prior_weight > 0:
        for j, c0 in enumerate(prior.coefficients):
            lam = prior_weight * (1.0 + (gram[j][j] / count if count else 0.0))
            a[j][j] += lam
            b[j] += lam * c0
    return _solve(a, b) if n else []


def fit_step_cost(samples: list[tuple[StepShape, float]], prior: StepCost | None = None,
                  prior_weight: float = 0.0) -> StepCost:
    """The coefficients that fit (shape, seconds) samples in least squares (ridge towards
    ``prior`` when given); without a prior the samples must determine every coefficient."""
    if prior_weight < 0 or (prior_weight > 0 and prior is None):
        raise ConfigError(f"prior_weight ({prior_weight}) must be >= 0, and > 0 only with a prior")
    n = len(FEATURES)
    gram = [[0.0] * n for _ in range(n)]
    moment = [0.0] * n
    for shape, seconds in samples:
        _check_seconds(seconds)
        x = shape.features()
        for i in range(n):
            moment[i] += x[i] * seconds
            for j in range(n):
                gram[i][j] += x[i] * x[j]
    coefficients = _ridge(gram, moment, len(samples), prior, prior_weight)
    if coefficients is None:
        raise ConfigError(f"{len(samples)} step timings do not determine all of {FEATURES}: each feature must "
                          f"vary independently, or give a prior with prior_weight > 0")
    return StepCost.from_coefficients(coefficients)


def probe_shapes(*, max_num_seqs: int, ceiling: int, prefill_tokens: int, per_position: bool) -> list[StepShape]:
    """Step shapes a start-up measurement times so that their timings determine every
    coefficient (for ``fit_step_cost`` without a prior), one shape per coefficient: plain
    batches of two sizes, a prefill chunk, the drafter alone at two batch sizes, a full verify
    (``executor/probe.py`` times them, the drafter alone as a plain step plus a verify's drafting)."""
    if max_num_seqs < 2 or ceiling < 1 or prefill_tokens < 1:
        raise ConfigError(f"probe_shapes needs max_num_seqs ({max_num_seqs}) >= 2, ceiling ({ceiling}) >= 1 and "
                          f"prefill_tokens ({prefill_tokens}) >= 1")
    s, k = max_num_seqs, ceiling
    forwards = (lambda length: length) if per_position else (lambda length: 1)
    return [
        StepShape(num_decode_rows=1), StepShape(num_decode_rows=s),
        StepShape(num_prefill_tokens=prefill_tokens),
        # the drafter alone (no target verify rows), then drafts verified by the target
        StepShape(num_decode_rows=1, num_draft_rows=k, num_draft_forwards=forwards(k)),
        StepShape(num_decode_rows=s, num_draft_rows=s * k, num_draft_forwards=forwards(k)),
        StepShape(num_decode_rows=s, num_verify_rows=s * k, num_draft_rows=s * k, num_draft_forwards=forwards(k)),
    ]


class OnlineStepCost:
    """The model refreshed from every step's timing: ridge least squares over the last
    ``window`` steps towards ``prior`` (kept as running sums, so a step costs O(features^2))."""

    def __init__(self, prior: StepCost, *, window: int = 256, prior_weight: float = 4.0, refit_every: int = 1):
        if window < 1 or prior_weight <= 0:
            raise ConfigError(f"OnlineStepCost needs window ({window}) >= 1 and prior_weight ({prior_weight}) > 0: "
                              f"the prior keeps the fit defined before every feature has varied")
        if not isinstance(refit_every, int) or refit_every < 1:
            raise ConfigError(f"refit_every ({refit_every!r}) must be an integer >= 1 (steps between refits)")
        self.prior, self.window, self.prior_weight = prior, window, prior_weight
        self.refit_every = refit_every  # the solve is most of a record's cost; the sums move every step
        self._samples: deque[tuple[tuple[float, ...], float]] = deque()
        n = len(FEATURES)
        self._gram = [[0.0] * n for _ in range(n)]
        self._moment = [0.0] * n
        self._num_recorded = 0
        self.cost = prior

    def _accumulate(self, x: tuple[float, ...], seconds: float, sign: float) -> None:
        # a step's features are mostly 0 (a decode step feeds no prefill, a plain one no drafts):
        # only the nonzero ones move the sums
        nonzero = [i for i, xi in enumerate(x) if xi]
        for i in nonzero:
            sxi = sign * x[i]
            self._moment[i] += sxi * seconds
            row = self._gram[i]
            for j in nonzero:
                row[j] += sxi * x[j]

    def record(self, shape: StepShape, seconds: float) -> StepCost:
        """Add one step's measured time; returns the refreshed model."""
        _check_seconds(seconds)
        x = shape.features()
        self._samples.append((x, seconds))
        self._accumulate(x, seconds, 1.0)
        if len(self._samples) > self.window:
            self._accumulate(*self._samples.popleft(), -1.0)
        self._num_recorded += 1
        if self._num_recorded % self.window == 0:  # rebuild the sums: subtraction drifts in float
            n = len(FEATURES)
            self._gram, self._moment = [[0.0] * n for _ in range(n)], [0.0] * n
            for x_old, s_old in self._samples:
                self._accumulate(x_old, s_old, 1.0)
        if self._num_recorded % self.refit_every:
            return self.cost
        fitted = _ridge(self._gram, self._moment, len(self._samples), self.prior, self.prior_weight)
        self.cost = self.prior if fitted is None else StepCost.from_coefficients(fitted)
        return self.cost

    def stats(self) -> dict:
        return {**self.cost.as_dict(), "num_step_timings": self._num_recorded, "window": len(self._samples)}

    def describe(self) -> str:
        return f"{self.cost.describe()} ({self._num_recorded} step timings, window {len(self._samples)})"
