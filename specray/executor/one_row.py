"""What verifying L drafts costs a step of one decode row, measured per L (plain Python, no torch);
the same for two rows by the drafts both verify.

The step-cost model prices a verified draft at one slope per batch class (``step_cost``), but at
one decode row the cost is not a line in L. On this CPU, SmolLM2 at batch 1 in the engine: the
first three or four verify rows cost about 0.6 ms each (the weights are read once and a few
rows ride along), each later one about 2.8 ms (the small GEMM turns compute-bound). A line
through a plain step and a verify of 5 drafts (the lengths a drafter that does well runs) then
prices a verify of 3 drafts at ~1.1 ms more than it costs, and prompt lookup ran 5 drafts where 3
were 3-6% faster in tokens per second (the issue 27 grid's ngram cell at concurrency 1).

So a one-row step keeps its own table: the last ``window`` times of each such step, its
drafting included, per number of verified drafts, seeded by the start-up probe's batch-1 phases
(one per length), each time
forgotten after ``max_age`` one-row steps (a length no longer run would otherwise keep a price
from another load for good: the planner then never tries it again). ``table`` is
the median time at each L over the plain step's, non-decreasing in L (a verify does not get
cheaper with a draft more: where noise says so, the shorter length's time stands), linear
between the lengths seen, and past the longest seen a draft's price on the line (its verify row
and its drafting) or, where more, the dearest draft between two lengths seen from 1 up: a further
row costs no less than the ones before it (the weights are read once; rows past the first few
only add compute). The first draft's price is not such a bound: it carries the verify path's
fixed cost (EAGLE-3 below: ~6.5 ms for one draft, 2.8 for each next on the line). A bound, not a measurement:
the knee measured above (0.05 ms for a third draft's row over the second's, 1.1 for the fourth,
2.4 for the fifth) is not seen from below it, but a length priced under the dearest draft already
timed is not tried on that price. ``StepCost.one_row_verify`` carries it to the planner, which rates every length
of a one-row step exactly (``draft_length.best_lengths``).

Why the drafting is in the table: at one row a drafter that proposes what it is asked (eagle3,
dflash, a draft model) adds a verify row and a drafter row with every draft, so the batch fit
cannot split a step's time between them, and the table replaced the verify part only. The
drafter then kept the probe's price. In the 12-07 13:32 grid the 1-row fit priced a k = 1 step
of the trained EAGLE-3 at 12.9 + 3.6 ms (0.81 ms of it drafting), and static k = 1 implied ~1.5x
a plain step: adaptive drafted 127 rows at length 1 and ran at 0.93x plain.

Two rows keep a table too (``StepCostByBatch.two_rows``: this class over 2 x ceiling, indexed by
the drafts both rows verify), and the planner rates every pair of lengths on it. Measured 12-07
with prompt lookup on HumanEval chats, two at a time: 9.27 ms plain, and 1.18, 3.13, 6.99, 9.61 ms
more verifying 1..4 drafts together, where the batch-2 line priced ~2 ms a draft; the engine ran
plain at 83% of its rows where static k = 1 ran 4-10% faster than plain. A drafter that runs a
forward per position of the longest row (eagle3, mtp, a draft model) drafts 2 + 2 and 4 + 0
differently, so two of its rows keep the line.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from specray.errors import ConfigError


class OneRowVerify:
    """Per number of verified drafts 0..ceiling, the latest target seconds of one-row steps."""

    def __init__(self, ceiling: int, *, seeds: dict[int, float] | None = None, window: int = 32,
                 max_age: int = 256):
        if not isinstance(ceiling, int) or ceiling < 0 or not isinstance(window, int) or window < 1 or \
                not isinstance(max_age, int) or max_age < 1:
            raise ConfigError(f"OneRowVerify needs an integer ceiling ({ceiling!r}) >= 0, window ({window!r}) >= 1 "
                              f"and max_age ({max_age!r}) >= 1")
        self.ceiling, self.max_age = ceiling, max_age
        self._seconds = [deque(maxlen=window) for _ in range(ceiling + 1)]  # (record index, seconds)
        self._num_recorded = 0
        self._table: tuple[tuple[int, float], tuple[float, ...]] | None = None  # (record count, slope) -> table
        for n, seconds in sorted((seeds or {}).items()):
            self.record(n, seconds)

    def record(self, num_verify_rows: int, seconds: float) -> None:
        """One step of one decode row and no prefill: its verified drafts and its seconds."""
        if not (isinstance(seconds, (int, float)) and seconds >= 0):
            raise ConfigError(f"a one-row step's time ({seconds!r}) must be a number of seconds >= 0")
        if 0 <= num_verify_rows <= self.ceiling:
            self._seconds[num_verify_rows].append((self._num_recorded, float(seconds)))
            self._num_recorded += 1

    def _fresh(self, n: int) -> list[float]:
        # a time older than max_age one-row steps is forgotten: the host's speed moves (the plain
        # step's own times track it), and a length the planner stopped choosing is not run again
        # unless the line past the lengths seen makes it look worth a try
        oldest = self._num_recorded - self.max_age
        return [seconds for index, seconds in self._seconds[n] if index >= oldest]

    def table(self, per_draft: float) -> tuple[float, ...]:
        """Seconds drafting and verifying 0..ceiling drafts adds to a plain one-row step
        (``StepCost.one_row_verify``), ``per_draft`` seconds a draft past the longest length timed;
        empty while no plain one-row step was timed within ``max_age``. Kept until the next record
        (the planner asks at every one-row step and the stats after every loop turn)."""
        key = (self._num_recorded, per_draft)
        if self._table is None or self._table[0] != key:
            self._table = (key, self._build(per_draft))
        return self._table[1]

    def _build(self, per_draft: float) -> tuple[float, ...]:
        fresh = [self._fresh(n) for n in range(self.ceiling + 1)]
        if not fresh[0]:
            return ()
        plain = median(fresh[0])
        seen = {n: max(median(s) - plain, 0.0) for n, s in enumerate(fresh) if s}
        past = max([per_draft] + dearest_drafts(seen))  # a draft's price past the longest length seen
        out, last = [], 0  # last: the longest length seen so far
        for n in range(self.ceiling + 1):
            if n in seen:
                value, last = seen[n], n
            else:
                after = next((m for m in range(n + 1, self.ceiling + 1) if m in seen), None)
                value = (seen[last] + past * (n - last) if after is None
                         else seen[last] + (seen[after] - seen[last]) * (n - last) / (after - last))
            out.append(max(value, out[-1]) if out else 0.0)
        return tuple(out)

    def stats(self) -> dict:
        return {"num_timed": [len(self._fresh(n)) for n in range(self.ceiling + 1)]}


def dearest_drafts(seen: dict[int, float]) -> list[float]:
    """Seconds a draft between consecutive lengths seen from 1 up (the module docstring: past the
    longest length seen a draft costs at least the dearest of these)."""
    lengths = sorted(n for n in seen if n >= 1)
    return [(seen[b] - seen[a]) / (b - a) for a, b in zip(lengths, lengths[1:])]
