"""Adaptive speculation against plain decoding and every static k, cell by cell (issue 27's grid).

    python -m benchmarks.bench_adaptive [--eagle3 DIR] [--ks 1,3,5] [--concurrency 1,2,4,8,16]
        [--rounds 3] [--num-prompts 16] [--output-len 48] [--json bench-results/adaptive.json]
    python -m benchmarks.bench_adaptive --quick      # a smoke run: concurrency 1 and 4, one round

Target SmolLM2-135M (the shipped file), chat-formatted HumanEval problems, greedy, TP 1, 64-token
pages. The drafters (one group of rows each):

- ``ngram``: 4- down to 1-gram prompt lookup on the chats (real acceptance);
- ``eagle3``: the drafter ``specray train-drafter`` trained (``--eagle3 DIR``; left out without it);
- ``dflash-none`` and ``dflash-all``: a random-weight DFlash head with forced acceptance, every
  draft rejected (acceptance length 1) or every draft accepted (acceptance length k + 1): the two
  ends the controller must get right whatever the drafter proposes.

Per drafter: static k for each of ``--ks``, and adaptive (``SpecConfig(adaptive=True)``) with the
ceiling max(ks). A cell is (drafter, concurrency c): the prompts run in closed batches of c (c
requests in flight from the first token to the last, no arrivals). tok/s = tokens / wall time,
prefill included. Prefix caching is off in every configuration: each c runs the same prompts again,
so with it the later passes would be cache hits, and how many depends on the drafter (a
standalone drafter's pool publishes pages only once it has drafted on them, so a drafter held at
length 0 gets none): that would measure the cache, not speculation.

Runs are interleaved batch by batch (``measure``): drafter by drafter, the plain engine and each of
the group's engines are built once and kept, and per round and c each runs every batch of c chats
in turn, the order rotated by one engine every batch (since 12-07 19:00; reversed every other
batch before, which ran the engines at its ends, plain and the pinned one, two batches back to
back at every other boundary and the adaptive engine never); an engine's batches of a round are
its pass. Every ratio in a cell then compares runs of the same chats made within about a second
of each other.
Alternating whole engines (this benchmark before 12-06 11:22) let a burst of load fall on one
configuration, and identical configurations differed by up to 17% between runs; whole passes in
turn (until 12-07) still spread a cell's per-round ratios over 20%. Each engine runs in a process
of its own, as a user runs it (``benchmarks/engine_process.py``; until 12-07 13:32 they shared this
one and slowed each other), and spins at the CPU kernels' barriers (``pin_barrier_waits`` says
why). A cell reports each configuration's median
round, and ``per round`` the adaptive pass over the reference's in each round. ``lengths`` is the
adaptive run's histogram of chosen draft lengths 0..ceiling over its decode rows in the median
pass, ``off`` the steps it ran without drafting.

Targets (issue 27), checked per cell: adaptive >= 0.97 x max(plain, the best static k); where
every draft is rejected (``dflash-none``) >= 0.98 x plain; ngram at concurrency 1 >= the best
static k's speedup. And the length-0 step: adaptive engines (ngram, eagle3, dflash-none) with every
length pinned to 0 (``PinnedOff``) against plain, a step's cost <= 1.02x a plain engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.engine_process import EngineProcess
from benchmarks.own_thread import on_own_thread
from benchmarks.prompts import humaneval_chats
from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.models.drafter_presets import dflash_config, head_weights
from specray.models.loader import read_model_arch
from specray.models.presets import resolve_model, write_checkpoint

MODEL = "smollm2-135m"
LOOKUP = dict(prompt_lookup_min=1, prompt_lookup_max=4)
TARGET_CELL, TARGET_NO_ACCEPTANCE, TARGET_LENGTH0 = 0.97, 0.98, 1.02
PINNED_GROUPS = ("ngram", "eagle3", "dflash-none")


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One configuration: its drafter group, k (0: plain) and SpecConfig."""

    group: str
    k: int
    adaptive: bool
    spec: SpecConfig
    is_pinned_off: bool = False  # adaptive with every length pinned to 0: the length-0 step's own cost

    @property
    def label(self) -> str:
        if self.is_pinned_off:
            return f"{self.group} at length 0"
        return "plain" if not self.k else f"{self.group} {'adaptive <= ' if self.adaptive else 'k = '}{self.k}"


def engine_config(spec: SpecConfig) -> EngineConfig:
    """Every configuration's engine: 64-token pages, prefix caching off (the module docstring)."""
    return EngineConfig(model=MODEL, spec=spec,
                        kv=KVConfig(tokens_per_block=64, capacity_tokens=16384, enable_prefix_caching=False))


def write_dflash(root: Path) -> str:
    cfg = dflash_config(read_model_arch(resolve_model(MODEL)))
    write_checkpoint(root / "dflash", cfg, head_weights("dflash", cfg, seed=1))
    return str(root / "dflash")


def configurations(args, dflash: str) -> list[Row]:
    """Plain first; per drafter group its static ks, then adaptive at the ceiling."""
    groups: dict[str, dict] = {"ngram": dict(method="ngram", **LOOKUP)}
    if args.eagle3 is not None:
        groups["eagle3"] = dict(method="eagle3", draft_model=str(args.eagle3))
    groups["dflash-none"] = dict(method="dflash", draft_model=dflash, force=lambda k: 1.0)
    groups["dflash-all"] = dict(method="dflash", draft_model=dflash, force=lambda k: k + 1.0)
    if getattr(args, "groups", None):  # bench_length0 builds its own namespace, without groups
        unknown = set(args.groups) - set(groups)
        if unknown:
            raise SystemExit(f"--groups: {sorted(unknown)} not among {list(groups)} (eagle3 needs --eagle3)")
        groups = {g: kw for g, kw in groups.items() if g in args.groups}
    rows = [Row(group="plain", k=0, adaptive=False, spec=SpecConfig())]
    for group, kwargs in groups.items():
        kwargs = dict(kwargs)
        force = kwargs.pop("force", None)
        for k, adaptive in [(k, False) for k in args.ks] + [(max(args.ks), True)]:
            spec = SpecConfig(num_draft_tokens=k, adaptive=adaptive,
                              force_accepted_tokens=force(k) if force else None, **kwargs)
            rows.append(Row(group=group, k=k, adaptive=adaptive, spec=spec))
    # the length-0 step against a plain engine's (target <= 1.02x): the drafters that keep features
    # while off (eagle3, dflash) and the pool-less one
    for group in [g for g in groups if g in PINNED_GROUPS]:
        pinned = next(r for r in rows if r.group == group and r.adaptive)
        rows.append(Row(group=group, k=pinned.k, adaptive=True, spec=pinned.spec, is_pinned_off=True))
    return rows


class PinnedOff:
    """The controller with every decision 0, probes included; the rest (records, stats) its own."""

    def __init__(self, controller):
        self.controller = controller

    def __getattr__(self, name):
        return getattr(self.controller, name)

    def decide(self, seq_ids: list[int], cost, steps_left=None, resume_seconds=0.0) -> list[int]:
        return [0] * len(seq_ids)


def pin_off(llm: LLM) -> None:
    """Pin an adaptive engine's lengths to 0 (local launcher: its controller lives in the engine's process)."""
    adaptive = llm._engine.core.adaptive
    adaptive.controller = PinnedOff(adaptive.controller)


def adaptive_counts(llm: LLM) -> tuple[list[int], int]:
    stats = llm.stats().adaptive
    return list(stats.get("draft_length_histogram", [])), stats.get("num_steps_without_drafting", 0)


def run_pass(llm: LLM, chats: list, c: int, params: SamplingParams) -> dict:
    """The chats in closed batches of c: tok/s, and what the adaptive run chose meanwhile."""
    batches = [run_batch(llm, chats[i:i + c], params) for i in range(0, len(chats), c)]
    return joined(batches)


def run_batch(llm: LLM, chats: list, params: SamplingParams) -> dict:
    """One closed batch (every chat in flight from the first token to the last): its tokens and
    wall time, and the adaptive run's choices meanwhile."""
    hist0, off0 = adaptive_counts(llm)
    start = time.perf_counter()
    outs = llm.chat(chats, params)
    wall = time.perf_counter() - start
    hist1, off1 = adaptive_counts(llm)
    return dict(num_tokens=sum(len(o.token_ids) for o in outs), wall_s=wall,
                lengths=[b - a for a, b in zip(hist0 or [0] * len(hist1), hist1)], off=off1 - off0)


def joined(batches: list[dict]) -> dict:
    """A pass from its batches: tok/s over their summed wall time."""
    tokens, wall = sum(b["num_tokens"] for b in batches), sum(b["wall_s"] for b in batches)
    lengths = [sum(col) for col in zip(*(b["lengths"] for b in batches))]
    return dict(tok_s=tokens / wall, num_tokens=tokens, lengths=lengths, off=sum(b["off"] for b in batches))


def pin_barrier_waits() -> str:
    """Every engine of the run spins at the kernels' barriers unless SPECRAY_CPU_BARRIER_WAITS says
    otherwise (the engines' processes inherit it). Why, from when the engines shared one process:
    an engine whose chooser sleeps parks an OpenMP pool (workers/barrier_waits.py), and libgomp
    counts threads process-wide, so one engine's choice slowed the others' steps (measured 12-07:
    11.3 ms decode steps against plain's 5.6, for whole passes). In processes of their own, each
    engine's chooser would still see the previous engine's threads spin down (~3 ms) at every
    batch boundary, a competitor that recurs every second, and sleep in response: the grid would
    time the chooser's holds, not speculation. A user's process holds one engine, which spins on
    free cores."""
    return os.environ.setdefault("SPECRAY_CPU_BARRIER_WAITS", "spin")


def open_engine(row: Row, chats: list) -> LLM:
    """A configuration's engine, warmed up (in its own process: ``measure``)."""
    llm = LLM(engine_config(row.spec))
    if row.is_pinned_off:
        pin_off(llm)
    llm.chat(chats[:1], SamplingParams(max_tokens=8))  # warm-up
    return llm


def adaptive_stats_of(llm: LLM) -> dict:
    return llm.stats().adaptive


def interleaved_passes(engines: dict, chats: list, c: int, round_index: int, params: SamplingParams,
                       run=run_batch) -> dict:
    """One pass per engine over the chats in closed batches of c, run batch by batch in turn, the
    order rotated by one engine every batch (and every round): each engine takes every place and
    none runs two batches back to back (the module docstring says why). ``run(llm, chats,
    params)`` runs a batch in the engine's process; per engine, the list of what it returned
    (``joined`` makes run_batch's a pass)."""
    keys = list(engines)
    batches: dict = {key: [] for key in keys}
    for b, start in enumerate(range(0, len(chats), c)):
        turn = (b + round_index) % len(keys)
        for key in keys[turn:] + keys[:turn]:
            batches[key].append(engines[key].call(run, chats[start:start + c], params))
    return batches


def measure(rows: list[Row], chats: list, args) -> tuple[dict[tuple[str, int, int], list[dict]], dict[str, dict]]:
    """passes[(group, row index, c)]: one pass per round, interleaved with the group's other engines;
    and each group's adaptive engine's ``stats().adaptive`` at the end of its block (the fitted
    costs and the one-row table it planned with).

    Every engine runs in a process of its own (``EngineProcess``: as a user runs one; engines
    sharing a process slowed each other, benchmarks/engine_process.py). Group by group, the plain
    engine and every engine of the group are built once and kept; per round
    and c they run each batch of c chats in turn (the order rotated by one every batch, so each
    takes every place and none runs two batches back to back: bench_length0's docstring), and a pass
    is an engine's batches of that round: every ratio in a cell compares runs of the same chats
    made within about a second of each other, so a burst of load on this shared machine falls on
    every configuration alike (whole passes in turn, ~10 s each, let one fall on a single
    configuration: per-round ratios spread over 20% in the 12-07 08:34 grid). The plain engine is
    built once and measured in every group's block (its ratios are the block's own).
    """
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    passes: dict[tuple[str, int, int], list[dict]] = {}
    adaptive_stats: dict[str, dict] = {}
    plain = EngineProcess(rows[0].label, open_engine, rows[0], chats)
    try:
        for group in dict.fromkeys(r.group for r in rows[1:]):
            members = [0] + [i for i, r in enumerate(rows) if r.group == group]
            engines = {0: plain}
            try:
                for i in members[1:]:
                    engines[i] = EngineProcess(rows[i].label, open_engine, rows[i], chats)
                for r in range(args.rounds):
                    for c in args.concurrency:
                        for i, batches in interleaved_passes(engines, chats, c, r, params).items():
                            passes.setdefault((group, i, c), []).append(joined(batches))
                    print(f"{group}: round {r + 1}/{args.rounds}: " + "; ".join(
                        f"{rows[i].label} " + " ".join(f"{passes[(group, i, c)][-1]['tok_s']:.0f}"
                                                      for c in args.concurrency) for i in members), flush=True)
                adaptive = next(i for i in members if rows[i].adaptive and not rows[i].is_pinned_off)
                adaptive_stats[group] = engines[adaptive].call(adaptive_stats_of)
            finally:
                for i in members[1:]:
                    if i in engines:
                        engines[i].close()
    finally:
        plain.close()
    return passes, adaptive_stats


def median_pass(results: list[dict]) -> dict:
    """The round whose tok/s is the median (the lower middle for an even count), with every round's tok/s."""
    ranked = sorted(results, key=lambda x: x["tok_s"])
    return dict(ranked[(len(ranked) - 1) // 2], rounds=[x["tok_s"] for x in results])


def cells(rows: list[Row], passes: dict, args) -> list[dict]:
    """One line per (drafter group, c): plain, each static k, adaptive, the ratio and verdict."""
    out = []
    for group in dict.fromkeys(r.group for r in rows[1:]):
        idx = [i for i, r in enumerate(rows) if r.group == group and not r.is_pinned_off]
        static = [i for i in idx if not rows[i].adaptive]
        adaptive = next(i for i in idx if rows[i].adaptive)
        for c in args.concurrency:
            plain = median_pass(passes[(group, 0, c)])
            by_k = {rows[i].k: median_pass(passes[(group, i, c)]) for i in static}
            best_k = max(by_k, key=lambda k: by_k[k]["tok_s"])
            got = median_pass(passes[(group, adaptive, c)])
            reference = max(plain, by_k[best_k], key=lambda x: x["tok_s"])  # plain on a tie
            cell = dict(drafter=group, c=c, plain=plain["tok_s"], **{f"k={k}": v["tok_s"] for k, v in by_k.items()},
                        best_k=best_k, adaptive=got["tok_s"], ratio=got["tok_s"] / reference["tok_s"],
                        round_ratios=round_ratios(got, reference),
                        lengths=got["lengths"], off=got["off"])
            cell["verdicts"] = verdicts(group, c, cell, plain["tok_s"], by_k[best_k]["tok_s"])
            out.append(cell)
    return out


def round_ratios(x: dict, reference: dict) -> list[float]:
    return [a / b for a, b in zip(x["rounds"], reference["rounds"])]


def length0_cells(rows: list[Row], passes: dict, args) -> list[dict]:
    """Per pinned group and c: a plain step's cost against the length-0 step's (tok/s ratio of medians)."""
    out = []
    for i, row in enumerate(rows):
        if row.is_pinned_off:
            for c in args.concurrency:
                plain, at0 = median_pass(passes[(row.group, 0, c)]), median_pass(passes[(row.group, i, c)])
                ratio = plain["tok_s"] / at0["tok_s"]
                out.append(dict(drafter=row.group, c=c, plain=plain["tok_s"], length0=at0["tok_s"], cost=ratio,
                                round_ratios=round_ratios(plain, at0), met=ratio <= TARGET_LENGTH0))
    return out


def verdicts(group: str, c: int, cell: dict, plain: float, best_static: float) -> list[str]:
    checks = [(f"adaptive >= {TARGET_CELL} x max(plain, best static)", cell["ratio"] >= TARGET_CELL)]
    if group == "dflash-none":
        checks.append((f"adaptive >= {TARGET_NO_ACCEPTANCE} x plain", cell["adaptive"] >= TARGET_NO_ACCEPTANCE * plain))
    if group == "ngram" and c == 1:
        checks.append(("adaptive speedup >= best static k's", cell["adaptive"] >= best_static))
    return [f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks]


def format_cells(cells_: list[dict], ks: list[int]) -> str:
    head = ["drafter", "c", "plain"] + [f"k={k}" for k in ks] + ["adaptive", "x best", "per round", "lengths 0..k",
                                                               "off", "met"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for x in cells_:
        met = "yes" if all(v.endswith(": met") for v in x["verdicts"]) else "NO"
        lines.append(" | ".join([x["drafter"], str(x["c"]), f"{x['plain']:.1f}"] + [f"{x[f'k={k}']:.1f}" for k in ks]
                                + [f"{x['adaptive']:.1f}", f"{x['ratio']:.2f}", spread(x["round_ratios"]),
                                   "/".join(map(str, x["lengths"])),
                                   str(x["off"]), met]))
    return "\n".join(lines)


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: concurrency 1 and 4, 8 prompts, one round")
    ap.add_argument("--eagle3", type=Path, default=None, help="a drafter trained by specray train-drafter")
    ap.add_argument("--ks", default="1,3,5", help="the static draft lengths; adaptive's ceiling is their max")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--groups", default="", help="only these drafter groups (comma-separated; default: all): "
                                                 "a partial grid, for a change that touches some cells")
    ap.add_argument("--num-prompts", type=int, default=16, help="HumanEval problems 0..N-1")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench-results/adaptive.json"))
    args = ap.parse_args(argv)
    args.ks = sorted(int(k) for k in args.ks.split(","))
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.groups = [g for g in args.groups.split(",") if g]
    if args.quick:
        args.concurrency, args.num_prompts, args.rounds = [1, 4], 8, 1
    barrier_waits = pin_barrier_waits()
    chats = humaneval_chats(args.num_prompts)
    with tempfile.TemporaryDirectory(prefix="specray-bench-adaptive-") as root:
        rows = configurations(args, on_own_thread(write_dflash, Path(root)))  # torch work off the main thread
        start = time.time()
        passes, adaptive_stats = measure(rows, chats, args)
    result = cells(rows, passes, args)
    print(f"\n{MODEL}, HumanEval problems 0..{args.num_prompts - 1} (chat), {args.output_len} new tokens "
          f"(EOS ignored), greedy, TP 1, {torch.get_num_threads()} thread(s), barrier waits {barrier_waits}, "
          f"median of {args.rounds} round(s) interleaved batch by batch, {time.time() - start:.0f} s; tok/s\n")
    print(format_cells(result, args.ks))
    off = length0_cells(rows, passes, args)
    print(f"\nlength-0 step cost (plain tok/s / pinned-at-0 tok/s; target <= {TARGET_LENGTH0})\n")
    print("\n".join(["drafter | c | plain | at length 0 | cost | per round | met", "---|---|---|---|---|---|---"] + [
        f"{x['drafter']} | {x['c']} | {x['plain']:.1f} | {x['length0']:.1f} | {x['cost']:.3f} | "
        f"{spread(x['round_ratios'])} | "
        f"{'yes' if x['met'] else 'NO'}" for x in off]))
    missed = [f"{x['drafter']} c={x['c']}: {v}" for x in result for v in x["verdicts"] if not v.endswith(": met")]
    missed += [f"{x['drafter']} c={x['c']}: length-0 cost {x['cost']:.3f} > {TARGET_LENGTH0}"
               for x in off if not x["met"]]
    print("\n" + ("every cell meets its targets" if not missed else "NOT met:\n  " + "\n  ".join(missed)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(
        model=MODEL, prompts=f"HumanEval 0..{args.num_prompts - 1}", output_len=args.output_len, ks=args.ks,
        concurrency=args.concurrency, groups=args.groups or "all", rounds=args.rounds, quick=args.quick,
        threads=torch.get_num_threads(), barrier_waits=barrier_waits, interleaved="batch by batch",
        machine=platform.processor() or platform.machine(), cells=result, length0=off,
        adaptive_stats=adaptive_stats,
        passes=[dict(block=group, label=rows[i].label, c=c, passes=x) for (group, i, c), x in passes.items()]),
        indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
