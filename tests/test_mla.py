"""MLA models (DeepSeek-V3, and Kimi-K2's shape) against transformers' DeepseekV3ForCausalLM on
tiny save_pretrained checkpoints (float32 CPU): greedy tokens, logits, the latent pool's contents,
sharded runs under mp (TP 2 and 4, EP 2 and 4)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams

PROMPT_LENS = (3, 41, 97, 200)  # end mid-page for every page size tested
NEW_TOKENS = 72  # 200 + 72 crosses two 128-token page boundaries
SHAPES = ("deepseek_v3", "kimi_k2")


def _build(shape: str, tmp_path_factory):
    directory = make_checkpoint(shape, tmp_path_factory.mktemp(shape))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    return shape, directory, prompts, expected, reference


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Each shape's checkpoint, prompts and transformers' greedy continuations, built once."""
    built = {}

    def get(shape: str):
        if shape not in built:
            built[shape] = _build(shape, tmp_path_factory)
        return built[shape]

    return get


@pytest.fixture(params=SHAPES)
def mla_case(request, cases):
    return cases(request.param)


def test_checkpoints_have_the_shapes_under_test(mla_case):
    shape, directory, *_ = mla_case
    from specray.models.loader import read_model_arch

    arch = read_model_arch(directory)
    assert arch.mixers == ("mla",) * 3 and arch.moe_layers == (1, 2)
    if shape == "deepseek_v3":
        assert arch.mla.q_lora_rank == 48 and arch.mla.rope_interleave and arch.yarn.factor == 4.0
        assert (arch.router.n_group, arch.router.topk_group) == (4, 2)
    else:
        assert arch.mla.q_lora_rank is None and arch.yarn is None and arch.router.n_group == 1
    assert arch.head_dim == 24  # qk_nope + qk_rope, not the config's head_dim (= qk_rope_head_dim, 8)


@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_greedy_matches_transformers(mla_case, tokens_per_block):
    _, directory, prompts, expected, _ = mla_case
    config = EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=tokens_per_block, capacity_tokens=4096))
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
        geometry = llm.geometry["target"]
    assert [o.token_ids for o in outs] == expected
    assert geometry.kind == "latent" and (geometry.num_kv_heads, geometry.head_dim) == (1, 32 + 8)


def _prefill(directory, prompt: list[int], page: int = 16):
    """specray's logits and latent pool after ``prompt`` (one rank)."""
    from specray.comm.context import DistContext
    from specray.kv.geometry import PoolGeometry, allocate_pool
    from specray.models.attention import build_metadata
    from specray.models.loader import load_model

    model = load_model(directory, DistContext.single("cpu"), "float32")
    layout = model.kv_layout
    num_blocks = -(-len(prompt) // page)
    geometry = PoolGeometry(tokens_per_block=page, num_blocks=num_blocks, num_layers=layout.num_layers,
                            num_kv_heads=1, head_dim=layout.head_dim, dtype="float32", kind=layout.kind)
    pools = allocate_pool(geometry, torch.device("cpu"))
    positions, meta = build_metadata([list(range(num_blocks))], page, [0], [len(prompt)], torch.device("cpu"))
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor(prompt), positions, pools, meta))
    rows = [pool[:, 0, 0].reshape(-1, layout.head_dim)[: len(prompt)] for pool in pools]
    return logits, rows


def test_logits_and_latent_pool_match_transformers(mla_case):
    # Tolerance: both sides are float32; specray merges gate/up into one matmul and sums experts
    # with index_add in the same order, so ops differ by a few ulp; through three layers that
    # stays below 1e-4 on logits of order 0.1-1 (and 1e-5 on the latents of unit-norm c), while
    # a wrong rotation, mask, scale or shard moves them by > 1e-2.
    _, directory, prompts, _, reference = mla_case
    prompt = prompts[2]
    ours, rows = _prefill(directory, prompt)
    with torch.inference_mode():
        out = reference(torch.tensor([prompt]), use_cache=True)
    torch.testing.assert_close(ours, out.logits[0], rtol=0, atol=1e-4)
    rank = 32
    for layer, row in zip(out.cache.layers, rows):  # transformers caches (c, k_rot) per layer
        torch.testing.assert_close(row[:, :rank], layer.keys[0, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(row[:, rank:], layer.values[0, 0], rtol=0, atol=1e-5)


def test_decode_attends_through_the_pool(mla_case):
    # mutation check: a decode step that ignored the cached latents (attending to itself only)
    # would still produce tokens; zeroing the pool after the prompt must change them
    _, directory, prompts, expected, _ = mla_case
    from specray.models import mla

    real = mla.write_latent

    def forget(pool, latent, slots):
        pool.zero_()
        real(pool, latent, slots)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla, "write_latent", forget)
        with LLM(EngineConfig(model=str(directory), kv=KVConfig(capacity_tokens=1024))) as llm:
            out = llm.generate([prompts[1]], SamplingParams(max_tokens=16))[0]
    assert out.token_ids != expected[1][:16]


SHARDED = [("deepseek_v3", 2, 1, 2), ("deepseek_v3", 4, 1, 4), ("deepseek_v3", 4, 2, 2), ("kimi_k2", 2, 2, 1),
           ("kimi_k2", 4, 1, 4)]


@pytest.mark.parametrize("shape,tp,moe_tp,moe_ep", SHARDED)
def test_sharded_greedy_matches_transformers(cases, shape, tp, moe_tp, moe_ep):
    _, directory, prompts, expected, _ = cases(shape)
    config = EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=32, capacity_tokens=2048),
                          parallel=ParallelConfig(tp_size=tp, moe_tp_size=moe_tp, moe_ep_size=moe_ep, launcher="mp",
                                                  timeout_s=60.0))
    with LLM(config) as llm:
        outs = llm.generate(prompts[:3], SamplingParams(max_tokens=NEW_TOKENS))
        geometry = llm.geometry["target"]
    assert [o.token_ids for o in outs] == expected[:3]
    # the latent is not split by heads: every rank holds the whole row (40 = 32 + 8), as at TP 1
    assert (geometry.kind, geometry.num_kv_heads, geometry.head_dim) == ("latent", 1, 40)


def test_bfloat16_runs_with_a_float32_router_and_a_bfloat16_latent_pool(mla_case):
    # regression: interleaved RoPE returned float32 rows that a bfloat16 pool refused
    _, directory, prompts, _, _ = mla_case
    from specray.comm.context import DistContext
    from specray.models.loader import load_model

    model = load_model(directory, DistContext.single("cpu"), "bfloat16")
    router = model.layers[1].mlp
    assert router.gate.dtype == router.score_bias.dtype == torch.float32  # routing in float32, as transformers
    assert model.layers[1].mlp.w_gate_up.dtype == torch.bfloat16
    with LLM(EngineConfig(model=str(directory), dtype="bfloat16", kv=KVConfig(capacity_tokens=1024))) as llm:
        out = llm.generate([prompts[1]], SamplingParams(max_tokens=16))[0]
        geometry = llm.geometry["target"]
    assert geometry.dtype == "bfloat16" and geometry.block_bytes == 3 * 16 * 40 * 2
    assert len(out.token_ids) == 16


def test_an_mla_draft_model_keeps_the_greedy_tokens_in_its_own_latent_pool(cases, tmp_path):
    # a draft model cut from an MLA target (its first layer) is a standalone drafter whose pool is
    # latent rows, not K/V per head; lossless against the target's greedy tokens
    from specray import SpecConfig
    from specray.models.drafter_presets import write_drafter_for

    _, directory, prompts, expected, _ = cases("deepseek_v3")
    draft = write_drafter_for(directory, "draft_model", tmp_path / "draft")
    spec = SpecConfig(method="draft_model", draft_model=str(draft), num_draft_tokens=3)
    with LLM(EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=16, capacity_tokens=4096),
                          spec=spec)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        pool = llm.geometry["draft"]
    assert [o.token_ids for o in outs] == expected
    assert (pool.kind, pool.num_layers) == ("latent", 1)
    assert all(o.metrics["num_verify_steps"] > 0 for o in outs)
