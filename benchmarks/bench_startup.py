"""Start-up time of an ``mp`` job: a TP=2 tiny-llama ``LLM``, built and closed ``--repeats`` times
in one process, each start timed from ``LLM(...)`` to its return (ranks joined, pools agreed).

The first start in a process pays for whatever the launcher sets up once per driver process;
the rest show the steady state. Run: ``python -m benchmarks.bench_startup --repeats 4``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    config = EngineConfig(model="tiny-llama", kv=KVConfig(capacity_tokens=1024),
                          parallel=ParallelConfig(tp_size=args.tp, launcher="mp"))
    LLM(EngineConfig(model="tiny-llama")).close()  # build the preset's checkpoint outside the timing
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm = LLM(config)
        times.append(time.perf_counter() - start)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.close()
    print(f"start-up s, TP={args.tp} tiny-llama under mp: " + " ".join(f"{t:.2f}" for t in times)
          + f"; first {times[0]:.2f}, median of the rest {statistics.median(times[1:] or times):.2f}")


if __name__ == "__main__":
    main()
