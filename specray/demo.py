"""`make demo`: the main job end to end on built-in presets (no downloads).

A local Ray cluster, the ``tiny-llama`` target sharded over two ranks (TP=2, one Ray
actor each), a standalone drafter (a draft model with its own KV pool; here the target's
own weights, see below) drafting 3 tokens per step, the geometry every rank agreed and
allocated, a short greedy generation checked against plain decoding, and its acceptance
metrics.
"""

from __future__ import annotations

import os
import time

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.spec_metrics import aggregate

PROMPTS = [list(b"speculative decoding"), list(b"hello"), list(b"a longer prompt that crosses a page boundary")]


def main() -> None:
    import ray

    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    # logical CPUs: the two rank actors fit on a 2-core machine; a small object store (only plans
    # and outputs cross it)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20, configure_logging=False)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    kv = KVConfig(tokens_per_block=32, capacity_tokens=8192)
    parallel = ParallelConfig(tp_size=2, launcher="ray")
    # Random-weight presets share no knowledge, so the 1-layer tiny-llama-draft preset is
    # almost never accepted; drafting with the target's own weights (a separate standalone
    # model with its own pool) shows acceptance at work instead.
    spec = SpecConfig(method="draft_model", draft_model="tiny-llama", num_draft_tokens=3)
    try:
        with LLM(EngineConfig(model="tiny-llama", kv=kv, parallel=parallel)) as llm:
            plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
        with LLM(EngineConfig(model="tiny-llama", kv=kv, parallel=parallel, spec=spec)) as llm:
            print("agreed on every rank:")
            for name, geometry in llm.geometry.items():
                print("  " + geometry.describe(name))
            start = time.perf_counter()
            outs = llm.generate(PROMPTS, params)
            elapsed = time.perf_counter() - start
    finally:
        ray.shutdown()
    for out in outs:
        m = out.metrics
        print(f"request {out.index}: {len(out.token_ids)} tokens, AL {m['acceptance_length']:.2f}, "
              f"ttft {m['ttft_s'] * 1e3:.1f} ms, tpot {m['tpot_s'] * 1e3:.2f} ms: {out.token_ids[:10]}...")
    agg = aggregate([o.metrics for o in outs])
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tok/s); acceptance length "
          f"{agg['acceptance_length']:.2f}, per position {[round(r, 2) for r in agg['acceptance_per_position']]}, "
          f"histogram {agg['acceptance_histogram']}")
    same = [o.token_ids for o in outs] == plain
    print(f"speculative output equals plain greedy decoding: {same}")
    if not same:
        raise SystemExit("speculative decoding changed the greedy output")


if __name__ == "__main__":
    main()
