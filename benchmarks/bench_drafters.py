"""Issue 29's targets: every drafting method at forced acceptance against plain decoding, engines
interleaved round by round, with the drafter's bytes-based ideal beside each speedup.

    python -m benchmarks.bench_drafters [--methods draft_model,eagle3,dflash,dspark,mtp]
        [--batches 1,4] [--k 3] [--force 3] [--rounds 5] [--output-len 96] [--json PATH]
    python -m benchmarks.bench_drafters --tp-check [--rounds 5]   # plain decoding, TP 2 against TP 1

Target ``mid-llama`` (TP 1, local: rank 0 in this process), each method's preset drafter (``mtp``
loads ``mid-llama-mtp``, the same target layers plus its MTP module, and is compared with plain
decoding of that model), greedy, random prompts, forced acceptance (every method verifies the
same rows and emits ``--force`` tokens a step whatever its random weights propose).

Per batch size every engine (plain and one per method) is built once and kept; each round runs
one generation on each, in turn, the order reversed every other round, so the machine's swings
fall on all of them alike. A method's speedup in a round is the plain TPOT of that round over
its own; a cell reports the median round, and every round's ratio. Rank 0's SpecRunner is timed
(profile_spec_cycle.CycleTimer) for the step's parts in the median round:

    ideal B = AL * t_plain_step / (draft bytes / GB/s + t_verify)      (drafter_bytes.py)
    eff B   = speedup / ideal B

``--tp-check`` measures the issue's no-regression line instead: plain decoding of mid-llama at TP 2
(two processes, the mp launcher) against TP 1 on the same cores, interleaved the same way, at
batch 1 (the ratio is TP 1's TPOT over TP 2's: above 1, TP 2 is faster).

with t_verify the measured verify (forward and head) and GB/s the batch-1 GEMV bandwidth
measured in this run (the faster of before and after the grid). ``draft ms`` is the measured
drafting (forward, head and sampling) and ``bytes ms`` what the drafter's bytes take at that
bandwidth. The bytes ignore the arithmetic: a drafter whose rows make its GEMMs compute-bound
(DFlash's 16-slot block in its first layer, any drafter at batch 4) cannot reach ideal B on a
CPU whose FMAs are busy at a few rows (docs/cpu-kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import drafter_bytes
from benchmarks.bench_spec import VOCAB_SIZE, prompts_for
from benchmarks.profile_spec_cycle import PRESETS, TARGET, CycleTimer
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models.presets import materialize

MTP_TARGET = "mid-llama-mtp"


def target_of(method: str | None) -> str:
    return MTP_TARGET if method == "mtp" else TARGET


def build(method: str | None, args, tp: int = 1) -> LLM:
    spec = SpecConfig()
    if method is not None:
        spec = SpecConfig(method=method, draft_model=PRESETS[method], num_draft_tokens=args.k,
                          force_accepted_tokens=args.force)
    return LLM(EngineConfig(model=target_of(method), kv=KVConfig(tokens_per_block=64, capacity_tokens=16384),
                            parallel=ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local"), spec=spec))


def tp_check(args) -> dict:
    """Plain decoding at TP 1 and TP 2, one generation each per round in turn (order reversed
    every other round): every round's TP 1 TPOT over TP 2's, and the median."""
    prompts = prompts_for(1, args.input_len, VOCAB_SIZE)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    engines = {}
    try:
        for tp in (1, 2):
            engines[tp] = build(None, args, tp)
            engines[tp].generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        tpot: dict[int, list[float]] = {1: [], 2: []}
        for r in range(args.rounds):
            for tp in (1, 2) if r % 2 == 0 else (2, 1):
                outs = engines[tp].generate(prompts, params)
                tpot[tp].append(statistics.median(o.metrics["tpot_s"] for o in outs) * 1e3)
    finally:
        for llm in engines.values():
            llm.close()
    ratios = [one / two for one, two in zip(tpot[1], tpot[2])]
    return dict(tpot_ms=tpot, round_ratios=ratios, ratio=statistics.median(ratios))


def one_pass(llm: LLM, prompts: list[list[int]], args) -> dict:
    """One timed generation: median TPOT (ms) and, for a speculative engine, its step's parts."""
    worker = llm._engine.worker
    timer = CycleTimer(worker.spec, worker.model) if worker.spec is not None else None
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    out = {"tpot_ms": statistics.median(o.metrics["tpot_s"] for o in outs) * 1e3}
    if timer is not None:
        out["parts"] = timer.breakdown()
    return out


def median_round(ratios: list[float]) -> int:
    """The index of the median round (the lower middle one for an even count)."""
    order = sorted(range(len(ratios)), key=lambda i: ratios[i])
    return order[(len(order) - 1) // 2]


def summarize(method: str, batch: int, passes: list[dict], plains: list[dict], draft_bytes: int, gbps: float,
              acceptance_length: float) -> dict:
    """A cell from a method's passes and the plain passes of the same rounds (pure: tested)."""
    ratios = [p["tpot_ms"] / s["tpot_ms"] for p, s in zip(plains, passes)]
    mid = median_round(ratios)
    parts, plain_ms = passes[mid]["parts"], plains[mid]["tpot_ms"]
    cell = dict(method=method, batch=batch, speedup=ratios[mid], round_ratios=ratios, plain_ms=plain_ms,
                step_ms=parts["step"], draft_ms=parts["draft fwd"] + parts["draft head"] + parts["sample"],
                verify_ms=parts["verify fwd"] + parts["verify head"], draft_bytes=draft_bytes,
                acceptance_length=acceptance_length, parts=parts)
    at_bandwidth(cell, gbps)
    return cell


def at_bandwidth(cell: dict, gbps: float) -> None:
    """A cell's bytes columns at ``gbps``: the drafting's time at its bytes, ideal B and eff B."""
    cell["bytes_ms"] = cell["draft_bytes"] / (gbps * 1e9) * 1e3
    cell["ideal_bytes"] = drafter_bytes.ideal_from_bytes(cell["acceptance_length"], cell["plain_ms"],
                                                         cell["draft_bytes"], gbps, cell["verify_ms"])
    cell["eff_bytes"] = cell["speedup"] / cell["ideal_bytes"]


def measure_batch(batch: int, methods: list[str], args) -> list[dict]:
    prompts = prompts_for(batch, args.input_len, VOCAB_SIZE)
    plains = sorted({target_of(m) for m in methods} | {TARGET})
    names = [("plain", t) for t in plains] + [(m, target_of(m)) for m in methods]
    engines = {}
    try:
        for name in names:
            engines[name] = build(None if name[0] == "plain" else name[0], args)
            engines[name].generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        passes: dict[tuple[str, str], list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                passes[name].append(one_pass(engines[name], prompts, args))
            print(f"  batch {batch} round {r + 1}: " + ", ".join(
                f"{m}{'' if t == TARGET else f' ({t})'} {passes[m, t][-1]['tpot_ms']:.1f} ms" for m, t in names),
                file=sys.stderr, flush=True)
    finally:
        for llm in engines.values():
            llm.close()
    cells = []
    for method in methods:
        target = target_of(method)
        draft_bytes = drafter_bytes.checkpoint_draft_bytes(method, args.k, materialize(PRESETS[method] or target),
                                                           materialize(target))
        cells.append(summarize(method, batch, passes[method, target], passes["plain", target], draft_bytes,
                               args.gbps, args.force))
    return cells


def format_table(cells: list[dict]) -> str:
    head = ["method", "batch", "speedup (median round)", "per round", "ideal B", "eff B", "draft ms", "bytes ms",
            "verify ms", "step ms", "plain ms"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for c in cells:
        lines.append("| " + " | ".join([
            c["method"], str(c["batch"]), f"{c['speedup']:.2f}", " ".join(f"{x:.2f}" for x in c["round_ratios"]),
            f"{c['ideal_bytes']:.2f}", f"{c['eff_bytes']:.2f}", f"{c['draft_ms']:.1f}", f"{c['bytes_ms']:.1f}",
            f"{c['verify_ms']:.1f}", f"{c['step_ms']:.1f}", f"{c['plain_ms']:.1f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="draft_model,eagle3,dflash,dspark,mtp")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--force", type=float, default=3.0, help="forced acceptance length (drafts accepted + 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--json", type=Path, default=Path("bench-results/drafters.json"))
    ap.add_argument("--tp-check", action="store_true", help="plain decoding at TP 2 against TP 1 instead")
    args = ap.parse_args(argv)
    if args.tp_check:
        started, load_before = time.strftime("%H:%M"), os.getloadavg()[0]
        result = tp_check(args)
        print(f"mid-llama plain decoding, batch 1, {args.rounds} interleaved rounds, {started}-{time.strftime('%H:%M')}"
              f" UTC, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}: TP 2 at {result['ratio']:.2f}x TP 1's speed "
              f"(per round {' '.join(f'{x:.2f}' for x in result['round_ratios'])}; TPOT ms TP 1 "
              f"{' '.join(f'{x:.1f}' for x in result['tpot_ms'][1])}, "
              f"TP 2 {' '.join(f'{x:.1f}' for x in result['tpot_ms'][2])})")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(PRESETS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}: choose from {sorted(PRESETS)}")
    started, load_before = time.strftime("%H:%M"), os.getloadavg()[0]
    gbps_before = drafter_bytes.measure_gbps()
    args.gbps = gbps_before
    cells = [c for b in (int(x) for x in args.batches.split(",")) for c in measure_batch(b, methods, args)]
    gbps_after = drafter_bytes.measure_gbps()
    if gbps_after > args.gbps:  # the faster reading: the more demanding ideal
        args.gbps = gbps_after
        for c in cells:
            at_bandwidth(c, args.gbps)
    print(f"\nmid-llama TP 1, k = {args.k}, forced AL {args.force:g}, {args.rounds} interleaved rounds, "
          f"{started}-{time.strftime('%H:%M')} UTC, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"GEMV {gbps_before:.1f} GB/s before, {gbps_after:.1f} after ({args.gbps:.1f} counts)\n")
    print(format_table(cells))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(k=args.k, force=args.force, rounds=args.rounds, output_len=args.output_len,
                                         gbps=dict(before=gbps_before, after=gbps_after), cells=cells), indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
