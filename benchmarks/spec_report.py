"""What the speculative benchmarks time and print: a rank's drafting and verify time
(``StepTimer``) and their result tables (``format_table``). Shared by bench_spec.py,
spec_humaneval.py and bench_trained_drafters.py, apart so that none imports another."""

from __future__ import annotations

import time


class StepTimer:
    """Wraps one rank's SpecRunner._draft and ._score to time them (benchmark only)."""

    def __init__(self, runner):
        self.draft_s, self.verify_s, self.num_steps = 0.0, 0.0, 0
        # bound from the class, so a new timer replaces the last one instead of wrapping it
        draft, score = type(runner)._draft.__get__(runner), type(runner)._score.__get__(runner)

        def timed_draft(plan):
            start = time.perf_counter()
            out = draft(plan)
            self.draft_s += time.perf_counter() - start
            return out

        def timed_score(*args):
            start = time.perf_counter()
            out = score(*args)
            self.verify_s += time.perf_counter() - start
            self.num_steps += 1
            return out

        runner._draft, runner._score = timed_draft, timed_score


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown-style table of ``columns`` (key, header, format; "s" as text), "-" where a row has None."""
    head = " | ".join(h for _, h, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt != "s" else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)
