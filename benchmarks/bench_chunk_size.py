"""The CPU default of ``max_num_batched_tokens``, from a measurement: one long prompt prefilled
in chunks of each budget (smollm2-135m, caching off, one request, max_tokens 1).

    python -m benchmarks.bench_chunk_size                       # budgets 32 .. 2048, a 2048-token prompt
    python -m benchmarks.bench_chunk_size --json bench-results/chunk_size.json

Per budget: the prompt's TTFT, prefill tokens/s, and the time of one chunk's step (TTFT / number
of chunks), which is what a decoding request waits between two tokens while the prompt
prefills. The rule: the default is the smallest budget whose prefill throughput is at least 0.8
of the best budget's, so that a long prompt's TTFT stays within 1.25x of an unchunked prefill
(issue 26's target); a larger budget only makes decoding requests wait longer per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specray import LLM, EngineConfig, KVConfig, SamplingParams


def measure(model: str, budget: int, prompt: list[int], repeats: int) -> dict:
    cfg = EngineConfig(model=model, max_num_batched_tokens=budget,
                       kv=KVConfig(enable_prefix_caching=False, capacity_tokens=len(prompt) + 256))
    with LLM(cfg) as llm:
        llm.generate([prompt[:64]], SamplingParams(max_tokens=1))  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1))
            best = min(best, time.perf_counter() - start)
    num_chunks = -(-len(prompt) // budget)
    return dict(budget=budget, ttft_s=best, prefill_tok_s=len(prompt) / best, chunk_step_s=best / num_chunks)


def choose(rows: list[dict], max_ttft_ratio: float = 1.25) -> int:
    """The smallest budget whose prefill throughput is at least 1 / ``max_ttft_ratio`` of the best's."""
    best = max(r["prefill_tok_s"] for r in rows)
    return min(r["budget"] for r in rows if r["prefill_tok_s"] * max_ttft_ratio >= best * (1 - 1e-9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--budgets", default="32,64,128,256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompt = [(i * 7919) % 30000 + 100 for i in range(args.prompt_tokens)]
    rows = [measure(args.model, int(b), prompt, args.repeats) for b in args.budgets.split(",")]
    print(f"{'budget':>7} {'TTFT s':>8} {'prefill tok/s':>14} {'step per chunk ms':>18}")
    for r in rows:
        print(f"{r['budget']:>7} {r['ttft_s']:>8.2f} {r['prefill_tok_s']:>14.0f} {r['chunk_step_s'] * 1e3:>18.0f}")
    chosen = choose(rows)
    print(f"chosen default: {chosen} (smallest budget with >= 0.8x the best prefill throughput)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(rows=rows, chosen=chosen, prompt_tokens=len(prompt)), indent=1))


if __name__ == "__main__":
    main()
