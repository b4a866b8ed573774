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


def measure(model: str, k: int, batch: int, threshold: float | None, repeats: int) -> dict:
    spec = SpecConfig(method="dspark", num_draft_tokens=k, dspark_confidence_threshold=threshold)
    prompts = [list(range(3 + i, 40 + i)) for i in range(batch)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    with LLM(EngineConfig(model=model, kv=KVConfig(capacity_tokens=8192), spec=spec)) as llm:
        llm.generate(prompts, params)  # warm-up
        times, outs = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
    seq_steps = sum(o.metrics["num_decode_steps"] for o in outs)  # with drafts or without
    steps = max(o.metrics["num_decode_steps"] for o in outs)  # the batch's decode steps (requests run together)
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    wall = statistics.median(times)
    return dict(threshold=threshold, drafts_per_step=drafted / seq_steps,
                al=statistics.mean(o.metrics["acceptance_length"] for o in outs),
                per_step=statistics.mean(o.metrics["tokens_per_decode_step"] for o in outs),
                step_ms=1000 * wall / steps, tok_s=tokens / wall)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.1, 0.02])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| batch | threshold | drafts / seq-step | AL | tokens / decode step | ms / step | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for threshold in [None, *args.thresholds]:
            r = measure(args.model, args.k, batch, threshold, args.repeats)
            print(f"| {batch} | {r['threshold'] or 'off'} | {r['drafts_per_step']:.2f} | {r['al']:.2f} | {r['per_step']:.2f} | "
                  f"{r['step_ms']:.1f} | {r['tok_s']:.0f} |")


if __name__ == "__main__":
    main()
