"""Where one speculative cycle goes, per drafting method (issue 29 item 1).

    python -m benchmarks.profile_spec_cycle [--methods draft_model,eagle3,dflash,dspark,mtp]
        [--k 3] [--force 3] [--batches 1,4] [--output-len 96] [--repeats 3] [--json PATH]

Target ``mid-llama`` (TP 1, local: rank 0 runs in this process), the matching drafter preset of
each method (``mid-llama-draft``, ``-eagle3``, ``-dflash``, ``-dspark``; ``mtp`` loads
``mid-llama-mtp`` as the target and reads its module), greedy, random prompts, forced
acceptance (so every method verifies the same number of tokens whatever its random weights
propose). Rank 0's SpecRunner is wrapped with wall-clock timers (benchmark only) that split a
step into:

- ``draft fwd``: the drafter's own layers (its catch-up and every draft position), i.e. the
  drafting minus the two parts below;
- ``draft head``: the LM head read(s) while drafting (the outermost ``logits`` call of the
  drafter or the target inside ``_draft``);
- ``sample``: choosing the drafts from those logits (``choose``: argmax at greedy);
- ``verify fwd``: the target's forward over the 1 + k rows (``_score`` minus its head);
- ``verify head``: the target's LM head over the scored rows;
- ``accept``: acceptance and the emitted tokens (``_verify``);
- ``runner``: the rest of ``SpecRunner.execute`` (plan deltas, rollback, logprob bookkeeping);
- ``loop``: the rest of the step period (the time between two ``execute`` starts): scheduling,
  detokenising, outputs.

Plain decoding's step (its median TPOT) is measured in the same run for scale; each row is the
fastest of ``--repeats`` generations (the machine may be shared: the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.bench_spec import VOCAB_SIZE, prompts_for
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig

TARGET = "mid-llama"
PRESETS = {"draft_model": "mid-llama-draft", "eagle3": "mid-llama-eagle3", "dflash": "mid-llama-dflash",
           "dspark": "mid-llama-dspark", "mtp": None}
PARTS = ("draft fwd", "draft head", "sample", "verify fwd", "verify head", "accept", "runner", "loop")


class CycleTimer:
    """Timers around rank 0's SpecRunner (benchmark only). ``steps`` holds one dict of seconds per
    speculative step; the first step of a generation (the prefill) is dropped by the caller."""

    def __init__(self, runner, model):
        self.steps: list[dict[str, float]] = []
        self._now: dict[str, float] | None = None
        self._last_start: float | None = None
        self._in_draft = self._head_depth = 0
        cls = type(runner)
        execute, draft, score, verify = (getattr(cls, n).__get__(runner) for n in ("execute", "_draft", "_score",
                                                                                   "_verify"))
        propose = type(runner.drafter).propose.__get__(runner.drafter)

        def timed(fn, key):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self._now is not None:
                        self._now[key] = self._now.get(key, 0.0) + time.perf_counter() - start
            return wrapper

        def timed_execute(plan):
            start = time.perf_counter()
            if self._last_start is not None and self.steps:
                self.steps[-1]["period"] = start - self._last_start
            self._last_start, self._now = start, {}
            out = execute(plan)
            self._now["execute"] = time.perf_counter() - start
            if runner.num_drafts and any(runner.num_drafts):
                self.steps.append(self._now)
            else:
                self._last_start = None  # a step without drafts (a prefill) opens no period
            self._now = None
            return out

        def timed_draft(plan):
            self._in_draft += 1
            try:
                return timed(draft, "draft")(plan)
            finally:
                self._in_draft -= 1

        def timed_propose(batch, choose):
            return propose(batch, timed(choose, "sample"))

        runner.execute, runner._draft, runner._score, runner._verify = (
            timed_execute, timed_draft, timed(score, "score"), timed(verify, "accept"))
        runner.drafter.propose = timed_propose
        heads = [model]
        heads += [m for m in (runner.drafter, getattr(runner.drafter, "model", None)) if m is not None]
        for owner in heads:
            for name in ("logits", "draft_logits"):
                if hasattr(owner, name):
                    setattr(owner, name, self._timed_head(getattr(type(owner), name).__get__(owner)))

    def _timed_head(self, fn):
        def wrapper(*args, **kwargs):
            self._head_depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._head_depth -= 1
                if self._head_depth == 0 and self._now is not None:  # the outermost head call only
                    key = "draft head" if self._in_draft else "verify head"
                    self._now[key] = self._now.get(key, 0.0) + time.perf_counter() - start
        return wrapper

    def breakdown(self) -> dict[str, float]:
        """Median milliseconds per part over the steps with a full period."""
        rows = [s for s in self.steps if "period" in s]
        if not rows:
            return {}

        def part(s: dict[str, float]) -> dict[str, float]:
            g = s.get
            return {"draft fwd": g("draft", 0) - g("draft head", 0) - g("sample", 0),
                    "draft head": g("draft head", 0), "sample": g("sample", 0),
                    "verify fwd": g("score", 0) - g("verify head", 0), "verify head": g("verify head", 0),
                    "accept": g("accept", 0),
                    "runner": g("execute", 0) - g("draft", 0) - g("score", 0) - g("accept", 0),
                    "loop": g("period") - g("execute", 0), "step": g("period")}
        parts = [part(s) for s in rows]
        return {key: statistics.median(p[key] for p in parts) * 1e3 for key in parts[0]}


def engine(spec: SpecConfig | None, model: str) -> LLM:
    return LLM(EngineConfig(model=model, kv=KVConfig(tokens_per_block=64, capacity_tokens=16384),
                            parallel=ParallelConfig(tp_size=1, launcher="local"), spec=spec or SpecConfig()))


def profile(method: str | None, batch: int, args) -> dict:
    spec = None
    model = TARGET
    if method is not None:
        model = "mid-llama-mtp" if method == "mtp" else TARGET
        spec = SpecConfig(method=method, draft_model=PRESETS[method], num_draft_tokens=args.k,
                          force_accepted_tokens=args.force)
    prompts = prompts_for(batch, args.input_len, VOCAB_SIZE)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    with engine(spec, model) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        worker = llm._engine.worker
        best = None
        for _ in range(args.repeats):
            timer = CycleTimer(worker.spec, worker.model) if worker.spec is not None else None
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            if best is None or wall < best[0]:
                best = (wall, outs, timer)
    wall, outs, timer = best
    row = {"method": method or "plain", "batch": batch, "wall_s": wall,
           "tpot_ms": statistics.median(o.metrics["tpot_s"] for o in outs) * 1e3}
    if timer is not None:
        row.update(timer.breakdown())
    else:
        row["step"] = row["tpot_ms"]
    return row


def format_table(rows: list[dict]) -> str:
    head = ["method", "batch", *PARTS, "step", "x plain step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    plain = {r["batch"]: r["step"] for r in rows if r["method"] == "plain"}
    for r in rows:
        cells = [r["method"], str(r["batch"])] + [f"{r[p]:.1f}" if p in r else "-" for p in PARTS]
        cells += [f"{r['step']:.1f}", f"{r['step'] / plain[r['batch']]:.2f}" if r["batch"] in plain else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="draft_model,eagle3,dflash,dspark,mtp")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--force", type=float, default=3.0, help="forced acceptance length (drafts accepted + 1)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench-results/spec_cycle.json"))
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(PRESETS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}: choose from {sorted(PRESETS)}")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for method in [None, *methods]:
            rows.append(profile(method, batch, args))
            print(f"  {rows[-1]['method']} batch {batch}: step {rows[-1]['step']:.1f} ms", file=sys.stderr)
    load = os.getloadavg()
    print(f"mid-llama TP 1, k={args.k}, forced AL {args.force:g}, median ms per step; load {load[0]:.1f}")
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"k": args.k, "force": args.force, "load": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
