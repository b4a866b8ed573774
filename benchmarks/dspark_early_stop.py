"""DSpark's confidence early stop on a tiny preset: drafts proposed, acceptance length and
time per verify step, with the option off and at a few thresholds (greedy, random weights).

    python benchmarks/dspark_early_stop.py [--model tiny-llama] [--k 7] [--batch 1 4] [--repeats 3]

Random weights: almost every draft is rejected (AL near 1), so what the early stop changes is
how many drafts the target verifies per step; the drafter's forward is the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig


def _summary(outs, times: list[float], batch: int) -> dict:
    seq_steps = sum(o.metrics["num_decode_steps"] for o in outs)  # with drafts or without
    steps = max(o.metrics["num_decode_steps"] for o in outs)  # the batch's decode steps (requests run together)
    wall = statistics.median(times)
    return dict(drafts_per_step=sum(o.metrics["num_draft_tokens"] for o in outs) / seq_steps,
                al=statistics.mean(o.metrics["acceptance_length"] for o in outs),
                per_step=statistics.mean(o.metrics["tokens_per_decode_step"] for o in outs),
                step_ms=1000 * wall / steps, tok_s=sum(len(o.token_ids) for o in outs) / wall)


def measure(model: str, k: int, batch: int, thresholds: list, repeats: int, max_tokens: int) -> dict:
    """Every threshold's engine is built first and the runs interleave (round-robin, median
    of ``repeats``), so load that drifts during the measurement hits every setting alike."""
    prompts = [list(range(3 + i, 40 + i)) for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llms = {t: LLM(EngineConfig(model=model, kv=KVConfig(capacity_tokens=8192),
                                spec=SpecConfig(method="dspark", num_draft_tokens=k, dspark_confidence_threshold=t)))
            for t in thresholds}
    try:
        outs = {t: llm.generate(prompts, params) for t, llm in llms.items()}  # warm-up
        times: dict = {t: [] for t in thresholds}
        for _ in range(repeats):
            for t, llm in llms.items():
                start = time.perf_counter()
                outs[t] = llm.generate(prompts, params)
                times[t].append(time.perf_counter() - start)
    finally:
        for llm in llms.values():
            llm.close()
    return {t: _summary(outs[t], times[t], batch) for t in thresholds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.1, 0.02])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    print("| batch | threshold | drafts / seq-step | AL | tokens / decode step | ms / step | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        results = measure(args.model, args.k, batch, [None, *args.thresholds], args.repeats, args.max_tokens)
        for threshold, r in results.items():
            print(f"| {batch} | {threshold or 'off'} | {r['drafts_per_step']:.2f} | {r['al']:.2f} | {r['per_step']:.2f} | "
                  f"{r['step_ms']:.1f} | {r['tok_s']:.0f} |")


if __name__ == "__main__":
    main()
