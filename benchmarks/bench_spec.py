"""Speculative decoding on mid-llama: specray's drafters against plain decoding and against
transformers' assisted generation on the same draft pair, in one run.

    python -m benchmarks.bench_spec            # --quick (default): a few minutes on 2 cores
    python -m benchmarks.bench_spec --full     # the whole grid of issue 6 at TP=1
    python -m benchmarks.bench_spec --plot bench-results/spec.png
    python -m benchmarks.bench_spec --model smollm2-135m [--quick]   # SmolLM2 on HumanEval: every
        # method (plain, ngram, draft_model, eagle3, dflash, dspark); see spec_humaneval.py

Target ``mid-llama`` (156M parameters, float32); drafters ``mid-llama-draft`` (draft_model:
the target's embedding, first layer and LM head) and ``mid-llama-dflash`` (random-weight
DFlash head). Every run is greedy with ``ignore_eos``, random prompts of ``--input-len``.
Rows: tok/s (batch * output_len / wall, prefill included), acceptance length (AL),
``speedup`` (tok/s over plain decoding at the same batch and TP), ``decode x`` (plain
TPOT / speculative TPOT: the decode phase only), and the *ideal* decode speedup implied by
the measured step times:

    ideal = AL * t_plain_step / (t_draft + t_verify)

where t_plain_step is plain decoding's median TPOT, and t_draft and t_verify the mean wall
times of the drafting and of the target's verify forward per speculative step (timed by
wrapping rank 0's SpecRunner methods; only at TP=1, where rank 0 runs in this process; unit
tests never time anything). ``efficiency`` = decode x / ideal: what the step loop loses on
top of the two forwards (scheduling, rollback, verification, plan traffic). That ideal takes the
drafter's own measured time, so a slow drafter does not show there: ``ideal B`` and ``eff B``
take the drafting at its weight bytes over the GEMV bandwidth measured in this run instead
(benchmarks/drafter_bytes.py has the rule).

transformers' assisted generation (``assistant_model``, constant ``num_assistant_tokens``
= k) runs at batch 1 on the same pair against specray's draft_model, next to transformers'
plain greedy generate, in ``--rounds`` alternating rounds (specray, assisted, plain; the
fastest of each counts), in this process with the same threads as specray's TP=1 rows
(default: every core).

Forced-acceptance rows fix AL whatever the drafts are, so it measures the
engine rather than the random-weight drafters; it changes the output tokens (the quick
grid runs force 3; --full adds 6 where k allows). The machine may be shared: each row is
the fastest of ``--repeats`` runs, not a controlled measurement.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import drafter_bytes
from benchmarks.spec_report import StepTimer, format_table
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor import spec_metrics
from specray.models.presets import materialize

TARGET = "mid-llama"
VOCAB_SIZE = 32000  # mid-llama's
DRAFTERS = {"draft_model": "mid-llama-draft", "dflash": "mid-llama-dflash"}
COLUMNS = [("tp", "tp", "d"), ("method", "method", "s"), ("k", "k", "s"), ("force", "force", "s"), ("batch", "batch", "d"),
           ("tok_s", "tok/s", ".1f"), ("acceptance_length", "AL", ".2f"), ("speedup", "speedup", ".2f"),
           ("decode_speedup", "decode x", ".2f"),
           ("ideal_speedup", "ideal", ".2f"), ("efficiency", "eff", ".2f"), ("ideal_bytes_speedup", "ideal B", ".2f"),
           ("bytes_efficiency", "eff B", ".2f"), ("draft_ms", "draft ms", ".1f"),
           ("verify_ms", "verify ms", ".1f"), ("step_ms", "step ms", ".1f")]


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def run_specray(spec: SpecConfig | None, batch: int, tp: int, args) -> dict:
    cfg = EngineConfig(model=TARGET, kv=KVConfig(tokens_per_block=64, capacity_tokens=16384),
                       parallel=ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local"),
                       spec=spec or SpecConfig())
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    with LLM(cfg) as llm:
        prompts = prompts_for(batch, args.input_len, VOCAB_SIZE)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        # rank 0's runner is in this process only at TP=1 (mp ranks are child processes)
        runner = getattr(getattr(llm._engine, "worker", None), "spec", None)
        wall, timer = float("inf"), None
        for _ in range(args.repeats):  # the fastest run is the one least disturbed by other processes
            this_timer = StepTimer(runner) if runner is not None else None
            start = time.perf_counter()
            these = llm.generate(prompts, params)
            if time.perf_counter() - start < wall:
                wall, outs, timer = time.perf_counter() - start, these, this_timer
    agg = spec_metrics.aggregate([o.metrics for o in outs])
    row = dict(tp=tp, batch=batch, tok_s=batch * args.output_len / wall, wall_s=wall,
               tpot_ms=statistics.median(o.metrics["tpot_s"] for o in outs) * 1e3,
               tokens=[o.token_ids for o in outs], acceptance_length=agg.get("acceptance_length", 1.0),
               acceptance_per_position=agg.get("acceptance_per_position", []))
    if spec is None:  # plain: one step per token after the first
        row["step_ms"] = row["tpot_ms"]
    if timer is not None and timer.num_steps:
        row.update(draft_ms=timer.draft_s / timer.num_steps * 1e3, verify_ms=timer.verify_s / timer.num_steps * 1e3,
                   step_ms=row["tpot_ms"] * row["acceptance_length"])
    return row


def head_to_head(k: int, args) -> dict:
    """Batch 1 on the same pair: specray's draft_model, transformers' assisted generation and
    transformers' plain greedy generate, in ``--rounds`` alternating rounds, so other
    processes' load falls on all three alike (as in bench_vs_transformers). The fastest round
    of each counts; every round's ratio is kept."""
    import transformers

    load = lambda name: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        materialize(name), dtype=torch.float32).eval()
    target, assistant = load(TARGET), load(DRAFTERS["draft_model"])
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    prompt = prompts_for(1, args.input_len, VOCAB_SIZE)
    ids = torch.tensor(prompt)
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, temperature=None, top_p=None)
    spec = SpecConfig(method="draft_model", draft_model=DRAFTERS["draft_model"], num_draft_tokens=k)
    cfg = EngineConfig(model=TARGET, kv=KVConfig(tokens_per_block=64, capacity_tokens=16384), spec=spec)
    with LLM(cfg) as llm:
        def specray(n: int) -> list[int]:
            return llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids

        def hf(extra: dict):
            def run(n: int) -> list[int]:
                with torch.inference_mode():
                    out = target.generate(ids, max_new_tokens=n, min_new_tokens=n, **common, **extra)
                return out[0, ids.shape[1]:].tolist()
            return run

        sides = {"specray": specray, "hf_assisted": hf({"assistant_model": assistant}), "hf_plain": hf({})}
        tokens, rounds = {}, []
        for run in sides.values():
            run(4)  # warm-up
        for _ in range(args.rounds):
            walls = {}
            for name, run in sides.items():
                start = time.perf_counter()
                tokens[name] = run(args.output_len)
                walls[name] = time.perf_counter() - start
            rounds.append(walls)
    out = {name: dict(tok_s=args.output_len / min(r[name] for r in rounds), tokens=tokens[name]) for name in sides}
    out["round_ratios"] = [r["hf_assisted"] / r["specray"] for r in rounds]
    out["round_tok_s"] = [{name: args.output_len / wall for name, wall in r.items()} for r in rounds]
    return out


def measure_row(spec: SpecConfig, batch: int, tp: int, base: dict, args) -> dict:
    r = run_specray(spec, batch, tp, args)
    r["draft_bytes"] = drafter_bytes.checkpoint_draft_bytes(spec.method, spec.num_draft_tokens,
                                                            materialize(spec.draft_model), materialize(TARGET))
    force = spec.force_accepted_tokens
    r.update(method=spec.method, k=str(spec.num_draft_tokens), force="-" if force is None else f"{force:g}",
             speedup=r["tok_s"] / base["tok_s"], decode_speedup=base["tpot_ms"] / r["tpot_ms"])
    if force is None:
        r["lossless"] = r["tokens"] == base["tokens"]
    if "draft_ms" in r:
        r["ideal_speedup"] = r["acceptance_length"] * base["step_ms"] / (r["draft_ms"] + r["verify_ms"])
        r["efficiency"] = r["decode_speedup"] / r["ideal_speedup"]
        drafter_bytes.add_bytes_columns(r, base["step_ms"], args.gbps)
    return r


def grid(args) -> list[tuple[str, int, float | None, int]]:
    ks, forces, batches = ((3, 7), (None, 3.0, 6.0), (1, 2, 4, 8)) if args.full else ((3,), (None, 3.0), (1, 4))
    return [(m, k, f, b) for m in DRAFTERS for k in ks for f in forces if f is None or f <= k + 1 for b in batches]


def plot(rows: list[dict], plain: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    batches = sorted(plain)
    ax1.plot(batches, [plain[b]["tok_s"] for b in batches], "k-o", label="plain")
    for key in sorted({(r["method"], r["k"], r["force"]) for r in rows}, key=str):
        sel = sorted((r for r in rows if (r["method"], r["k"], r["force"]) == key), key=lambda r: r["batch"])
        ax1.plot([r["batch"] for r in sel], [r["tok_s"] for r in sel], "-o", label=f"{key[0]} k={key[1]} force={key[2]}")
        if key[2] == "-" and sel[0]["acceptance_per_position"]:
            rates = sel[0]["acceptance_per_position"]
            ax2.plot(range(1, len(rates) + 1), rates, "-o", label=f"{key[0]} k={key[1]}")
    ax1.set(xlabel="batch size", ylabel="tok/s", title=f"{TARGET}: throughput", xscale="log", xticks=batches)
    ax1.set_xticklabels([str(b) for b in batches])
    ax1.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # log scale's own minor labels clutter
    ax2.set(xlabel="draft position", ylabel="acceptance rate", title="per-position acceptance (batch 1)", ylim=(0, 1))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--model" or a.startswith("--model=") for a in argv):  # SmolLM2 on HumanEval: its own grid
        from benchmarks import spec_humaneval

        return spec_humaneval.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the whole grid (default: --quick)")
    ap.add_argument("--quick", action="store_true", help="the default: k 3, force none/3, batch 1 and 4")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads of this process (TP=1 runs and transformers); default: torch's "
                         "choice, every core. TP>1 ranks split the cores between them")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row; the fastest counts")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of specray against transformers at batch 1; the fastest of each counts")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, e.g. 1,2 (TP>1 runs under the mp launcher)")
    ap.add_argument("--json", type=Path, default=Path("bench-results/spec_mid-llama.json"))
    ap.add_argument("--plot", type=Path, default=None, help="tok/s vs batch and per-position acceptance (PNG)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    configs = grid(args)
    gbps_before = drafter_bytes.measure_gbps()  # the bandwidth the bytes-based ideal divides by
    args.gbps = gbps_before
    tps = [int(t) for t in args.tp.split(",")]
    plains = {(tp, b): run_specray(None, b, tp, args) for tp in tps for b in sorted({c[3] for c in configs})}
    plain = {b: p for (tp, b), p in plains.items() if tp == tps[0]}
    rows = []
    for tp in tps:
        for method, k, force, batch in configs:
            spec = SpecConfig(method=method, draft_model=DRAFTERS[method], num_draft_tokens=k,
                              force_accepted_tokens=force)
            rows.append(measure_row(spec, batch, tp, plains[tp, batch], args))
            print(format_table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    gbps_after = drafter_bytes.measure_gbps()
    if gbps_after > args.gbps:  # the faster reading: the more demanding ideal
        args.gbps = gbps_after
        for r in (r for r in rows if "verify_ms" in r):
            drafter_bytes.add_bytes_columns(r, plains[r["tp"], r["batch"]]["step_ms"], args.gbps)
    k = min(int(c[1]) for c in configs)
    duel = head_to_head(k, args)
    print(f"\n{args.threads} thread(s) in this process (TP=1 rows, transformers), input {args.input_len}, "
          f"output {args.output_len}, greedy\n")
    print("plain: " + ", ".join(f"tp {tp} batch {b}: {p['tok_s']:.1f} tok/s ({p['step_ms']:.1f} ms/step)"
                                for (tp, b), p in plains.items()))
    print(format_table(rows, COLUMNS))
    print(f"GEMV bandwidth for ideal B: {gbps_before:.1f} GB/s before the grid, {gbps_after:.1f} after; "
          f"the faster ({args.gbps:.1f}) counts")
    ours, theirs = duel["specray"], duel["hf_assisted"]
    print(f"\nbatch 1, draft_model k={k}, {args.rounds} alternating rounds (fastest of each): specray "
          f"{ours['tok_s']:.1f} tok/s; transformers assisted {theirs['tok_s']:.1f} tok/s "
          f"({ours['tok_s'] / theirs['tok_s']:.2f}x, target >= 2x; per round "
          f"{', '.join(f'{x:.2f}x' for x in duel['round_ratios'])}); transformers plain "
          f"{duel['hf_plain']['tok_s']:.1f} tok/s; same tokens: {ours['tokens'] == theirs['tokens']}")
    print("lossless (natural acceptance == plain tokens):", all(r["lossless"] for r in rows if "lossless" in r))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens"}  # noqa: E731
    args.json.write_text(json.dumps(dict(
        target=TARGET, drafters=DRAFTERS, threads=args.threads, input_len=args.input_len, output_len=args.output_len,
        machine=platform.processor() or platform.machine(), gbps=dict(before=gbps_before, after=gbps_after),
        plain=[strip(p) for p in plains.values()],
        rows=[strip(r) for r in rows],
        head_to_head={n: strip(v) if isinstance(v, dict) else v for n, v in duel.items()}), indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        plot([r for r in rows if r["tp"] == tps[0]], plain, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
