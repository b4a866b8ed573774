"""What structured output and log-probabilities cost per output token, on SmolLM2-135M (its
49152-token vocabulary is what a grammar mask spans), TP=1, greedy, at batch 1 and 8.

    python -m benchmarks.bench_structured            # 2 rounds, 48 tokens (a few minutes on 2 cores)
    python -m benchmarks.bench_structured --rounds 3 --max-tokens 64

Rows, each the same chat requests (``--batch`` copies of a few questions):
- ``plain``: unconstrained, ``ignore_eos`` (every request runs ``--max-tokens``);
- ``json_schema``: constrained to a JSON schema (an array of three people); it ends when the JSON
  does, so it emits fewer tokens; the per-token figures make the rows comparable;
- ``logprobs5``: unconstrained, ``ignore_eos``, ``logprobs=5`` (the chosen token and the top 5).

Columns: ``tpot ms`` (median over requests of the engine's own time per output token after the
first), ``grammar ms/tok`` (wall time inside rank 0's mask and matcher calls, timed by wrapping
``Grammars``' methods, per output token), ``logprobs ms/tok`` (likewise inside
``RankWorker.output_logprobs``; it returns at once when no request asked), ``tok/s`` (output tokens
over the generate call's wall time, prefill included), and ``vs plain`` (tpot over plain's at the
same batch). Each row is the fastest of ``--rounds`` alternating rounds; the machine may be
shared (the load average is recorded), so this is a measurement of the order of the cost, not a
controlled one. Writes bench-results/structured.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from specray import LLM, EngineConfig, KVConfig, SamplingParams, StructuredOutput
from specray.executor.text import ChatPrompt
from specray.workers.grammar import Grammars
from specray.workers.worker import RankWorker

QUESTIONS = ["List three people as JSON.", "Give me three employees as JSON.", "Three characters of a story, as JSON."]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
COLUMNS = [("batch", "batch", "d"), ("mode", "mode", "s"), ("tokens", "tokens", "d"), ("tpot_ms", "tpot ms", ".2f"),
           ("grammar_ms_per_token", "grammar ms/tok", ".3f"), ("logprobs_ms_per_token", "logprobs ms/tok", ".3f"), ("tok_s", "tok/s", ".1f"), ("vs_plain", "vs plain", ".3f")]


class StepTimer:
    """Accumulates the wall time of rank 0's grammar calls and of its log-probability computation
    on the step path, by wrapping the methods (benchmark only)."""

    TIMED = {"grammar": (Grammars, ("masked", "accept", "mask_verify_rows", "settle")),
             "logprobs": (RankWorker, ("output_logprobs",))}

    def __init__(self):
        self.seconds = dict.fromkeys(self.TIMED, 0.0)
        self._originals = []

    def install(self) -> None:
        for what, (cls, names) in self.TIMED.items():
            for name in names:
                original = getattr(cls, name)
                self._originals.append((cls, name, original))

                def timed(*args, _original=original, _what=what, **kwargs):
                    start = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        self.seconds[_what] += time.perf_counter() - start
                setattr(cls, name, timed)

    def remove(self) -> None:
        for cls, name, original in self._originals:
            setattr(cls, name, original)


def params_for(mode: str, max_tokens: int) -> SamplingParams:
    if mode == "json_schema":
        return SamplingParams(max_tokens=max_tokens * 4, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=5 if mode == "logprobs5" else None)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def run_once(llm: LLM, mode: str, batch: int, max_tokens: int, timer: StepTimer) -> dict:
    prompts = [ChatPrompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(batch)]
    timer.seconds = dict.fromkeys(timer.seconds, 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params_for(mode, max_tokens))
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    num_valid = sum(_parses(o.text) for o in outs) if mode == "json_schema" else batch
    return {"batch": batch, "mode": mode, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "num_valid_json": num_valid,
            "tpot_ms": 1000 * statistics.median(o.metrics["tpot_s"] for o in outs),
            "grammar_ms_per_token": 1000 * timer.seconds["grammar"] / tokens,
            "logprobs_ms_per_token": 1000 * timer.seconds["logprobs"] / tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default="bench-results/structured.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    timer = StepTimer()
    timer.install()
    best: dict[tuple[int, str], dict] = {}
    config = EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=16, capacity_tokens=16384))
    try:
        with LLM(config) as llm:
            run_once(llm, "json_schema", 1, 8, timer)  # warm-up: the tokenizer info and the schema compile once
            for _ in range(args.rounds):
                for batch in args.batches:
                    for mode in ("plain", "json_schema", "logprobs5"):
                        row = run_once(llm, mode, batch, args.max_tokens, timer)
                        key = (batch, mode)
                        if key not in best or row["tpot_ms"] < best[key]["tpot_ms"]:
                            best[key] = row
    finally:
        timer.remove()
    rows = [best[key] for key in sorted(best, key=lambda k: (k[0], ["plain", "json_schema", "logprobs5"].index(k[1])))]
    for row in rows:
        row["vs_plain"] = row["tpot_ms"] / best[(row["batch"], "plain")]["tpot_ms"]
    print(" | ".join(title for _, title, _ in COLUMNS))
    for row in rows:
        print(" | ".join(format(row[key], spec) for key, _, spec in COLUMNS))
    result = {"rows": rows, "rounds": args.rounds, "max_tokens": args.max_tokens, "load_before": load_before,
              "load_after": os.getloadavg()[0], "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"load average {load_before:.1f} before, {result['load_after']:.1f} after; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
