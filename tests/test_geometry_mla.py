"""The latent pool (MLA) in the geometry agreement, and the MLA decode kernels' page-size
rules, with expected values written as literals."""

from __future__ import annotations

import pytest
import torch

from specray.config import KVConfig
from specray.kv.agreement import RankReport, decide, fingerprint
from specray.kv.geometry import KVLayout, PoolGeometry, allocate_pool
from specray.kv.page_size import check_target_page_size
from specray.models.arch import arch_from_hf_config
from specray.models.mla import MLA_DECODE_KERNELS

DSPARK_KERNEL = {"block_decode_attention": frozenset({32, 64})}
LATENT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=512 + 64, kind="latent")  # kv_lora_rank + qk_rope
DSPARK_KV = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128)


def test_latent_page_bytes_are_layers_x_page_x_row_x_dtype():
    # DeepSeek-V3: 61 layers, 64-token pages, rows of 512 + 64, bfloat16: 61 * 64 * 576 * 2
    g = PoolGeometry(tokens_per_block=64, num_blocks=10, num_layers=61, num_kv_heads=1, head_dim=576,
                     dtype="bfloat16", kind="latent")
    assert g.block_bytes == 4_497_408
    assert g.num_bytes == 44_974_080
    kv = PoolGeometry(tokens_per_block=64, num_blocks=10, num_layers=61, num_kv_heads=1, head_dim=576,
                      dtype="bfloat16")
    assert kv.block_bytes == 2 * g.block_bytes  # a kv pool holds K and V


def test_latent_pool_allocates_one_row_per_token_and_fingerprints_its_kind():
    g = PoolGeometry(tokens_per_block=16, num_blocks=3, num_layers=2, num_kv_heads=1, head_dim=40, dtype="float32",
                     kind="latent")
    pools = allocate_pool(g, torch.device("cpu"))
    assert [tuple(p.shape) for p in pools] == [(3, 1, 1, 16, 40)] * 2
    fp = fingerprint({"target": pools})["target"]
    assert fp["kind"] == "latent" and fp["num_bytes"] == g.num_bytes == 2 * 3 * 16 * 40 * 4


def test_latent_pool_has_one_row_not_heads():
    with pytest.raises(ValueError, match=r"a latent pool holds one row per token \(num_kv_heads 1\), not 4"):
        KVLayout(num_layers=1, num_kv_heads=4, head_dim=576, kind="latent")
    with pytest.raises(ValueError, match=r"pool kind 'state' is not one of \['kv', 'latent'\]"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, kind="state")


def _deepseek_cfg(**overrides) -> dict:
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
               num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, intermediate_size=18432,
               n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
               moe_intermediate_size=2048, first_k_dense_replace=3, routed_scaling_factor=2.5,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                    original_max_position_embeddings=4096))
    return {**cfg, **overrides}


@pytest.mark.parametrize("tp", [1, 2, 16])
def test_latent_bytes_per_token_are_the_same_on_every_tp_rank(tp):
    arch = arch_from_hf_config(_deepseek_cfg())
    assert arch.kv_bytes_per_token(2, tp) == 61 * 576 * 2  # 70,272 bytes: not divided by tp


@pytest.mark.parametrize("kernel, accepted", [("flashmla", [64]), ("trtllm_gen_mla", [32, 64]),
                                              ("cutlass_mla", [128]), ("fp4_mla", [128])])
def test_mla_decode_kernel_page_sizes(kernel, accepted):
    rule = {kernel: MLA_DECODE_KERNELS[kernel]}
    for page in (16, 32, 64, 128, 256):
        if page in accepted:
            assert check_target_page_size(page, [rule]) == page
        else:
            sizes = ", ".join(map(str, accepted))
            with pytest.raises(ValueError, match=rf"tokens_per_block {page} is not accepted by the target kernel "
                                                 rf"{kernel} on rank 0, which accepts \[{sizes}\]"):
                check_target_page_size(page, [rule])


def test_mla_cpu_kernel_takes_every_configured_page_size():
    for page in (8, 16, 32, 64, 128, 256):
        assert check_target_page_size(page, [{"mla_cpu": MLA_DECODE_KERNELS["mla_cpu"]}]) == page


def test_ranks_running_different_mla_kernels_must_share_the_page():
    # trtllm-gen MLA decode rejects 128-token pages, so FP4 MLA on one rank and trtllm-gen on another cannot agree
    per_rank = [{"fp4_mla": MLA_DECODE_KERNELS["fp4_mla"]}, {"trtllm_gen_mla": MLA_DECODE_KERNELS["trtllm_gen_mla"]}]
    with pytest.raises(ValueError, match=r"not accepted by the target kernel trtllm_gen_mla on rank 1"):
        check_target_page_size(128, per_rank)


def _report(rank: int, target_kernel: str) -> RankReport:
    return RankReport(rank=rank, node="n", budget_bytes=100_000_000, target_layout=LATENT,
                      target_kernels={target_kernel: MLA_DECODE_KERNELS[target_kernel]}, draft_layout=DSPARK_KV,
                      draft_kernels=DSPARK_KERNEL)


def test_seed_case_fp4_mla_target_at_128_with_dspark_gets_a_32_token_draft_pool():
    geometry = decide([_report(r, "fp4_mla") for r in range(16)], KVConfig(tokens_per_block=128), "dspark",
                      "bfloat16")
    target, draft = geometry["target"], geometry["draft"]
    assert (target.kind, target.tokens_per_block, draft.kind, draft.tokens_per_block) == ("latent", 128, "kv", 32)
    # per token: latent 4 layers * 576 * 2 = 4608 bytes, draft 2 * 1 * 4 * 128 * 2 = 2048; units of 128 tokens
    # (851,968 bytes): 117 fit in 100 MB, so 14,976 tokens in each pool
    assert target.capacity_tokens == draft.capacity_tokens == 14_976
    assert (target.num_blocks, draft.num_blocks) == (117, 468)
    assert target.num_bytes == 117 * 128 * 4608 and draft.num_bytes == 468 * 32 * 2048


def test_64_token_mla_target_keeps_64_for_dspark():
    geometry = decide([_report(r, "flashmla") for r in range(4)], KVConfig(tokens_per_block=64), "dspark",
                      "bfloat16")
    assert (geometry["target"].tokens_per_block, geometry["draft"].tokens_per_block) == (64, 64)


# ---- the same rules through the real agreement: ranks report a named MLA kernel (SPECRAY_MLA_KERNEL)


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory):
    from checkpoints import make_checkpoint
    from drafter_checkpoints import write_dspark

    root = tmp_path_factory.mktemp("mla-dspark")
    target = make_checkpoint("deepseek_v3", root / "target", seed=5)
    return target, write_dspark(root / "dspark", target)


def _engine(pair, page: int, tp: int = 2):
    """TP 2 (EP 2) under mp with the DSpark drafter: the page rule is agreed between real ranks."""
    from specray import EngineConfig, ParallelConfig, SpecConfig

    target, drafter = pair
    return EngineConfig(model=str(target), kv=KVConfig(tokens_per_block=page, capacity_tokens=1024),
                        parallel=ParallelConfig(tp_size=tp, moe_ep_size=tp, launcher="mp", timeout_s=60.0),
                        spec=SpecConfig(method="dspark", draft_model=str(drafter), num_draft_tokens=3))


def test_seed_case_across_ranks_fp4_mla_at_128_gives_dspark_32(monkeypatch, mla_pair):
    from specray import LLM, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(EngineConfig(model=str(mla_pair[0]), kv=KVConfig(capacity_tokens=1024))) as llm:  # plain, one rank
        expected = [o.token_ids for o in llm.generate([list(range(1, 60))], params)]
    monkeypatch.setenv("SPECRAY_MLA_KERNEL", "fp4_mla")
    with LLM(_engine(mla_pair, 128)) as llm:
        geometry = llm.geometry
        out = [o.token_ids for o in llm.generate([list(range(1, 60))], params)]
    assert (geometry["target"].kind, geometry["target"].tokens_per_block) == ("latent", 128)
    assert (geometry["draft"].kind, geometry["draft"].tokens_per_block) == ("kv", 32)
    assert out == expected


def test_64_token_trtllm_gen_mla_target_keeps_64_for_the_drafter(monkeypatch, mla_pair):
    from specray import LLM

    monkeypatch.setenv("SPECRAY_MLA_KERNEL", "trtllm_gen_mla")
    with LLM(_engine(mla_pair, 64)) as llm:
        assert (llm.geometry["target"].tokens_per_block, llm.geometry["draft"].tokens_per_block) == (64, 64)


def test_a_rank_whose_mla_kernel_rejects_the_page_fails_every_rank_naming_it(monkeypatch, mla_pair):
    from specray import LLM

    monkeypatch.setenv("SPECRAY_MLA_KERNEL", "1:trtllm_gen_mla")  # rank 0 keeps the CPU rule
    with pytest.raises(Exception, match=r"tokens_per_block 128 is not accepted by the target kernel trtllm_gen_mla "
                                        r"on rank 1, which accepts \[32, 64\]"):
        LLM(_engine(mla_pair, 128))
