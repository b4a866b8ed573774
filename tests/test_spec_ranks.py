"""Speculative decoding sharded over two ranks (``mp`` launcher, CPU, gloo).

Reference: plain greedy decoding of the same checkpoint on one rank. Every rank must end
each call with the same tokens: ``check_every_step`` compares them after every step
(including the forced-acceptance draws, which come from per-request generators).
"""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

import specray.launch.mp  # noqa: F401  (imported plainly: an import error must fail these tests, never skip them)
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models.drafter_presets import write_drafter_for

PROMPTS = [list(range(3, 3 + n)) for n in (5, 61, 30, 13)]
PARAMS = SamplingParams(max_tokens=64, ignore_eos=True)
KV = KVConfig(tokens_per_block=32, capacity_tokens=8192)
METHODS = ("draft_model", "dflash", "eagle3", "mtp")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-ranks")
    out = {}
    for family in ("llama", "qwen3_moe"):
        target = make_checkpoint(family, root / family, seed=3, num_hidden_layers=3)
        out[family] = (target, {m: write_drafter_for(target, m, root / f"{family}-{m}") for m in METHODS})
    return out


def run(ckpt, method=None, tp=1, moe_ep=None, **spec) -> list:
    target, drafters = ckpt
    parallel = ParallelConfig(tp_size=tp, moe_ep_size=moe_ep, launcher="mp" if tp > 1 else "local",
                              check_every_step=True, timeout_s=60.0)
    s = SpecConfig(method=method, draft_model=str(drafters[method]) if method else None, num_draft_tokens=3, **spec)
    with LLM(EngineConfig(model=str(target), kv=KV, parallel=parallel, spec=s)) as llm:
        return llm.generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def plain(ckpts):
    return {family: [o.token_ids for o in run(ckpt)] for family, ckpt in ckpts.items()}


@pytest.mark.parametrize("method", METHODS)
def test_two_rank_speculative_output_is_the_targets(ckpts, plain, method):
    outs = run(ckpts["llama"], method, tp=2)
    assert [o.token_ids for o in outs] == plain["llama"]
    assert all(o.metrics["num_verify_steps"] > 0 for o in outs)


def test_two_rank_moe_target_expert_parallel(ckpts, plain):
    outs = run(ckpts["qwen3_moe"], "draft_model", tp=2, moe_ep=2)
    assert [o.token_ids for o in outs] == plain["qwen3_moe"]


def test_two_rank_forced_acceptance(ckpts):
    outs = run(ckpts["llama"], "eagle3", tp=2, force_accepted_tokens=3.0)
    # every rank drew the same forced counts (checked per step); each step emitted exactly 3
    assert all(o.metrics["acceptance_length"] == 3.0 for o in outs)
