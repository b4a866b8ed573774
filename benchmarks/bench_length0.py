"""Issue 27's length-0 step against a plain engine, passes interleaved, each engine in its own process.

    python -m benchmarks.bench_length0 [--eagle3 DIR] [--concurrency 2,4] [--rounds 8]
        [--json bench-results/length0.json]

Only the plain engine and each drafter's adaptive engine pinned at length 0
(``bench_adaptive.PinnedOff``) are built, once; per round and c each runs every batch of c chats
in turn, so all see the same load within about a second; an engine's batches of a round are its
pass. The order rotates by one engine every batch, so each engine takes every place in turn and
none runs two batches back to back. Reversing it every other batch (as ``bench_adaptive.measure``
does) put the engines at its ends (plain, and the last pinned one) twice in a row at every other
boundary and the middle ones never: in the 12-07 18:34 run every pinned engine but the last
cost 2-6% (ngram too, whose length-0 step does no extra work), suspected to be that.
``bench_adaptive`` measures the same cells among its grid, and this runs more rounds of them in
the time. Until 12-07 17:05 the engines took whole passes in turn (~10 s each): per-round ratios
spread 0.80-1.21 in that last run, more than the target's 2%. The cost is
the plain engine's median tok/s over the pinned engine's (target <= 1.02); the per-round ratios
show the spread. Same target, prompts and settings as ``bench_adaptive``, and as there each
engine runs in a process of its own (``benchmarks/engine_process.py``; until 12-07 13:32 they
shared this one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_adaptive import (MODEL, PINNED_GROUPS, TARGET_LENGTH0, configurations,
                                       interleaved_passes, joined, open_engine, pin_barrier_waits, write_dflash)
from benchmarks.engine_process import EngineProcess
from benchmarks.own_thread import on_own_thread
from benchmarks.prompts import humaneval_chats
from specray import SamplingParams


def measure(args, chats: list, dflash: str) -> list[dict]:
    """One cell per (pinned drafter, c): the plain and pinned passes' tok/s and their ratio."""
    grid = argparse.Namespace(eagle3=args.eagle3, ks=[args.ceiling])
    rows = configurations(grid, dflash)
    pinned = [r for r in rows if r.is_pinned_off and r.group in (args.drafters or PINNED_GROUPS)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    engines: dict[str, EngineProcess] = {}
    try:
        for row in [rows[0]] + pinned:  # the plain row first; built and warmed up
            engines["plain" if not row.k else row.group] = EngineProcess(row.label, open_engine, row, chats)
        tok_s = {(name, c): [] for name in engines for c in args.concurrency}
        for r in range(args.rounds):
            for c in args.concurrency:  # batch by batch, the order rotated (the module docstring)
                for name, batches in interleaved_passes(engines, chats, c, r, params).items():
                    tok_s[(name, c)].append(joined(batches)["tok_s"])
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    cells = []
    for row in pinned:
        for c in args.concurrency:
            plain, at0 = tok_s[("plain", c)], tok_s[(row.group, c)]
            cost = statistics.median(plain) / statistics.median(at0)
            cells.append(dict(drafter=row.group, c=c, plain=plain, length0=at0, cost=cost, met=cost <= TARGET_LENGTH0,
                              round_ratios=[p / q for p, q in zip(plain, at0)]))
    return cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle3", type=Path, default=None, help="a drafter trained by specray train-drafter")
    ap.add_argument("--ceiling", type=int, default=5, help="the pinned engines' num_draft_tokens")
    ap.add_argument("--concurrency", default="2,4")
    ap.add_argument("--drafters", default="", help=f"only these of {','.join(PINNED_GROUPS)} (default: all)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", type=Path, default=Path("bench-results/length0.json"))
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.drafters = [d for d in args.drafters.split(",") if d]
    if set(args.drafters) - set(PINNED_GROUPS):
        raise SystemExit(f"--drafters: {sorted(set(args.drafters) - set(PINNED_GROUPS))} not among {PINNED_GROUPS}")
    pin_barrier_waits()  # bench_adaptive.pin_barrier_waits says why
    chats = humaneval_chats(args.num_prompts)
    with tempfile.TemporaryDirectory(prefix="specray-bench-length0-") as root:
        cells = measure(args, chats, on_own_thread(write_dflash, Path(root)))
    drafters = ", ".join(dict.fromkeys(x["drafter"] for x in cells))
    print(f"\n{MODEL}, HumanEval 0..{args.num_prompts - 1}, {args.output_len} new tokens, {args.rounds} rounds, "
          f"batches interleaved, {torch.get_num_threads()} threads; tok/s medians; cost = plain / at length 0 "
          f"(target <= {TARGET_LENGTH0}); drafters: {drafters}\n")
    print("drafter | c | plain | at length 0 | cost | per-round ratios | met\n---|---|---|---|---|---|---")
    for x in cells:
        print(f"{x['drafter']} | {x['c']} | {statistics.median(x['plain']):.1f} | {statistics.median(x['length0']):.1f}"
              f" | {x['cost']:.3f} | {min(x['round_ratios']):.2f}-{max(x['round_ratios']):.2f} | "
              f"{'yes' if x['met'] else 'NO'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(model=MODEL, rounds=args.rounds, concurrency=args.concurrency,
                                         output_len=args.output_len, cells=cells), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
