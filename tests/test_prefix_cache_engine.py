"""Prefix caching through the engine: warm runs equal cold runs exactly, for every method.

"Exactly" means the same tokens, the same drafts at every step and the same accepted counts
(every rank logs its drafting rows, SPECRAY_TEST_DRAFTS_DIR): output text alone would miss a
hit used in one pool but not the other, an EAGLE-3/MTP page reused after the next token
changed, or DFlash context that was never written (each leaves the output right and the
drafts wrong). The cold reference is an engine with caching off. Target pages are 16 tokens;
a standalone drafter's pool falls back to 32 (the block-decode kernel's sizes), so its hits
are multiples of 32.

Turns of one engine: a prompt (cold), the same prompt (a hit), the next turn of the chat (the
prompt, the answer and more: a longer hit) and a prompt that leaves the first one exactly at a
page boundary (shifted drafters must not reuse the page before it: keyed by its successor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import make_checkpoint

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models.drafter_presets import write_drafter_for

METHODS = (None, "ngram", "draft_model", "eagle3", "dflash", "dspark", "mtp")
SHIFTED = ("eagle3", "mtp")
PAGE = 16
FIRST = [(7 * i * i + 3 * i) % 380 + 3 for i in range(45)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    # 6 heads, 6 kv heads and an MLP of 192: tp 2 and tp 3 divide them
    target = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3, hidden_size=96,
                             num_attention_heads=6, num_key_value_heads=6, intermediate_size=192)
    drafters = {m: write_drafter_for(target, m, root / m) for m in METHODS if m not in (None, "ngram")}
    return target, drafters


def config(ckpt, method, cache=True, tp=1, launcher="local", capacity=4096, **kw) -> EngineConfig:
    target, drafters = ckpt
    spec = SpecConfig(method=method, draft_model=str(drafters[method]) if method in drafters else None,
                      num_draft_tokens=3)
    parallel = ParallelConfig(tp_size=tp, launcher=launcher, check_every_step=tp > 1, timeout_s=60.0)
    return EngineConfig(model=str(target), parallel=parallel, spec=spec, **kw,
                        kv=KVConfig(tokens_per_block=PAGE, capacity_tokens=capacity, enable_prefix_caching=cache))


class Runner:
    """Runs one request per call and collects what every rank logged for it."""

    def __init__(self, llm: LLM, log_dir: Path, num_ranks: int):
        self.llm, self.log_dir, self.num_ranks = llm, log_dir, num_ranks
        self.offsets = [0] * num_ranks

    def __call__(self, prompt: list[int], salt: str | None = None, max_tokens: int = MAX_TOKENS) -> dict:
        out = self.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                          cache_salt=salt))[0]
        per_rank = []
        for r in range(self.num_ranks):
            path = self.log_dir / f"rank{r}.drafts"
            text = path.read_text() if path.exists() else ""
            per_rank.append([json.loads(line)[1:] for line in text[self.offsets[r]:].splitlines()])
            self.offsets[r] = len(text)
        assert all(rows == per_rank[0] for rows in per_rank), "ranks drafted differently"
        return dict(tokens=out.token_ids, steps=per_rank[0], cached=out.metrics["num_cached_tokens"],
                    histogram=out.metrics.get("acceptance_histogram"))


def turns(run) -> dict[str, dict]:
    first = run(FIRST)
    repeat = run(FIRST)
    nxt = FIRST + first["tokens"] + [11, 12, 13, 14, 15]
    diverge = FIRST[:2 * PAGE] + [(5 * i) % 380 + 1 for i in range(13)]
    return dict(first=first, repeat=repeat, next=run(nxt), diverge=run(diverge))


def run_engine(ckpt, method, tmp_path, monkeypatch, cache=True, tp=1, launcher="local") -> dict[str, dict]:
    log_dir = tmp_path / f"drafts-{cache}-{tp}"
    log_dir.mkdir()
    monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(log_dir))
    with LLM(config(ckpt, method, cache, tp, launcher)) as llm:
        out = turns(Runner(llm, log_dir, tp))
        if launcher == "local":  # every page is back, free or cached
            assert llm._engine.allocator.num_free == llm._engine.allocator.num_blocks
    return out


def expected_hits(method) -> dict[str, int]:
    # next turn: 74 tokens, the first request's 68 verified ones cached -> 64 in pages of 16 and 32;
    # diverge: 45 tokens sharing 32; a shifted drafter's second page is keyed with token 32, which differs
    return dict(first=0, repeat=32, next=64, diverge=16 if method in SHIFTED else 32)


def assert_same_as_cold(warm: dict, cold: dict, method) -> None:
    for turn in warm:
        assert warm[turn]["tokens"] == cold[turn]["tokens"], turn
        assert warm[turn]["steps"] == cold[turn]["steps"], f"{turn}: drafts or accepted counts differ"
        assert warm[turn]["histogram"] == cold[turn]["histogram"], turn
        if method is not None:
            assert warm[turn]["steps"], f"{turn}: no drafting step was logged"
    assert {t: warm[t]["cached"] for t in warm} == expected_hits(method)
    assert all(cold[t]["cached"] == 0 for t in cold)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m or "plain")
def test_warm_equals_cold(ckpt, method, tmp_path, monkeypatch):
    warm = run_engine(ckpt, method, tmp_path, monkeypatch)
    cold = run_engine(ckpt, method, tmp_path, monkeypatch, cache=False)
    assert_same_as_cold(warm, cold, method)


def test_unkeyed_successor_is_caught(ckpt, tmp_path, monkeypatch):
    """The mutation the successor key prevents: EAGLE-3 pages keyed without their next token
    are reused after a divergence at the page boundary, and the drafts change."""
    from specray.models.drafters.eagle3 import Eagle3Drafter

    cold = run_engine(ckpt, "eagle3", tmp_path, monkeypatch, cache=False)
    monkeypatch.setattr(Eagle3Drafter, "kv_successor_tokens", 0)
    warm = run_engine(ckpt, "eagle3", tmp_path, monkeypatch)
    assert warm["diverge"]["cached"] == 32
    assert warm["diverge"]["steps"] != cold["diverge"]["steps"]
    assert warm["repeat"]["steps"] == cold["repeat"]["steps"]


@pytest.mark.parametrize("method", ["draft_model", "dflash", "eagle3", "mtp"])
def test_a_request_that_never_drafted_publishes_its_pages_once_its_drafter_caught_up(ckpt, method, tmp_path,
                                                                                      monkeypatch):
    """A prompt-only request never drafts, yet its drafter catches up on its pages after the prefill
    (plan.catch_up, executor/prefix_hits.py), so they are published and the next request hits them
    and drafts what a cold run drafts (the same draft log). Before, nothing a drafter shared was
    published until it drafted: with adaptive speculation at length 0 a request never hit its own
    prompt again. A mutation: without the catch-up, the drafter's part of the hit pages is stale
    (never written), and the drafts after the hit differ from the cold run's."""
    from specray.workers.spec_step import SpecRunner

    monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(tmp_path))
    with LLM(config(ckpt, method)) as llm:
        run = Runner(llm, tmp_path, 1)
        assert run(FIRST, max_tokens=1)["cached"] == 0
        cold = run(FIRST, salt="cold")
        warm = run(FIRST)
        assert cold["cached"] == 0 and warm["cached"] == 32
        assert warm["tokens"] == cold["tokens"] and warm["steps"] == cold["steps"]
    monkeypatch.setattr(SpecRunner, "_catch_up", lambda self, seq_ids: None)
    (tmp_path / "stale").mkdir()
    monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(tmp_path / "stale"))  # a log of its own
    with LLM(config(ckpt, method)) as llm:
        run = Runner(llm, tmp_path / "stale", 1)
        run(FIRST, max_tokens=1)
        stale = run(FIRST)
        assert stale["cached"] == 32 and stale["steps"] != cold["steps"]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_cache_salt_isolates(ckpt, method, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(tmp_path))
    with LLM(config(ckpt, method)) as llm:
        run = Runner(llm, tmp_path, 1)
        a = run(FIRST, salt="tenant-a")
        assert run(FIRST, salt="tenant-b")["cached"] == 0
        assert run(FIRST)["cached"] == 0
        again = run(FIRST, salt="tenant-a")
        assert again["cached"] == 32 and again["tokens"] == a["tokens"] and again["steps"] == a["steps"]
        pools = llm._engine.core.prefix_pools
        assert [p.name for p in pools] == (["target", "draft"] if method == "draft_model" else ["target"])
        assert all(p.num_hit_tokens == 32 and p.num_query_tokens == 4 * len(FIRST) for p in pools)


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash"])
def test_preemption_with_caching_on_tiny_pools(ckpt, method):
    """Requests sharing a prefix on a pool too small for them all: preempted requests come back
    through the cache; the output is plain decoding's and every page comes back, free or cached."""
    prompts = [FIRST[:40] + [i + 3] * (3 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(config(ckpt, None, cache=False)) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(config(ckpt, method, capacity=256)) as llm:
        outs = llm.generate(prompts, params)
        engine = llm._engine
        assert engine.allocator.num_free == engine.allocator.num_blocks
        if engine.draft_allocator is not None:
            assert engine.draft_allocator.num_free == engine.draft_allocator.num_blocks
        assert engine.allocator.num_cached_free > 0
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0


# sharded runs take minutes on a 2-core machine: a shifted one-model drafter and a standalone
# one with restored context (the method-specific paths are the single-rank tests' job)
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_warm_equals_cold_tp3_mp(ckpt, method, tmp_path, monkeypatch):
    """Sharded: the cold reference runs at the same tp (the all-reduce's order is part of the maths)."""
    warm = run_engine(ckpt, method, tmp_path, monkeypatch, tp=3, launcher="mp")
    cold = run_engine(ckpt, method, tmp_path, monkeypatch, cache=False, tp=3, launcher="mp")
    assert_same_as_cold(warm, cold, method)


@pytest.mark.parametrize("method", ["draft_model"])
def test_warm_equals_cold_tp2_ray(ray_cluster, ckpt, method, tmp_path, monkeypatch):
    warm = run_engine(ckpt, method, tmp_path, monkeypatch, tp=2, launcher="ray")
    cold = run_engine(ckpt, method, tmp_path, monkeypatch, cache=False, tp=2, launcher="ray")
    assert_same_as_cold(warm, cold, method)
