"""Online serving: Poisson arrivals against `specray serve`, plain and with n-gram speculation,
in one run, on chat-formatted HumanEval problems (benchmarks/prompts.py).

    python -m benchmarks.bench_serving --quick        # one low rate, a few requests: minutes on 2 cores
    python -m benchmarks.bench_serving                # rates 0.25,0.5,1,2 req/s, 24 requests each
    python -m benchmarks.bench_serving --json bench-results/serving.json
    python -m benchmarks.bench_serving --url http://127.0.0.1:8000 --model smollm2-135m   # a server you run

For each configuration (plain; ``--spec ngram``) the script starts `specray serve` on a free
port of 127.0.0.1 with ``--engine-args`` (default: smollm2-135m), waits for /health, and for
each rate sends ``--num-requests`` streaming chat requests (greedy, ``max_tokens``) at Poisson
arrival times (exponential gaps, seeded). Per request: TTFT (send to first text chunk) and
TPOT ((end - first token) / (tokens - 1), tokens from the stream's usage chunk). Per rate:
output tokens/s over the wall time of the rate's run, and TTFT / TPOT p50 and p99.

Targets (issue 15): at the lowest rate speculation cuts TPOT p50 by >= 1.3x; the server's
overhead over ``LLM.generate`` for one request stays under 5% of its latency. The overhead row
times the same greedy request (one prompt, non-streaming) through the plain server and through
``LLM.generate`` in this process with the same engine flags, the fastest of ``--repeats`` each.
The machine may be shared: check ``uptime`` first (the numbers mean little above a load of ~2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

from benchmarks.prompts import humaneval_chats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the server subprocess helpers the tests use

from serve_server import start_server, stop_server  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def one_request(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    num_tokens = 0
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = end if first is None else first
    tpot = (end - first) / (num_tokens - 1) if num_tokens > 1 else float("nan")
    return {"ttft_s": first - start, "tpot_s": tpot, "tokens": num_tokens, "latency_s": end - start}


async def run_rate(url: str, model: str, chats: list, rate: float, max_tokens: int, seed: int) -> dict:
    import openai

    rng = random.Random(seed)
    # The client is closed inside the loop that used it: left to the garbage collector after
    # asyncio.run returns, its connections' close callbacks raise "Event loop is closed".
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        tasks, start = [], time.perf_counter()
        for chat in chats:
            tasks.append(asyncio.create_task(one_request(client, model, chat, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ttft = [r["ttft_s"] * 1e3 for r in results]
    tpot = [r["tpot_s"] * 1e3 for r in results if r["tpot_s"] == r["tpot_s"]]
    return {"rate": rate, "num_requests": len(results), "output_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)}


def server_overhead(url: str, model: str, engine_args: list[str], chat: list[dict], max_tokens: int,
                    repeats: int) -> dict:
    """The same greedy chat request through the server and through LLM.generate here."""
    import openai

    from specray import LLM, SamplingParams
    from specray.cli import build_parser, engine_config_from_args

    served = []
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        for _ in range(repeats):
            start = time.perf_counter()
            client.chat.completions.create(model=model, messages=chat, max_tokens=max_tokens, temperature=0)
            served.append(time.perf_counter() - start)
    config = engine_config_from_args(build_parser().parse_args(["serve", *engine_args]))
    direct = []
    with LLM(config) as llm:
        for _ in range(repeats):
            start = time.perf_counter()
            llm.chat(chat, SamplingParams(max_tokens=max_tokens, temperature=0))
            direct.append(time.perf_counter() - start)
    best_served, best_direct = min(served), min(direct)
    return {"served_s": best_served, "llm_generate_s": best_direct,
            "overhead_pct": 100 * (best_served - best_direct) / best_direct}


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'config':<8} {'req/s':>6} {'reqs':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9}   (latencies in ms)"]
    for r in rows:
        lines.append(f"{r['config']:<8} {r['rate']:>6g} {r['num_requests']:>5} {r['output_tok_s']:>8.1f} "
                     f"{r['ttft_p50_ms']:>9.0f} {r['ttft_p99_ms']:>9.0f} {r['tpot_p50_ms']:>9.1f} "
                     f"{r['tpot_p99_ms']:>9.1f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one low rate, 4 requests of 48 tokens")
    p.add_argument("--rates", default="0.25,0.5,1,2", help="request rates (req/s), lowest first")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine-args", default="--model smollm2-135m --kv-capacity-tokens 16384",
                   help="flags of `specray serve` for both configurations")
    p.add_argument("--spec-args", default="--spec ngram --num-draft-tokens 4 --prompt-lookup-min 2 "
                   "--prompt-lookup-max 4", help="added for the speculative configuration")
    p.add_argument("--url", help="bench this running server only (one configuration, no overhead row)")
    p.add_argument("--model", help="with --url: the served model name")
    p.add_argument("--repeats", type=int, default=3, help="overhead row: fastest of this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.num_requests, args.max_tokens, args.repeats = "0.5", 4, 48, 2
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def bench_server(url: str, model: str, name: str, args, chats) -> list[dict]:
    rows = []
    for i, rate in enumerate(args.rates):
        row = asyncio.run(run_rate(url, model, chats, rate, args.max_tokens, args.seed + i))
        rows.append({"config": name, **row})
        print(format_rows(rows[-1:]).splitlines()[1], flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    chats = humaneval_chats(args.num_requests)
    if args.url:
        rows = bench_server(args.url, args.model, "served", args, chats)
        print(format_rows(rows))
        return 0
    engine_args = shlex.split(args.engine_args)
    model = engine_args[engine_args.index("--model") + 1] if "--model" in engine_args else "tiny-llama"
    rows, overhead = [], None
    log_dir = ROOT / "bench-results"
    log_dir.mkdir(exist_ok=True)
    for name, extra in (("plain", []), ("ngram", shlex.split(args.spec_args))):
        server = start_server(log_dir / f"serving-{name}.log", *engine_args, *extra, "--max-num-queued-reqs",
                              str(max(args.num_requests, 1)))
        try:
            rows += bench_server(server.url, model, name, args, chats)
            if name == "plain":
                overhead = server_overhead(server.url, model, engine_args, chats[0], args.max_tokens, args.repeats)
        finally:
            stop_server(server)
    print(format_rows(rows))
    low = [r for r in rows if r["rate"] == args.rates[0]]
    speedup = low[0]["tpot_p50_ms"] / low[1]["tpot_p50_ms"]
    print(f"lowest rate {args.rates[0]:g} req/s: ngram cuts TPOT p50 by {speedup:.2f}x (target >= 1.3x)")
    print(f"server overhead for one request: {overhead['overhead_pct']:+.1f}% "
          f"({overhead['served_s'] * 1e3:.0f} ms served, {overhead['llm_generate_s'] * 1e3:.0f} ms LLM.generate; "
          f"target < 5%)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "tpot_p50_speedup_lowest_rate": speedup,
                                               "overhead": overhead, "args": vars(args)}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
