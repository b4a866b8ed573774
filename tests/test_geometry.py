"""The geometry rules, with expected values written as literals."""

from __future__ import annotations

import pytest
import torch

from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.kv.agreement import RankReport, check_fingerprints, decide, fingerprint
from specray.kv.budget import kv_budget_bytes, split_budget
from specray.kv.geometry import KVLayout, allocate_pool
from specray.kv.page_size import check_target_page_size, choose_draft_page_size, has_separate_draft_pool

DRAFT_KERNEL = {"block_decode_attention": frozenset({32, 64})}
TARGET_KERNEL = {"paged_attention": frozenset({8, 16, 32, 64, 128, 256})}


@pytest.mark.parametrize("method", ["draft_model", "dflash"])
@pytest.mark.parametrize("target, expected", [(8, 32), (16, 32), (32, 32), (64, 64), (128, 32), (256, 32)])
def test_standalone_drafter_page_size(method, target, expected):
    assert choose_draft_page_size(method, target, [DRAFT_KERNEL, DRAFT_KERNEL]) == expected


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
@pytest.mark.parametrize("target", [64, 128])
def test_one_model_drafter_keeps_target_page_and_pool(method, target):
    assert choose_draft_page_size(method, target, [{}]) == target
    assert has_separate_draft_pool(method) is False


@pytest.mark.parametrize("method, separate", [("draft_model", True), ("dflash", True), ("mtp", False),
                                              ("eagle3", False), (None, False)])
def test_separate_pool_decision(method, separate):
    assert has_separate_draft_pool(method) is separate


def test_no_speculation_has_no_draft_page():
    assert choose_draft_page_size(None, 64, []) is None


def test_one_rank_narrowed_to_32_moves_everyone_to_32():
    narrowed = {"block_decode_attention": frozenset({32})}
    assert choose_draft_page_size("dflash", 64, [DRAFT_KERNEL, narrowed, DRAFT_KERNEL]) == 32


def test_no_shared_page_size_is_a_clear_error():
    only_64 = {"block_decode_attention": frozenset({64})}
    with pytest.raises(ValueError, match=r"rank 1: block_decode_attention accepts \[64\]"):
        choose_draft_page_size("draft_model", 128, [DRAFT_KERNEL, only_64])


def test_target_page_size_must_be_accepted_by_every_rank():
    with pytest.raises(ValueError, match=r"tokens_per_block 128 is not accepted by the target kernel k on rank 1, "
                                         r"which accepts \[16, 64\]"):
        check_target_page_size(128, [TARGET_KERNEL, {"k": frozenset({16, 64})}])


TARGET = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)
DRAFTERS = {"draft_model": KVLayout(num_layers=1, num_kv_heads=4, head_dim=64),
            "dflash": KVLayout(num_layers=2, num_kv_heads=4, head_dim=64)}


@pytest.mark.parametrize("method", ["draft_model", "dflash"])
@pytest.mark.parametrize("target_page, draft_page", [(64, 64), (128, 32)])
def test_budget_charged_equals_bytes_allocated(method, target_page, draft_page):
    budget = 50_000_000
    report = RankReport(rank=0, node="n", budget_bytes=budget, target_layout=TARGET,
                        target_kernels=TARGET_KERNEL, draft_layout=DRAFTERS[method], draft_kernels=DRAFT_KERNEL)
    geometry = decide([report], KVConfig(tokens_per_block=target_page), method, "float32")
    assert geometry["target"].tokens_per_block == target_page
    assert geometry["draft"].tokens_per_block == draft_page
    assert geometry["target"].capacity_tokens == geometry["draft"].capacity_tokens
    charged = sum(g.num_bytes for g in geometry.values())
    allocated = sum(fp["num_bytes"] for fp in fingerprint(
        {name: allocate_pool(g, torch.device("cpu")) for name, g in geometry.items()}).values())
    assert charged == allocated <= budget
    # per token: target 2*8*4*64*4 = 16384 bytes, draft 2*L*4*64*4 = 2048*L bytes
    per_token = 16384 + 2048 * DRAFTERS[method].num_layers
    assert geometry["target"].capacity_tokens == budget // (per_token * 128) * 128
    assert budget - charged < per_token * 128  # nothing worth a whole unit is left unused


def test_explicit_capacity_rounds_up_to_whole_pages_in_both_pools():
    geometry = split_budget(budget_bytes=0, capacity_tokens=1000, target=TARGET, target_page=128,
                            draft=DRAFTERS["dflash"], draft_page=32, dtype="float32")
    assert geometry["target"].num_blocks == 8 and geometry["draft"].num_blocks == 32  # 1024 tokens each


def test_minimum_budget_over_ranks_wins():
    reports = [RankReport(rank=r, node="n", budget_bytes=b, target_layout=TARGET, target_kernels=TARGET_KERNEL)
               for r, b in enumerate([10_000_000, 4_000_000, 8_000_000])]
    geometry = decide(reports, KVConfig(tokens_per_block=16), None, "float32")
    assert geometry.keys() == {"target"}
    assert geometry["target"].num_blocks == 4_000_000 // (16384 * 16)  # 15


@pytest.mark.parametrize("available, fraction, ranks, cap, expected", [
    (16_000, 0.5, 1, 1 << 40, 8_000),  # one rank: the whole fraction
    (16_000, 0.5, 8, 1 << 40, 1_000),  # 8 ranks on a host split it: 8 x 1000 = 0.5 x 16000
    (16_000, 0.5, 3, 1 << 40, 2_666),  # rounded down, so the sum never exceeds the fraction
    (16_000, 0.5, 2, 3_000, 3_000),  # the cap applies to each rank's share
    (16_000, 0.5, 1, None, 8_000),  # no cap (a GPU)
])
def test_kv_budget_splits_the_fraction_between_ranks_sharing_memory(available, fraction, ranks, cap, expected):
    got = kv_budget_bytes(available_bytes=available, memory_fraction=fraction, num_ranks_sharing=ranks, cap_bytes=cap)
    assert got == expected
    assert ranks * got <= fraction * available


def test_kv_budget_needs_at_least_one_rank():
    with pytest.raises(ValueError, match=r"num_ranks_sharing \(0\) must be >= 1"):
        kv_budget_bytes(available_bytes=1, memory_fraction=0.5, num_ranks_sharing=0, cap_bytes=None)


def test_fingerprint_mismatch_names_rank_pool_and_field():
    fp = {"target": dict(tokens_per_block=64, num_blocks=10)}
    with pytest.raises(RuntimeError, match=r"rank 2 allocated target.num_blocks = 11, rank 0 allocated 10"):
        check_fingerprints([fp, fp, {"target": dict(tokens_per_block=64, num_blocks=11)}])


def test_llm_geometry_single_rank():
    with LLM(EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=64, capacity_tokens=1000))) as llm:
        (name, g), = llm.geometry.items()
    # tiny-llama: 4 layers, 4 kv heads, head_dim 32; 1000 tokens round up to 16 pages of 64
    assert (name, g.tokens_per_block, g.num_blocks, g.num_layers, g.num_kv_heads, g.head_dim) == \
        ("target", 64, 16, 4, 4, 32)
    assert g.num_bytes == 16 * 2 * 4 * 4 * 64 * 32 * 4


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
@pytest.mark.parametrize("target_page", [64, 128])
def test_one_model_drafter_layers_live_in_the_target_pool(method, target_page):
    model = "tiny-llama-mtp" if method == "mtp" else "tiny-llama"  # mtp: the target with its own MTP module
    config = EngineConfig(model=model, kv=KVConfig(tokens_per_block=target_page, capacity_tokens=1024),
                          spec=SpecConfig(method=method, num_draft_tokens=3))
    with LLM(config) as llm:
        geometry = llm.geometry
        out = llm.generate([list(range(1, 100))], SamplingParams(max_tokens=40, ignore_eos=True))
    assert list(geometry) == ["target"]  # no draft pool
    assert geometry["target"].tokens_per_block == target_page
    assert geometry["target"].num_layers == 4 + 1  # tiny-llama's 4 layers + the drafter's one
    assert len(out[0].token_ids) == 40
