"""Drafters trained on this machine against plain decoding and n-gram lookup, on SmolLM2-135M and
HumanEval (held out from training), in one run of alternating rounds (issue 17's benchmark):

    python -m benchmarks.bench_trained_drafters --eagle3 runs/smollm2-eagle3 --dflash runs/smollm2-dflash

Rows: plain; ngram (4- down to 1-gram lookup), each trained drafter given, at k = 3, 5, 7
(``--ks``). Every row: greedy, batch 1, ``--num-prefixes`` chat-formatted HumanEval problems,
``--output-len`` tokens each (EOS ignored, so every row decodes the same number of tokens), float32,
64-token target pages. Columns:

- ``AL`` = acceptance length (tokens per verify step) from the same-text harness
  (``specray.same_text.summarize``): the mean over prefixes with its 95% bootstrap interval;
- ``equal`` = the share of prefixes whose output equals plain decoding's token for token (100%);
- ``tok/s`` = tokens / wall time over all prefixes, prefill included; ``speedup`` = over plain's;
- ``draft ms`` / ``verify ms`` = mean wall time per speculative step of the drafting and of the
  target's verify forward (spec_report.StepTimer on rank 0's runner, in this process at TP = 1).

Greedy decoding makes AL the same in every round; the rounds alternate over the rows so that a
burst of load from other processes falls on all of them, and each row's fastest round counts.

``--pages`` adds the seed's experiment on the trained DFlash: at its best k, the drafter kernels
narrowed to 32-token and to 64-token draft pages (``SPECRAY_DRAFT_KERNEL_PAGE_SIZES``), paired
over the same prefixes (``specray.same_text.compare``): the difference of AL with its interval.
Targets, printed with the result: a trained drafter's AL >= 2.5 at its best k and >= 1.8x plain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.spec_report import StepTimer
from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.bench import format_table
from specray.same_text import compare, environment, format_comparison, load_prefixes, summarize, to_json

MODEL = "smollm2-135m"
LOOKUP = dict(prompt_lookup_min=1, prompt_lookup_max=4)
TARGET_AL, TARGET_SPEEDUP = 2.5, 1.8  # issue 17
COLUMNS = [("method", "method", "s"), ("k", "k", "s"), ("al", "AL [95%]", "s"), ("equal", "equal", ".0%"),
           ("tok_s", "tok/s", ".1f"), ("speedup", "speedup", ".2f"), ("draft_ms", "draft ms", ".1f"),
           ("verify_ms", "verify ms", ".1f")]


def configs(args) -> list[tuple[str, int | None, SpecConfig, tuple]]:
    """(method, k, spec, environment) per row; plain first."""
    rows = [("plain", None, SpecConfig(), ())]
    rows += [("ngram", k, SpecConfig(method="ngram", num_draft_tokens=k, **LOOKUP), ()) for k in args.ks]
    for method in ("eagle3", "dflash"):
        path = getattr(args, method)
        if path is not None:
            rows += [(method, k, SpecConfig(method=method, draft_model=str(path), num_draft_tokens=k), ())
                     for k in args.ks]
    return rows


def run_config(spec: SpecConfig, env: tuple, prefixes: list[list[int]], output_len: int) -> tuple[list, float, dict]:
    """(outputs, wall seconds over all prefixes, draft and verify ms per speculative step): one
    request at a time, after a warm-up."""
    cfg = EngineConfig(model=MODEL, dtype="float32", kv=KVConfig(tokens_per_block=64), spec=spec)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with environment(env), LLM(cfg) as llm:
        llm.generate([prefixes[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        pages = {f"{name}_page_size": g.tokens_per_block for name, g in llm.geometry.items()}
        runner = getattr(getattr(llm._engine, "worker", None), "spec", None)  # rank 0's, here at TP = 1
        timer = StepTimer(runner) if runner is not None else None
        outs, wall = [], 0.0
        for prefix in prefixes:
            start = time.perf_counter()
            outs += llm.generate([prefix], params)
            wall += time.perf_counter() - start
    steps = timer.num_steps if timer is not None else 0
    times = dict(draft_ms=timer.draft_s / steps * 1e3, verify_ms=timer.verify_s / steps * 1e3) if steps else {}
    return outs, wall, {**times, **pages}


def run_rounds(rows: list, prefixes: list[list[int]], args) -> list[dict]:
    """Per row: the outputs and the fastest wall time over ``--rounds`` alternating rounds."""
    best = [dict(wall_s=float("inf"), round_tok_s=[]) for _ in rows]
    for r in range(args.rounds):
        for (method, k, spec, env), result in zip(rows, best):
            outs, wall, times = run_config(spec, env, prefixes, args.output_len)
            tok_s = sum(len(o.token_ids) for o in outs) / wall
            result["round_tok_s"].append(tok_s)
            if wall < result["wall_s"]:
                result.update(wall_s=wall, tok_s=tok_s, outputs=outs, **times)
            print(f"round {r + 1}/{args.rounds} {method} k={k or '-'}: {tok_s:.1f} tok/s", flush=True)
    return best


def table(rows: list, best: list[dict], seed: int) -> list[dict]:
    plain = best[0]
    out = []
    for (method, k, _, _), result in zip(rows, best):
        s = summarize(result["outputs"], plain["outputs"], seed=seed)
        out.append(dict(method=method, k=str(k or "-"), al=s["acceptance_length"].describe(2),
                        al_mean=s["acceptance_length"].mean, equal=s["share_equal_to_plain"], tok_s=result["tok_s"],
                        speedup=result["tok_s"] / plain["tok_s"], round_tok_s=result["round_tok_s"], summary=s,
                        outputs=result["outputs"], **{t: result[t] for t in ("draft_ms", "verify_ms") if t in result}))
    return out


def verdicts(report: list[dict]) -> list[str]:
    trained = [r for r in report if r["method"] in ("eagle3", "dflash")]
    if not trained:
        return ["no trained drafter given (--eagle3, --dflash): the targets are not measured"]
    lines = []
    for method in sorted({r["method"] for r in trained}):
        mine = [r for r in trained if r["method"] == method]
        al, fast = max(mine, key=lambda r: r["al_mean"]), max(mine, key=lambda r: r["speedup"])
        lines.append(f"{method}: best AL {al['al_mean']:.2f} at k={al['k']} (target >= {TARGET_AL}): "
                     + ("met" if al["al_mean"] >= TARGET_AL else "NOT met")
                     + f"; best speedup {fast['speedup']:.2f}x at k={fast['k']} (target >= {TARGET_SPEEDUP}x): "
                     + ("met" if fast["speedup"] >= TARGET_SPEEDUP else "NOT met"))
    return lines


def pages_experiment(args, report: list[dict], prefixes: list[list[int]]) -> dict:
    """The trained DFlash at its best k with 32- and with 64-token draft pages, paired."""
    k = int(max((r for r in report if r["method"] == "dflash"), key=lambda r: r["al_mean"])["k"])
    spec = SpecConfig(method="dflash", draft_model=str(args.dflash), num_draft_tokens=k)
    sides = {}
    for pages in (32, 64):
        outs, _, info = run_config(spec, (("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", str(pages)),), prefixes,
                                   args.output_len)
        if info.get("draft_page_size") != pages:
            raise RuntimeError(f"draft kernels narrowed to {pages}-token pages, but the engine agreed "
                               f"{info.get('draft_page_size')}: the experiment would compare nothing")
        sides[pages] = summarize(outs, report[0]["outputs"], seed=args.seed)
    c = compare(sides[32], sides[64], seed=args.seed)
    print(f"\ndflash k={k}, draft pages 32 (a) against 64 (b): AL {sides[32]['acceptance_length'].describe()} and "
          f"{sides[64]['acceptance_length'].describe()}; {format_comparison(c)}")
    return dict(k=k, pages_32=sides[32], pages_64=sides[64], comparison=c,
                is_same_within_interval=c["acceptance_length_difference"].contains(0.0))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle3", type=Path, default=None, help="a trained EAGLE-3 drafter (train-drafter --out)")
    ap.add_argument("--dflash", type=Path, default=None, help="a trained DFlash drafter (train-drafter --out)")
    ap.add_argument("--ks", default="3,5,7", help="drafts per verify step, e.g. 3,5,7")
    ap.add_argument("--num-prefixes", type=int, default=8, help="HumanEval problems 0..N-1")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pages", action="store_true", help="also the 32- against 64-token draft pages experiment")
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap intervals")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 prefixes, 16 tokens, 1 round, k = 3")
    ap.add_argument("--json", type=Path, default=Path("bench-results/trained_drafters_smollm2-135m.json"))
    args = ap.parse_args(argv)
    args.ks = tuple(int(x) for x in args.ks.split(","))
    if args.quick:
        args.num_prefixes, args.output_len, args.rounds, args.ks = 2, 16, 1, (3,)
    for method in ("eagle3", "dflash"):
        path = getattr(args, method)
        if path is not None and not (path / "config.json").is_file():
            ap.error(f"--{method} {path}: no drafter there (config.json missing); train one with `specray "
                     f"train-drafter --target {MODEL} --method {method} --out DIR`")
    if args.pages and args.dflash is None:
        ap.error("--pages runs the experiment on the trained DFlash: give --dflash")
    return args


def main(argv=None) -> int:
    from specray.models.presets import resolve_model
    from specray.models.tokenizer import load_tokenizer

    args = parse_args(argv)
    load_before = os.getloadavg()
    prefixes = load_prefixes(None, args.num_prefixes, load_tokenizer(resolve_model(MODEL)))
    rows = configs(args)
    best = run_rounds(rows, prefixes, args)
    report = table(rows, best, args.seed)
    print(f"\n{MODEL}, {len(prefixes)} HumanEval prefixes x {args.output_len} tokens, greedy, batch 1, float32, "
          f"fastest of {args.rounds} alternating round(s)\n")
    print(format_table(report, COLUMNS))
    lines = verdicts(report)
    print("\n".join(lines))
    pages = pages_experiment(args, report, prefixes) if args.pages else None
    load_after = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}, after: "
          f"{' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows_json = [{k: v for k, v in r.items() if k not in ("outputs",)} for r in report]
    args.json.write_text(json.dumps(to_json(dict(
        model=MODEL, num_prefixes=len(prefixes), output_len=args.output_len, rounds=args.rounds, ks=list(args.ks),
        eagle3=str(args.eagle3), dflash=str(args.dflash), rows=rows_json, verdicts=lines, pages=pages,
        machine=dict(cpu_count=os.cpu_count(), load_average_before=load_before, load_average_after=load_after,
                     platform=platform.platform()))), indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
