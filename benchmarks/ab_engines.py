"""Engines of this checkout against another revision's, each in a process of its own, batch by batch in turn.

    python -m benchmarks.ab_engines --base 484f485 [--concurrency 1,4,8] [--rounds 3]
        [--configs plain,ngram-length0] [--json bench-results/ab_engines.json]

``benchmarks/ab_cpu_step.py`` times the C kernels of two revisions on one step in one process;
this runs whole engines as a user does, where the kernels meet the engine's Python, its
allocator's history and the rest of the step (12-08: per-layer mallocs in the fused kernel ran
5-11% slower after an adaptive engine's start-up probe, which no isolated step showed).

``--base``'s ``specray`` package (``git archive``) goes to a temporary directory; each engine's
process puts its checkout first on ``sys.path`` before it imports specray, so the two differ in
everything under ``specray/`` (the CPU kernels are built per source, models/cpu_kernels.py) and
share this checkout's benchmark code. Target SmolLM2-135M (the shipped file), chat-formatted
HumanEval problems, greedy, EOS ignored, 64-token pages, prefix caching off
(``bench_adaptive.engine_config``). Configurations: ``plain``, and ``ngram-length0``: an adaptive
n-gram engine (ceiling 5) with every draft length pinned to 0, so its steps are plain steps
after its start-up probe.

Per round and concurrency c the chats run in closed batches of c, the engines in turn, the order
rotated by one every batch (``bench_adaptive.interleaved_passes``), so each ratio compares
batches run within about a second of each other. Reported per (configuration, c): each
revision's median round of tok/s (wall time, prefill included) and of the mean decode step
(a step whose rows are one a sequence; the engine's ``_step``), and this checkout's over the
base's, per round.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.engine_process import EngineProcess

# nothing at module level imports specray: an engine's process imports this module to find
# open_from, which puts its checkout first on sys.path before specray is imported
CONFIGS = ("plain", "ngram-length0")


def open_from(root: str, config: str, chats: list):
    """An engine of ``config`` built from the specray package under ``root`` (in the engine's process)."""
    sys.path.insert(0, root)
    import specray
    from benchmarks.bench_adaptive import LOOKUP, engine_config, pin_off
    from specray import LLM, SamplingParams, SpecConfig
    if not specray.__file__.startswith(root):
        raise RuntimeError(f"specray came from {specray.__file__}, not from {root}")
    spec = SpecConfig() if config == "plain" else SpecConfig(method="ngram", num_draft_tokens=5, adaptive=True, **LOOKUP)
    llm = LLM(engine_config(spec))
    if config == "ngram-length0":
        pin_off(llm)
    llm.chat(chats[:1], SamplingParams(max_tokens=8))  # warm-up
    time_decode_steps(llm)
    return llm


def time_decode_steps(llm) -> None:
    """Sum the time of the engine's decode steps (every row one sequence's) in ``core.decode_s``."""
    core = llm._engine.core
    step = core._step
    core.decode_s, core.num_decode_steps = 0.0, 0

    def timed(plan):
        start = time.perf_counter()
        tokens = step(plan)
        if plan.seq_ids and sum(len(ids) for ids in plan.input_ids) == len(plan.seq_ids):
            core.decode_s += time.perf_counter() - start
            core.num_decode_steps += 1
        return tokens
    core._step = timed


def run_batch(llm, chats: list, params) -> dict:
    """One closed batch: its tokens, wall time and decode steps' time."""
    core = llm._engine.core
    decode_s, steps = core.decode_s, core.num_decode_steps
    start = time.perf_counter()
    outs = llm.chat(chats, params)
    return dict(num_tokens=sum(len(o.token_ids) for o in outs), wall_s=time.perf_counter() - start,
                decode_s=core.decode_s - decode_s, num_decode_steps=core.num_decode_steps - steps)


def joined(batches: list[dict]) -> dict:
    tokens, wall = sum(b["num_tokens"] for b in batches), sum(b["wall_s"] for b in batches)
    steps = sum(b["num_decode_steps"] for b in batches)
    return dict(tok_s=tokens / wall, decode_ms=1e3 * sum(b["decode_s"] for b in batches) / max(steps, 1))


def export_base(revision: str, root: Path) -> str:
    """``revision``'s specray package under ``root``; returns the directory to put on sys.path."""
    archive = subprocess.run(["git", "archive", revision, "specray"], check=True, capture_output=True,
                             timeout=120).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return str(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a git revision of this repository")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--configs", default="plain", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench-results/ab_engines.json"))
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: {sorted(unknown)} not among {list(CONFIGS)}")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    from benchmarks.bench_adaptive import interleaved_passes, pin_barrier_waits
    from benchmarks.prompts import humaneval_chats
    from specray import SamplingParams
    barrier_waits = pin_barrier_waits()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    chats = humaneval_chats(args.num_prompts)
    head = str(Path(__file__).resolve().parents[1])
    passes: dict[tuple[str, str, int], list[dict]] = {}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="specray-ab-") as tmp:
        trees = {"base": export_base(args.base, Path(tmp)), "head": head}
        for config in configs:
            engines = {}
            try:
                for side, root in trees.items():
                    engines[side] = EngineProcess(f"{side} {config}", open_from, root, config, chats)
                for r in range(args.rounds):
                    for c in concurrency:
                        batches = interleaved_passes(engines, chats, c, r, params, run=run_batch)
                        for side, one in batches.items():
                            passes.setdefault((config, side, c), []).append(joined(one))
                    print(f"{config}: round {r + 1}/{args.rounds}", flush=True)
            finally:
                for engine in engines.values():
                    engine.close()
    rows = []
    for config in configs:
        for c in concurrency:
            base, now = passes[(config, "base", c)], passes[(config, "head", c)]
            rows.append(dict(config=config, c=c,
                             base_tok_s=statistics.median(x["tok_s"] for x in base),
                             head_tok_s=statistics.median(x["tok_s"] for x in now),
                             base_decode_ms=statistics.median(x["decode_ms"] for x in base),
                             head_decode_ms=statistics.median(x["decode_ms"] for x in now),
                             tok_s_ratios=[b["tok_s"] / a["tok_s"] for a, b in zip(base, now)],
                             decode_ratios=[b["decode_ms"] / a["decode_ms"] for a, b in zip(base, now)]))
    print(f"\nbase {args.base} against this checkout; SmolLM2-135M, HumanEval problems 0..{args.num_prompts - 1} "
          f"(chat), {args.output_len} new tokens, greedy, barrier waits {barrier_waits}, {args.rounds} round(s) "
          f"interleaved batch by batch, {time.time() - start:.0f} s\n")
    print("config | c | base tok/s | head tok/s | head/base per round | base decode ms | head decode ms | "
          "head/base per round\n---|---|---|---|---|---|---|---")
    for x in rows:
        print(f"{x['config']} | {x['c']} | {x['base_tok_s']:.1f} | {x['head_tok_s']:.1f} | "
              f"{' '.join(f'{v:.3f}' for v in x['tok_s_ratios'])} | {x['base_decode_ms']:.2f} | "
              f"{x['head_decode_ms']:.2f} | {' '.join(f'{v:.3f}' for v in x['decode_ratios'])}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(base=args.base, head=head, rounds=args.rounds, concurrency=concurrency,
                                         configs=configs, barrier_waits=barrier_waits, machine=platform.processor(),
                                         rows=rows, passes={f"{k[0]}|{k[1]}|{k[2]}": v for k, v in passes.items()}),
                                    indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
