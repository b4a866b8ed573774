"""llama.cpp (llama-cpp-python) in its own process, as its users run it: one timed pass.

    python -m benchmarks.llamacpp_peer REQUEST.json RESULT.json

``bench_vs_llamacpp`` writes the request (the GGUF, threads, context, the mode ``plain`` or
``ngram k=K``, token-id prompts, new tokens per prompt) and starts this once per round and mode,
so llama.cpp's OpenMP threads, allocator and caches are its own and nothing of specray's
process is shared (issue 28: on threads inside specray's process it measured 0.92x where its
own process gave 1.20-1.25x). The process loads the model, runs one warm-up prompt of 8 tokens,
then the timed pass; each prompt from an empty cache (no prefix reuse), exactly ``output_len``
greedy tokens, timed at every yield. The result: the tokens, per-prompt TPOT (first to last
token) and TTFT, the pass's wall time and, for n-gram lookup, tokens per verify step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def decode_tpot_ms(stamps: list[float]) -> float:
    """Decode time per token: the span from the first token to the last, over the tokens after
    the first (prefill and the first token are TTFT's)."""
    if len(stamps) < 2:
        raise ValueError(f"TPOT needs at least 2 token timestamps, got {len(stamps)}")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def summarize(tokens: list[list[int]], wall_s: float, tpots: list[float], ttfts: list[float], **extra) -> dict:
    return dict(tok_s=sum(map(len, tokens)) / wall_s, wall_s=wall_s, tpot_ms=statistics.median(tpots),
                ttft_ms=statistics.median(ttfts), tokens=tokens, **extra)


def open_llama(model: str, n_ctx: int, threads: int, ngram_k: int | None):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingLookup(LlamaPromptLookupDecoding):
        """llama.cpp's prompt lookup, counting its calls (one per verify step)."""
        num_calls = 0

        def __call__(self, input_ids, /, **kwargs):
            self.num_calls += 1
            return super().__call__(input_ids, **kwargs)

    draft = None if ngram_k is None else CountingLookup(num_pred_tokens=ngram_k)
    return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           draft_model=draft, verbose=False)


def run_pass(llm, prompts: list[list[int]], output_len: int) -> dict:
    draft = llm.draft_model
    calls_before = getattr(draft, "num_calls", 0)
    tokens, tpots, ttfts, wall = [], [], [], 0.0
    for prompt in prompts:
        llm.reset()  # forget the previous prompt: no prefix reuse, every prompt is prefilled
        out, stamps = [], []
        start = time.perf_counter()
        gen = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in gen:
            out.append(int(token))
            stamps.append(time.perf_counter())
            if len(out) == output_len:
                break
        gen.close()
        wall += stamps[-1] - start
        tokens.append(out)
        tpots.append(decode_tpot_ms(stamps))
        ttfts.append((stamps[0] - start) * 1e3)
    extra = {}
    if draft is not None:  # one draft call per verify step after the first token
        extra["tokens_per_step"] = len(prompts) * (output_len - 1) / (draft.num_calls - calls_before)
    return summarize(tokens, wall, tpots, ttfts, **extra)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text())
    llm = open_llama(request["model"], request["n_ctx"], request["threads"], request.get("ngram_k"))
    run_pass(llm, request["prompts"][:1], 8)  # warm-up
    result = run_pass(llm, request["prompts"], request["output_len"])
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
