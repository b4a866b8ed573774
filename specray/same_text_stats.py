"""The statistics of the same-text harness (same_text.py): pure functions, tested with literals.

Intervals are percentile-bootstrap intervals over prefixes: resample the prefixes with
replacement ``num_resamples`` times (a seeded ``random.Random``, so a report is reproducible),
take the mean of each resample, and report the 2.5th and 97.5th percentiles of those means.
The prefix is the unit of resampling because steps of one prefix are not independent (one
hard passage lowers many steps at once). A paired comparison resamples the per-prefix
*differences*, so what both configurations share (the prefix's difficulty) cancels.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

DEFAULT_RESAMPLES = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def describe(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q ({q}) must be in [0, 1]")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_mean(values: list[float], num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                   confidence: float = CONFIDENCE) -> Interval:
    """The mean of ``values`` with its percentile-bootstrap interval (module docstring)."""
    if not values:
        raise ValueError("bootstrap_mean needs at least one value (no prefixes were measured)")
    if num_resamples < 1:
        raise ValueError(f"num_resamples ({num_resamples}) must be >= 1")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(num_resamples))
    tail = (1.0 - confidence) / 2
    return Interval(statistics.fmean(values), percentile(means, tail), percentile(means, 1.0 - tail))


def paired_difference(a: list[float], b: list[float], num_resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0) -> Interval:
    """Mean of ``b[i] - a[i]`` over prefixes i, with its bootstrap interval."""
    if len(a) != len(b):
        raise ValueError(f"a paired comparison needs one value per prefix on both sides; got {len(a)} and {len(b)}")
    return bootstrap_mean([y - x for x, y in zip(a, b)], num_resamples, seed)


def share_equal(outputs: list[list[int]], references: list[list[int]]) -> float:
    """Fraction of prefixes whose output equals the reference token for token."""
    if len(outputs) != len(references) or not outputs:
        raise ValueError(f"share_equal needs as many outputs ({len(outputs)}) as references ({len(references)}), "
                         f"at least one")
    return sum(o == r for o, r in zip(outputs, references)) / len(outputs)


def first_difference(output: list[int], reference: list[int]) -> int | None:
    """Index of the first token where ``output`` and ``reference`` differ (None: equal)."""
    for i, (o, r) in enumerate(zip(output, reference)):
        if o != r:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def step_time_s(metrics: dict) -> float:
    """Mean seconds per decode step of one request: the time after its first token over the
    steps that decoded it (verify steps and steps without drafts alike)."""
    num_tokens, steps = metrics["num_output_tokens"], metrics.get("num_decode_steps")
    if not steps:
        steps = num_tokens - 1  # plain decoding: one step per token after the first
    return metrics["tpot_s"] * (num_tokens - 1) / steps if steps else 0.0
