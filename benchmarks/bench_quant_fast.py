"""``SPECRAY_CPU_QUANT=fast`` against the exact kernels on the shipped SmolLM2 file, in one process.

    python -m benchmarks.bench_quant_fast [--rounds 7] [--num-prompts 8] [--output-len 64]

Two parts, both with the two models (exact: the float32 path's bits; fast: int8 activations with
VNNI, ``csrc/quant_fast.c``) loaded side by side:

- **steps**: the model step as the engine runs it (``bench_cpu_step.make_step``: 128 tokens
  cached, the LM head on every row of a verify step): decode x1, verify 1x4 and 1x6, prefill 128.
  The two modes alternate within every round; the fastest of ``--rounds`` counts. Reported: ms,
  exact/fast, and each verify step over its own mode's decode step (issue 28's targets: 1x4 <=
  1.5x, 1x6 <= 2x a decode step).
- **agreement** with the float32 path (reported, not asserted: fast mode rounds its activations):
  HumanEval chat prompts and the exact path's greedy continuation of ``--output-len`` tokens,
  teacher-forced through both models in one forward each; at every continuation position the
  share of equal top-1 tokens and KL(exact || fast) of the next-token distributions.

Writes a table and ``bench-results/bench_quant_fast.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_cpu_step import make_step
from benchmarks.bench_vs_llamacpp import build_prompts
from specray import LLM, EngineConfig, KVConfig, SamplingParams
from specray.comm.context import DistContext
from specray.bench import format_table
from specray.models.attention import build_metadata
from specray.models.loader import load_model
from specray.models.presets import resolve_model
from specray.models.quant_weight import quantized_weights

STEPS = {"decode x1": (1, 1), "verify 1x4": (1, 4), "verify 1x6": (1, 6), "prefill 128": (1, 128)}
VERIFY_TARGETS = {"verify 1x4": 1.5, "verify 1x6": 2.0}  # issue 28: times a decode step
MODES = ("exact", "fast")
BLOCK = 16


def load(mode: str):
    os.environ["SPECRAY_CPU_QUANT"] = mode
    try:
        return load_model(resolve_model("smollm2-135m"), DistContext.single(), "float32")
    finally:
        os.environ.pop("SPECRAY_CPU_QUANT")


@torch.inference_mode()
def time_steps(models: dict, rounds: int) -> dict[str, dict[str, float]]:
    steps = {(label, mode): make_step(models[mode], *shape, lm_head_rows="all")
             for label, shape in STEPS.items() for mode in MODES}
    best = {key: float("inf") for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            step()  # warm-up
            start = time.perf_counter()
            step()
            best[key] = min(best[key], time.perf_counter() - start)
    return {label: {mode: best[label, mode] * 1e3 for mode in MODES} for label in STEPS}


@torch.inference_mode()
def all_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one forward over ``ids`` (a fresh pool)."""
    pages = -(-len(ids) // BLOCK)
    pools = [torch.zeros(pages + 1, 2, model.num_local_kv_heads, BLOCK, model.arch.head_dim)
             for _ in range(model.arch.num_layers)]
    positions, meta = build_metadata([list(range(1, pages + 1))], BLOCK, [0], [len(ids)], torch.device("cpu"))
    return model.logits(model(torch.tensor(ids), positions, pools, meta))


def agreement(models: dict, num_prompts: int, output_len: int) -> dict:
    path = resolve_model("smollm2-135m")
    prompts = build_prompts("smollm2-135m", path, num_prompts)
    os.environ["SPECRAY_CPU_QUANT"] = "exact"
    try:
        with LLM(EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=BLOCK, capacity_tokens=8192))) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    finally:
        os.environ.pop("SPECRAY_CPU_QUANT")
    same, kls = [], []
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        span = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predict the continuation
        exact, fast = (all_logits(models[m], ids)[span].double() for m in MODES)
        p, q = exact.log_softmax(-1), fast.log_softmax(-1)
        kls += (p.exp() * (p - q)).sum(-1).tolist()
        same += (exact.argmax(-1) == fast.argmax(-1)).tolist()
    return dict(positions=len(same), top1_agreement=sum(same) / len(same), kl_mean=statistics.fmean(kls),
                kl_p99=sorted(kls)[int(0.99 * (len(kls) - 1))], kl_max=max(kls))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--num-prompts", type=int, default=8, help="HumanEval problems 0..N-1")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", type=Path, default=Path("bench-results/bench_quant_fast.json"))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    models = {mode: load(mode) for mode in MODES}
    if not all(w.is_fast for w in quantized_weights(models["fast"])):
        raise SystemExit("SPECRAY_CPU_QUANT=fast repacked no weights here (no AVX-512 VNNI?): nothing to compare")
    ms = time_steps(models, args.rounds)
    rows = [dict(step=label, exact=ms[label]["exact"], fast=ms[label]["fast"],
                 speedup=ms[label]["exact"] / ms[label]["fast"],
                 exact_over_decode=ms[label]["exact"] / ms["decode x1"]["exact"],
                 fast_over_decode=ms[label]["fast"] / ms["decode x1"]["fast"]) for label in STEPS]
    print(f"\nSmolLM2 shipped Q4_1 file, {torch.get_num_threads()} threads, fastest of {args.rounds} alternating rounds, "
          f"128 tokens cached, LM head on every row")
    print(format_table(rows, [("step", "step", "s"), ("exact", "exact ms", ".2f"), ("fast", "fast ms", ".2f"),
                              ("speedup", "exact/fast", ".2f"), ("exact_over_decode", "exact / its decode", ".2f"),
                              ("fast_over_decode", "fast / its decode", ".2f")]))
    verdicts = []
    for label, limit in VERIFY_TARGETS.items():
        for mode in MODES:
            ratio = ms[label][mode] / ms["decode x1"][mode]
            verdicts.append(f"{label} {mode}: {ratio:.2f}x its decode step (target <= {limit}): "
                            + ("met" if ratio <= limit else "NOT met"))
    print("\n".join(verdicts))
    agree = agreement(models, args.num_prompts, args.output_len)
    print(f"\nfast vs the float32 path, teacher-forced over {agree['positions']} positions of {args.num_prompts} "
          f"HumanEval chats: top-1 agreement {agree['top1_agreement']:.2%}, KL(exact || fast) mean "
          f"{agree['kl_mean']:.2e}, p99 {agree['kl_p99']:.2e}, max {agree['kl_max']:.2e}")
    load_after = os.getloadavg()
    print(f"load average before {load_before}, after {load_after}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(rows=rows, verdicts=verdicts, agreement=agree, rounds=args.rounds,
                                         threads=torch.get_num_threads(), num_prompts=args.num_prompts,
                                         output_len=args.output_len, load_average_before=load_before,
                                         load_average_after=load_after), indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
