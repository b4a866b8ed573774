"""`specray bench`: a sweep over batch sizes of fixed-length requests (ignore_eos).

Each batch size runs ``batch`` random prompts of ``input_len`` tokens for exactly
``output_len`` new tokens in one ``generate`` call, after ``warmup`` untimed calls of the
same shape. Per-request TTFT and TPOT come from ``RequestOutput.metrics``; the row reports
tok/s per request = 1000 / median TPOT (ms), as DESIGN.md defines it.

Rows are plain dicts and the table is driven by ``COLUMNS``, so a later mode (speculative
decoding: acceptance length) adds keys in ``row_from_outputs`` and entries in ``COLUMNS``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specray.config import SamplingParams

WARMUP_MAX_TOKENS = 8  # warmup only has to touch every code path, not to run the full length


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    input_len: int = 128
    output_len: int = 128
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    warmup: int = 1
    """Untimed generate calls before each measured one."""
    seed: int = 0
    """Seeds the random prompts."""

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"input_len ({self.input_len}) must be >= 1")
        if self.output_len < 2:
            raise ValueError(f"output_len ({self.output_len}) must be >= 2: TPOT is the time per token after the first")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes {list(self.batch_sizes)} must be a non-empty list of integers >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup ({self.warmup}) must be >= 0")


# (row key, header, format): the table prints these columns in this order.
COLUMNS: list[tuple[str, str, str]] = [
    ("batch", "batch", "d"),
    ("tok_s_per_request", "tok/s/req", ".1f"),
    ("total_tok_s", "total tok/s", ".1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
    ("tpot_p50_ms", "TPOT p50 ms", ".2f"),
    ("tpot_p90_ms", "TPOT p90 ms", ".2f"),
    ("acceptance_length", "AL", ".2f"),  # speculative decoding only
    ("acceptance_rate", "accepted", ".2f"),
    ("tokens_per_decode_step", "tok/step", ".2f"),  # below AL when steps go without drafts (ngram)
    ("draft_lengths", "draft lengths (rows per k)", "s"),  # adaptive speculation only
    ("num_steps_without_drafting", "no-draft steps", "d"),
]


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def row_from_outputs(batch: int, outputs, wall_s: float) -> dict:
    """One table row from the outputs of one measured generate call."""
    ttft_ms = np.array([o.metrics["ttft_s"] for o in outputs]) * 1e3
    tpot_ms = np.array([o.metrics["tpot_s"] for o in outputs]) * 1e3
    num_tokens = sum(len(o.token_ids) for o in outputs)
    tpot_p50 = float(np.median(tpot_ms))
    return dict(
        batch=batch,
        num_output_tokens=num_tokens,
        wall_s=wall_s,
        tok_s_per_request=1000.0 / tpot_p50 if tpot_p50 > 0 else float("nan"),
        total_tok_s=num_tokens / wall_s,
        ttft_p50_ms=float(np.median(ttft_ms)),
        tpot_p50_ms=tpot_p50,
        tpot_p90_ms=float(np.percentile(tpot_ms, 90)),
        num_preemptions=sum(o.metrics.get("num_preemptions", 0) for o in outputs),
        **_spec_columns(outputs),
    )


def _spec_columns(outputs) -> dict:
    """Acceptance length, rate, per-position rate and histogram over the call (speculative only)."""
    from specray.executor.spec_metrics import aggregate

    agg = aggregate([o.metrics for o in outputs])
    keys = ("acceptance_length", "acceptance_rate", "acceptance_per_position", "acceptance_histogram",
            "tokens_per_decode_step")
    return {k: agg[k] for k in keys if k in agg}


def measure_batch(llm, prompts: list[list[int]], bench: BenchConfig, params: SamplingParams,
                  on_call=lambda: None) -> tuple[dict, list]:
    """Warm up, then time one generate call of the prompts, each run to exactly output_len tokens.
    Returns the row and the outputs of the timed call."""
    warm = dataclasses.replace(params, max_tokens=min(bench.output_len, WARMUP_MAX_TOKENS), ignore_eos=True)
    for _ in range(bench.warmup):
        llm.generate(prompts, warm)
        on_call()
    timed = dataclasses.replace(params, max_tokens=bench.output_len, ignore_eos=True)
    adaptive_before = llm.stats().adaptive
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, timed)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    on_call()
    # CPU time of this process (all its threads): on a shared machine it counts the work
    # done rather than the time spent waiting for a core.
    row = dict(row_from_outputs(len(prompts), outputs, wall_s), cpu_s=cpu_s)
    return dict(row, **adaptive_columns(adaptive_before, llm.stats().adaptive)), outputs


def adaptive_columns(before: dict, after: dict) -> dict:
    """Adaptive speculation over one timed call (stats are cumulative: the difference): decode
    rows per chosen draft length 0..k, and steps in which no row drafted. Empty when off."""
    if not after:
        return {}
    hist = [a - b for a, b in zip(after["draft_length_histogram"],
                                  before.get("draft_length_histogram", [0] * len(after["draft_length_histogram"])))]
    return dict(draft_length_histogram=hist, draft_lengths=" ".join(f"{k}:{n}" for k, n in enumerate(hist)),
                num_steps_without_drafting=after["num_steps_without_drafting"]
                - before.get("num_steps_without_drafting", 0))


def run_sweep(llm, bench: BenchConfig, params: SamplingParams, vocab_size: int, progress: bool = True) -> list[dict]:
    """One row per batch size; a progress bar counts generate calls (shown on a terminal)."""
    from tqdm import tqdm

    total = len(bench.batch_sizes) * (bench.warmup + 1)
    with tqdm(total=total, desc="bench", unit="call", disable=None if progress else True, leave=False) as bar:
        rows = []
        for batch in bench.batch_sizes:
            bar.set_postfix(batch=batch)
            prompts = random_prompts(batch, bench.input_len, vocab_size, bench.seed + batch)
            row, _ = measure_batch(llm, prompts, bench, params, on_call=lambda: bar.update(1))
            rows.append(row)
        return rows


def format_table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """A fixed-width text table; a column whose key no row has is left out."""
    columns = [c for c in columns if any(c[0] in r for r in rows)]
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if k in row else "-" for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, *, engine_config, bench: BenchConfig, geometry: dict, rows: list[dict],
               **extra) -> Path:
    """Everything needed to read the numbers later: engine and bench config, pools, rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = dict(engine=dataclasses.asdict(engine_config), bench=dataclasses.asdict(bench),
                  geometry={name: g.as_dict() for name, g in geometry.items()}, rows=rows, **extra)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
