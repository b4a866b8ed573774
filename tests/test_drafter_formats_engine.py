"""Drafters in their published formats inside the engine: greedy speculative output equals
plain greedy output (TP 1 and 2, k in {1, 3}, 32- and 64-token pages, prompts whose outputs
cross pages, a MoE target with expert parallelism), sampled requests beside greedy ones with
a draft vocabulary, and the block drafters' own pool page size (literals)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints import make_checkpoint
from drafter_checkpoints import write_dflash, write_dspark, write_eagle3

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig



PROMPTS = [list(range(3, 3 + n)) for n in (5, 61, 30)]  # prompt + 40 tokens crosses 32/64-token pages
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmt-engine")
    target_dir = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3)
    drafters = {"eagle3": write_eagle3(root / "eagle3", target_dir, "speculators", 200, True),
                "dflash": write_dflash(root / "dflash", target_dir),
                "dspark": write_dspark(root / "dspark", target_dir, draft_vocab_size=200, markov_head_type="gated")}
    return target_dir, drafters


def engine(ckpts, method=None, k=3, page=32, tp=1) -> EngineConfig:
    target_dir, drafters = ckpts
    parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local", check_every_step=tp > 1,
                              timeout_s=60.0)
    spec = SpecConfig(method=method, draft_model=str(drafters[method]) if method else None, num_draft_tokens=k)
    return EngineConfig(model=str(target_dir), kv=KVConfig(tokens_per_block=page, capacity_tokens=4096),
                        parallel=parallel, spec=spec)


@pytest.fixture(scope="module")
def plain(engine_ckpts):
    with LLM(engine(engine_ckpts)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_greedy_speculative_output_is_the_targets(engine_ckpts, plain, method, k, page, tp):
    with LLM(engine(engine_ckpts, method, k, page, tp)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert all(o.metrics["num_verify_steps"] > 0 for o in outs)


@pytest.mark.parametrize("tp", [1, 2])
def test_speculators_dflash_layout_is_lossless(engine_ckpts, plain, tmp_path, tp):
    target_dir, _ = engine_ckpts
    ckpts = (target_dir, {"dflash": write_dspark(tmp_path / "df", target_dir, draft_vocab_size=200,
                                                 algorithm="dflash")})
    with LLM(engine(ckpts, "dflash", k=3, page=64, tp=tp)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_sampled_requests_with_a_draft_vocabulary(engine_ckpts, plain, method):
    # d2t drafters give -inf to target ids outside the draft vocabulary: rejection sampling
    # must take those zero draft probabilities (and top-k/top-p over them) in its stride
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    with LLM(engine(engine_ckpts, method)) as llm:
        outs = llm.generate(PROMPTS, [PARAMS, sampled, PARAMS])
    assert outs[0].token_ids == plain[0] and outs[2].token_ids == plain[2]
    assert len(outs[1].token_ids) == 40 and outs[1].token_ids != plain[1]


def test_moe_target_expert_parallel(tmp_path):
    target_dir = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=3, num_hidden_layers=3)
    ckpts = (target_dir, {"eagle3": write_eagle3(tmp_path / "eagle3", target_dir),
                          "dflash": write_dflash(tmp_path / "dflash", target_dir),
                          "dspark": write_dspark(tmp_path / "dspark", target_dir)})
    with LLM(engine(ckpts)) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    for method in ("eagle3", "dflash", "dspark"):
        cfg = engine(ckpts, method, tp=2)
        cfg = replace(cfg, parallel=replace(cfg.parallel, moe_ep_size=2))
        with LLM(cfg) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected, method


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("narrowed, target_page, expected", [(None, 64, 64), ("0:32", 64, 32), (None, 128, 32)])
def test_block_drafter_pool_page_size(engine_ckpts, monkeypatch, method, narrowed, target_page, expected):
    if narrowed is None:
        monkeypatch.delenv("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", raising=False)
    else:
        monkeypatch.setenv("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", narrowed)
    with LLM(engine(engine_ckpts, method, page=target_page)) as llm:
        assert llm.geometry["target"].tokens_per_block == target_page
        assert llm.geometry["draft"].tokens_per_block == expected
        assert llm.geometry["draft"].num_layers == 2  # the drafter's own pool: its two layers
