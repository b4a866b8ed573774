"""Chunked prefill (``EngineConfig.max_num_batched_tokens``) equals unchunked prefill.

For every method and budgets of 16, 48 and 100 tokens and the default: the same tokens, the
same drafts at every step and the same accepted counts (SPECRAY_TEST_DRAFTS_DIR) as one
unchunked prefill; a long prompt's KV in the draft pool (and the target pool, where one-model
drafters keep theirs) within 1e-5 of an unchunked prefill's (float32: a chunk's matmuls sum in
another order than the whole prompt's, ~1e-7 apart; 1e-5 leaves two orders of margin);
preemption, caching, chunking and speculation together on a tiny pool give plain decoding's
output and every page back. The checkpoint is the one the prefix-cache tests use.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from test_prefix_cache_engine import ckpt, config  # noqa: F401 (fixture)

from specray import LLM, SamplingParams

METHODS = (None, "ngram", "draft_model", "eagle3", "dflash", "dspark", "mtp")
PROMPTS = [[(3 * i * i + 7 * i + n) % 380 + 3 for i in range(n)] for n in (5, 61, 30, 13, 130)]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)
DEFAULT_BUDGET = None  # the device's default (config.CPU_MAX_NUM_BATCHED_TOKENS)


def run(ckpt, method, budget, log_dir, monkeypatch, prompts=PROMPTS, params=PARAMS, **kw):  # noqa: F811
    log_dir.mkdir()
    monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(log_dir))
    with LLM(config(ckpt, method, max_num_batched_tokens=budget, **kw)) as llm:
        outs = llm.generate(prompts, params)
        engine = llm._engine
        pools = (engine.worker.pools, engine.worker.draft_pools)
        assert engine.allocator.num_free == engine.allocator.num_blocks
    steps = defaultdict(list)
    path = log_dir / "rank0.drafts"
    for line in (path.read_text().splitlines() if path.exists() else []):
        sid, *row = json.loads(line)
        steps[sid].append(row)
    return [o.token_ids for o in outs], dict(steps), pools


@pytest.mark.parametrize("budget", [16, 48, 100, DEFAULT_BUDGET])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m or "plain")
def test_chunked_equals_unchunked(ckpt, method, budget, tmp_path, monkeypatch):  # noqa: F811
    tokens, steps, _ = run(ckpt, method, budget, tmp_path / "chunked", monkeypatch)
    ref_tokens, ref_steps, _ = run(ckpt, method, 1 << 16, tmp_path / "whole", monkeypatch)
    assert tokens == ref_tokens
    assert steps == ref_steps
    if method == "ngram":  # it drafts only where an n-gram of the sequence repeats
        assert sum(len(rows) for rows in steps.values()) >= 5
    elif method is not None:
        assert all(steps.get(i) for i in range(len(PROMPTS))), "a request never drafted"


def prompt_kv(pools, num_tokens: int, page: int) -> torch.Tensor:
    """KV of positions [0, num_tokens) of the one request, which got pages 0, 1, ... in order."""
    n = -(-num_tokens // page)
    pages = torch.stack([layer[:n] for layer in pools])  # [layers, n, 2, kv heads, page, head_dim]
    return pages.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :num_tokens]


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash", "dspark", "mtp"])
def test_prompt_kv_of_a_chunked_prefill(ckpt, method, tmp_path, monkeypatch):  # noqa: F811
    """One 130-token prompt in chunks of 16 against one whole prefill (caching off, so both
    engines give it the same pages): every pool's KV of the prompt, the drafter's included."""
    prompt, params = PROMPTS[-1:], SamplingParams(max_tokens=3, ignore_eos=True)
    _, _, chunked = run(ckpt, method, 16, tmp_path / "chunked", monkeypatch, prompt, params, cache=False)
    _, _, whole = run(ckpt, method, 1 << 16, tmp_path / "whole", monkeypatch, prompt, params, cache=False)
    num_tokens = len(prompt[0]) - 1  # the drafters' caches hold the positions before the fed token
    for pools_c, pools_w, page in ((chunked[0], whole[0], 16), (chunked[1], whole[1], 32)):
        if pools_w:
            diff = (prompt_kv(pools_c, num_tokens, page) - prompt_kv(pools_w, num_tokens, page)).abs().max()
            assert prompt_kv(pools_w, num_tokens, page).abs().max() > 0  # the KV is really there
            assert diff <= 1e-5


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash"])
def test_preemption_caching_chunking_and_speculation_together(ckpt, method, tmp_path, monkeypatch):  # noqa: F811
    prompts = [PROMPTS[-1][:40] + [i + 3] * (3 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(config(ckpt, None, cache=False)) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(config(ckpt, method, capacity=256, max_num_batched_tokens=16)) as llm:
        outs = llm.generate(prompts, params)
        engine = llm._engine
        assert engine.allocator.num_free == engine.allocator.num_blocks
        if engine.draft_allocator is not None:
            assert engine.draft_allocator.num_free == engine.draft_allocator.num_blocks
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0


def test_chunked_equals_unchunked_tp2_mp(ckpt, tmp_path, monkeypatch):  # noqa: F811
    """Sharded: every rank runs the partial chunks (no sample, features kept) and drafts alike."""
    results = []
    for budget in (16, 1 << 16):
        log_dir = tmp_path / str(budget)
        log_dir.mkdir()
        monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(log_dir))
        with LLM(config(ckpt, "eagle3", tp=2, launcher="mp", max_num_batched_tokens=budget)) as llm:
            tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        logs = [(log_dir / f"rank{r}.drafts").read_text() for r in range(2)]
        assert logs[0] == logs[1] and logs[0]
        steps = defaultdict(list)  # per request: the steps interleave differently when chunked
        for line in logs[0].splitlines():
            sid, *row = json.loads(line)
            steps[sid].append(row)
        results.append((tokens, dict(steps)))
    assert results[0] == results[1]
