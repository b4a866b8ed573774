"""`make demo`: the main job end to end on a built-in preset (no downloads)."""

from __future__ import annotations

import time

from specray import LLM, EngineConfig, KVConfig, SamplingParams


def main() -> None:
    config = EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=8192))
    with LLM(config) as llm:
        for name, geometry in llm.geometry.items():
            print(geometry.describe(name))
        prompts = [list(b"speculative decoding"), list(b"hello"), list(b"a longer prompt that crosses a page")]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
        elapsed = time.perf_counter() - start
        for out in outs:
            print(f"request {out.index}: {len(out.token_ids)} tokens, ttft {out.metrics['ttft_s'] * 1e3:.1f} ms, "
                  f"tpot {out.metrics['tpot_s'] * 1e3:.2f} ms: {out.token_ids[:12]}...")
        total = sum(len(o.token_ids) for o in outs)
        print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tok/s)")


if __name__ == "__main__":
    main()
