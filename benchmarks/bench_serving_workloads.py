"""Serving workloads for prefix caching and chunked prefill, against `specray serve` (smollm2-135m).

    python -m benchmarks.bench_serving_workloads                       # all three, full sizes
    python -m benchmarks.bench_serving_workloads --workload long-arrival --json bench-results/long.json

- ``shared-prefix`` (SGLang's generated-shared-prefix shape): groups of short questions behind a
  ~1000-token system prompt, sent one after another; caching off (cold) and on (warm), each with
  and without n-gram speculation. Reports TTFT p50/p99, TPOT p50/p99, max inter-token latency,
  the hit rate in tokens against what the page geometry allows (the common prefix of a group,
  rounded down to a whole page and at most the prompt length - 1), and with speculation the
  acceptance length (Prometheus counters: 1 + accepted / drafts).
- ``multi-turn``: a conversation that resends its history each turn (6 turns), caching on and off:
  TTFT per turn.
- ``long-arrival``: short requests decode while a 2048-token prompt arrives; with chunked
  prefill (the default budget) and without (one step for the whole prompt): the short requests'
  TPOT p50 and max inter-token latency, the long request's TTFT.

Targets (issue 26): shared prefix: hit rate >= 0.95 of the geometry's, warm TTFT p50 <= 0.25x cold;
with speculation the hit rate within one page per request of speculation off and AL warm = cold.
Multi-turn: turn 6 TTFT <= 1.5x turn 1 with caching. Long arrival: chunked max ITL <= 2x TPOT p50
and the long TTFT <= 1.25x unchunked. Prompts go as token ids (tokenized once by the server's
/tokenize), so common prefixes are exact. Check ``uptime`` first: the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_serving import percentile  # noqa: E402
from serve_server import start_server, stop_server  # noqa: E402

PAGE = 16
WORDS = ("the server keeps every page of a prompt it has seen so that the next request with the same "
         "beginning skips straight to the part that is new while the drafter keeps its own pages ").split()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"{}")


def tokenize(url: str, text: str) -> list[int]:
    return post(url + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def text_of(num_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] + (str(i) if i % 7 == 0 else "") for i in range(num_words))


async def stream(client, prompt: list[int], max_tokens: int, salt: str | None = None) -> dict:
    start = time.perf_counter()
    stamps, usage, text = [], None, ""
    extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
    async for chunk in await client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, stream=True, extra_body=extra,
                                                       stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    first = stamps[0] if stamps else end
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    n = usage.completion_tokens
    return dict(ttft_s=first - start, tpot_s=(end - first) / (n - 1) if n > 1 else float("nan"),
                max_itl_s=max(gaps, default=0.0), prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.prompt_tokens_details.cached_tokens, start=start, end=end, stamps=stamps,
                text=text)


def spec_al(server) -> tuple[float, float]:
    m = server.metrics()
    return (m.get(("specray:spec_decode_num_drafts_total", ()), 0.0),
            m.get(("specray:spec_decode_num_accepted_tokens_total", ()), 0.0))


def summary(rows: list[dict]) -> dict:
    out = {}
    for key in ("ttft_s", "tpot_s"):
        values = [r[key] for r in rows if r[key] == r[key]]
        out[f"{key}_p50"], out[f"{key}_p99"] = percentile(values, 50), percentile(values, 99)
    out["max_itl_s"] = max(r["max_itl_s"] for r in rows)
    return out


def serve(engine_args: list[str], *flags: str, log: Path):
    """A server, warmed up by one short request (the first step of a process pays one-off costs)."""
    server = start_server(log, *engine_args, "--served-model-name", "m", "--tokens-per-block", str(PAGE), *flags)
    post(server.url + "/v1/completions", {"model": "m", "prompt": "warm up", "max_tokens": 4,
                                          "cache_salt": "warm-up"})
    return server


async def shared_prefix(args, log_dir: Path) -> dict:
    import openai

    results = {}
    for spec in ([], ["--spec", "ngram"]):
        for cache in ("--no-enable-prefix-caching", "--enable-prefix-caching"):
            name = ("ngram " if spec else "") + ("warm" if cache == "--enable-prefix-caching" else "cold")
            server = serve(args.engine_args, cache, *spec, log=log_dir / "shared.log")
            try:
                system = tokenize(server.url, text_of(args.system_words))
                client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
                rows, allowed = [], 0
                drafts0, accepted0 = spec_al(server)
                for g in range(args.groups):
                    group_system = tokenize(server.url, f"group {g}: ") + system
                    for q in range(args.questions):
                        prompt = group_system + tokenize(server.url, f" question {q}: " + text_of(8 + q, 3 * q + g))
                        rows.append(await stream(client, prompt, args.max_tokens))
                        if q:  # the group's system prompt is cached after its first question
                            allowed += min(len(group_system), len(prompt) - 1) // PAGE * PAGE
                drafts, accepted = spec_al(server)
                await client.close()
            finally:
                stop_server(server)
            hits = sum(r["cached_tokens"] for r in rows)
            results[name] = dict(summary(rows), hit_tokens=hits, allowed_tokens=allowed,
                                 hit_rate_of_allowed=hits / allowed if allowed else 0.0,
                                 prompt_tokens=sum(r["prompt_tokens"] for r in rows),
                                 acceptance_length=1 + (accepted - accepted0) / (drafts - drafts0)
                                 if drafts > drafts0 else None, num_requests=len(rows))
    warm, cold = results["warm"], results["cold"]
    results["targets"] = dict(
        hit_rate_of_allowed=warm["hit_rate_of_allowed"], warm_over_cold_ttft_p50=warm["ttft_s_p50"] / cold["ttft_s_p50"],
        spec_hit_gap_pages_per_request=(warm["hit_tokens"] - results["ngram warm"]["hit_tokens"]) / PAGE / warm["num_requests"],
        spec_al_warm=results["ngram warm"]["acceptance_length"], spec_al_cold=results["ngram cold"]["acceptance_length"])
    return results


async def multi_turn(args, log_dir: Path) -> dict:
    import openai

    results = {}
    for cache in ("--no-enable-prefix-caching", "--enable-prefix-caching"):
        server = serve(args.engine_args, cache, log=log_dir / "multi.log")
        try:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
            history, turns = tokenize(server.url, text_of(args.system_words // 4)), []
            for t in range(args.turns):
                history = history + tokenize(server.url, f" user turn {t}: " + text_of(40, 11 * t))
                row = await stream(client, history, args.max_tokens)
                history = history + tokenize(server.url, row["text"])
                turns.append(dict(ttft_s=row["ttft_s"], prompt_tokens=row["prompt_tokens"],
                                  cached_tokens=row["cached_tokens"]))
            await client.close()
        finally:
            stop_server(server)
        name = "warm" if cache == "--enable-prefix-caching" else "cold"
        results[name] = dict(turns=turns, last_over_first_ttft=turns[-1]["ttft_s"] / turns[0]["ttft_s"])
    return results


async def long_arrival(args, log_dir: Path) -> dict:
    import openai

    results = {}
    for name, flags in (("chunked", []), ("unchunked", ["--max-num-batched-tokens", str(1 << 16)])):
        server = serve(args.engine_args, "--no-enable-prefix-caching", *flags, log=log_dir / "long.log")
        try:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
            long_prompt = (tokenize(server.url, text_of(args.long_tokens)) * 2)[:args.long_tokens]
            alone = await stream(client, long_prompt, 4, salt="alone")
            shorts = [asyncio.create_task(stream(client, tokenize(server.url, f"short {i}: " + text_of(20, i)),
                                                 args.short_tokens)) for i in range(args.num_short)]
            await asyncio.sleep(args.arrival_s)
            long_row = await stream(client, long_prompt, 4)
            short_rows = await asyncio.gather(*shorts)
            await client.close()
        finally:
            stop_server(server)
        # the short requests' gaps while the long prompt was in flight
        during = [b - a for r in short_rows for a, b in zip(r["stamps"], r["stamps"][1:])
                  if a >= long_row["start"] and b <= long_row["start"] + long_row["ttft_s"] + 0.5]
        results[name] = dict(short=summary(short_rows), long_ttft_s=long_row["ttft_s"], long_alone_ttft_s=alone["ttft_s"],
                             max_itl_during_long_s=max(during, default=float("nan")))
        results[name]["max_itl_over_tpot_p50"] = results[name]["short"]["max_itl_s"] / results[name]["short"]["tpot_s_p50"]
    results["targets"] = dict(
        chunked_max_itl_over_tpot_p50=results["chunked"]["max_itl_over_tpot_p50"],
        unchunked_max_itl_over_tpot_p50=results["unchunked"]["max_itl_over_tpot_p50"],
        long_ttft_chunked_over_unchunked=results["chunked"]["long_ttft_s"] / results["unchunked"]["long_ttft_s"])
    return results


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "long-arrival": long_arrival}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--engine-args", default="--model smollm2-135m")
    parser.add_argument("--system-words", type=int, default=700, help="~1000 tokens")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--num-short", type=int, default=3)
    parser.add_argument("--short-tokens", type=int, default=96)
    parser.add_argument("--arrival-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results/workload-logs"))
    args = parser.parse_args()
    args.engine_args = args.engine_args.split()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    out = {name: asyncio.run(WORKLOADS[name](args, args.log_dir)) for name in names}
    for name, result in out.items():
        print(f"== {name}")
        for key, value in result.items():
            print(f"  {key}: {json.dumps(value, default=str)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
