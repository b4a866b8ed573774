"""State slots (hybrid linear attention) in the geometry: their bytes, their place in the budget,
the fingerprint that catches a rank whose state differs, and the slot allocator. Expected values
are literals computed by hand in the comments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specray.config import KVConfig
from specray.kv.agreement import RankReport, check_fingerprints, decide, fingerprint
from specray.kv.budget import split_budget
from specray.kv.geometry import KVLayout, allocate_pool
from specray.kv.state import StateGeometry, StateLayout, StatePool, allocate_state_pool, num_state_slots
from specray.kv.state_slots import OutOfStateSlots, StateSlotAllocator

# A tiny Gated DeltaNet: 3 linear layers, 2 key heads of 16, 4 value heads of 8, conv kernel 4.
# conv_dim = q + k + v channels = 2*16 + 2*16 + 4*8 = 96; window 96 x 3 = 288 floats;
# recurrent 4 x 16 x 8 = 512 floats; (288 + 512) x 4 bytes x 3 layers = 9600 bytes per slot.
TINY = StateLayout(num_layers=3, conv_dim=96, conv_kernel_size=4, num_heads=4, k_head_dim=16, v_head_dim=8)
TARGET_KERNEL = {"paged_attention": frozenset({8, 16, 32, 64, 128, 256})}
DRAFT_KERNEL = {"block_decode_attention": frozenset({32, 64})}
FULL_ATTENTION = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16)  # 2*1*2*16*4 = 256 bytes a token
DFLASH = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)  # 2*2*2*16*4 = 512 bytes a token


def test_slot_bytes_are_layers_x_window_plus_recurrent_x_float32():
    assert TINY.conv_shape == (96, 3) and TINY.recurrent_shape == (4, 16, 8)
    assert TINY.slot_bytes == 9600


@pytest.mark.parametrize("k, slots, num_bytes", [(0, 8, 76_800), (3, 32, 307_200), (7, 64, 614_400)])
def test_slots_for_max_num_seqs_times_one_plus_k(k, slots, num_bytes):
    # max_num_seqs 8: 8 x (1 + k) rows of 9600 bytes
    assert num_state_slots(8, k) == slots
    assert StateGeometry(layout=TINY, num_slots=num_state_slots(8, k)).num_bytes == num_bytes


def test_qwen3_next_80b_slot_bytes():
    # Qwen3-Next-80B-A3B at TP 1: 36 of its 48 layers are Gated DeltaNet, 16 key heads and 32 value
    # heads of 128, conv kernel 4. conv_dim = 2*16*128 + 32*128 = 8192; window 8192 x 3 = 24,576 floats;
    # recurrent 32 x 128 x 128 = 524,288 floats; (24,576 + 524,288) x 4 x 36 = 79,036,416 bytes a slot.
    # At TP 4 each rank holds a quarter of the heads and channels: 19,759,104 bytes.
    full = StateLayout(num_layers=36, conv_dim=8192, conv_kernel_size=4, num_heads=32, k_head_dim=128,
                       v_head_dim=128)
    quarter = StateLayout(num_layers=36, conv_dim=2048, conv_kernel_size=4, num_heads=8, k_head_dim=128,
                          v_head_dim=128)
    assert full.slot_bytes == 79_036_416
    assert quarter.slot_bytes == 19_759_104
    # 64 sequences with 3 drafts: 256 slots, 20,233,322,496 bytes (18.8 GiB) at TP 1
    assert StateGeometry(layout=full, num_slots=num_state_slots(64, 3)).num_bytes == 20_233_322_496


def test_state_pool_allocates_what_it_charges_and_fingerprints_shapes_and_dtypes():
    geometry = StateGeometry(layout=TINY, num_slots=5)
    pool = allocate_state_pool(geometry, torch.device("cpu"))
    assert [tuple(t.shape) for t in pool.conv] == [(5, 96, 3)] * 3
    assert [tuple(t.shape) for t in pool.recurrent] == [(5, 4, 16, 8)] * 3
    assert fingerprint({"state": pool})["state"] == dict(
        kind="state", num_slots=5, num_layers=3, conv_shape=(96, 3), conv_dtype="float32",
        recurrent_shape=(4, 16, 8), recurrent_dtype="float32", num_bytes=48_000)  # 5 x 9600
    assert geometry.num_bytes == 48_000


def test_a_budget_too_small_for_the_slots_names_bytes_needed_and_available():
    state = StateGeometry(layout=TINY, num_slots=num_state_slots(8, 3))  # 307,200 bytes
    with pytest.raises(ValueError, match=r"the KV budget \(307199 bytes\) cannot hold the state slots: 32 slots x "
                                         r"9600 bytes = 307200 bytes needed"):
        split_budget(budget_bytes=307_199, capacity_tokens=None, target=FULL_ATTENTION, target_page=16,
                     draft=None, draft_page=None, dtype="float32", state=state)
    # an explicit token capacity sizes the pages, not the slots: they are still checked
    with pytest.raises(ValueError, match=r"307200 bytes needed"):
        split_budget(budget_bytes=0, capacity_tokens=64, target=FULL_ATTENTION, target_page=16,
                     draft=None, draft_page=None, dtype="float32", state=state)


def test_slots_that_fit_with_no_page_left_say_what_was_left():
    state = StateGeometry(layout=TINY, num_slots=8)  # 76,800 bytes; one 16-token page is 4096
    with pytest.raises(ValueError, match=r"the KV budget \(4095 bytes left after 76800 bytes of state slots\) "
                                         r"cannot hold 16 tokens"):
        split_budget(budget_bytes=76_800 + 4095, capacity_tokens=None, target=FULL_ATTENTION, target_page=16,
                     draft=None, draft_page=None, dtype="float32", state=state)


def _report(rank: int, budget: int, state: StateLayout | None = TINY) -> RankReport:
    return RankReport(rank=rank, node="n", budget_bytes=budget, target_layout=FULL_ATTENTION,
                      target_kernels=TARGET_KERNEL, draft_layout=DFLASH, draft_kernels=DRAFT_KERNEL,
                      state_layout=state)


@pytest.mark.parametrize("extra, capacity", [(0, 160), (-1, 128)])
def test_slots_are_reserved_before_the_target_draft_page_split(extra, capacity):
    # slots: 8 x (1 + 3) x 9600 = 307,200 bytes. Pages: target 16-token, dflash 32-token, the unit
    # 32 tokens x (256 + 512) = 24,576 bytes. 307,200 + 5 units = 430,080 bytes -> 160 tokens in each
    # pool; one byte less -> 4 units, 128 tokens. Without the reservation 430,080 would hold 17 units.
    budget = 307_200 + 5 * 24_576 + extra
    geometry = decide([_report(0, budget), _report(1, budget + 10**6)], KVConfig(tokens_per_block=16), "dflash",
                      "float32", num_state_slots=num_state_slots(8, 3))
    assert list(geometry) == ["target", "draft", "state"]
    assert geometry["state"].num_slots == 32 and geometry["state"].num_bytes == 307_200
    assert geometry["target"].capacity_tokens == geometry["draft"].capacity_tokens == capacity
    assert (geometry["target"].num_blocks, geometry["draft"].num_blocks) == (capacity // 16, capacity // 32)
    pools = {name: allocate_pool(g, torch.device("cpu")) for name, g in geometry.items() if name != "state"}
    pools["state"] = allocate_state_pool(geometry["state"], torch.device("cpu"))
    allocated = sum(fp["num_bytes"] for fp in fingerprint(pools).values())
    assert allocated == sum(g.num_bytes for g in geometry.values()) <= budget


def test_a_model_without_linear_layers_gets_no_state_pool():
    geometry = decide([_report(0, 10**6, state=None)], KVConfig(tokens_per_block=16), None, "float32",
                      num_state_slots=32)
    assert list(geometry) == ["target"]


def test_a_state_layout_needs_slots():
    with pytest.raises(ValueError, match=r"needs num_state_slots >= 1, not 0"):
        decide([_report(0, 10**6)], KVConfig(tokens_per_block=16), None, "float32")


def test_ranks_reporting_different_state_layouts_fail_in_decide_naming_the_rank():
    other = StateLayout(num_layers=3, conv_dim=48, conv_kernel_size=4, num_heads=2, k_head_dim=16, v_head_dim=8)
    with pytest.raises(ValueError, match=r"rank 2 needs state_layout StateLayout\(num_layers=3, conv_dim=48"):
        decide([_report(0, 10**6), _report(1, 10**6), _report(2, 10**6, other)], KVConfig(tokens_per_block=16),
               None, "float32", num_state_slots=4)


def _fingerprints(*pools: StatePool) -> list[dict]:
    return [fingerprint({"target": allocate_pool(
        split_budget(budget_bytes=0, capacity_tokens=16, target=FULL_ATTENTION, target_page=16, draft=None,
                     draft_page=None, dtype="float32")["target"], torch.device("cpu")), "state": p}) for p in pools]


def test_a_rank_whose_recurrent_state_is_sharded_differently_is_named_with_pool_and_field():
    # rank 1 split the value heads as if for TP 2 (2 heads, and half the conv channels)
    good = allocate_state_pool(StateGeometry(layout=TINY, num_slots=4), torch.device("cpu"))
    halved = StateLayout(num_layers=3, conv_dim=96, conv_kernel_size=4, num_heads=2, k_head_dim=16, v_head_dim=8)
    bad = allocate_state_pool(StateGeometry(layout=halved, num_slots=4), torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"KV geometry mismatch: rank 1 allocated state.recurrent_shape = "
                                           r"\(2, 16, 8\), rank 0 allocated \(4, 16, 8\)"):
        check_fingerprints(_fingerprints(good, bad, good))


def test_a_rank_whose_conv_window_differs_in_shape_or_dtype_is_named():
    good = allocate_state_pool(StateGeometry(layout=TINY, num_slots=4), torch.device("cpu"))
    kernel_3 = StateLayout(num_layers=3, conv_dim=96, conv_kernel_size=3, num_heads=4, k_head_dim=16, v_head_dim=8)
    short = allocate_state_pool(StateGeometry(layout=kernel_3, num_slots=4), torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"rank 2 allocated state.conv_shape = \(96, 2\), rank 0 allocated \(96, 3\)"):
        check_fingerprints(_fingerprints(good, good, short))
    half = StatePool(conv=[t.to(torch.bfloat16) for t in good.conv], recurrent=good.recurrent)
    with pytest.raises(RuntimeError, match=r"rank 1 allocated state.conv_dtype = bfloat16, rank 0 allocated float32"):
        check_fingerprints(_fingerprints(good, half))


def test_a_state_pool_is_float32_and_validates_its_shape():
    with pytest.raises(ValueError, match=r"a state pool is kind 'state' in float32, not 'state' in bfloat16"):
        StateGeometry(layout=TINY, num_slots=4, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"state conv_kernel_size \(1\) must be >= 2"):
        StateLayout(num_layers=1, conv_dim=8, conv_kernel_size=1, num_heads=1, k_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match=r"state num_heads \(0\) must be >= 1"):
        StateLayout(num_layers=1, conv_dim=8, conv_kernel_size=4, num_heads=0, k_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match=r"num_draft_tokens \(-1\) must be >= 0"):
        num_state_slots(4, -1)


# ---- the slot allocator


def test_no_free_slot_is_a_clear_error_and_a_freed_slot_is_reused():
    alloc = StateSlotAllocator(2, rows_per_slot=4)
    assert (alloc.allocate(10), alloc.allocate(11)) == (0, 1)
    assert alloc.rows(1) == range(4, 8) and alloc.num_rows == 8
    with pytest.raises(OutOfStateSlots, match=r"no free state slot for sequence 12: all 2 are held"):
        alloc.allocate(12)
    alloc.free(10)  # finished
    assert alloc.allocate(12) == 0
    with pytest.raises(RuntimeError, match=r"sequence 10 holds no state slot \(freed twice"):
        alloc.free(10)
    with pytest.raises(ValueError, match=r"sequence 12 already holds state slot 0"):
        alloc.allocate(12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8),
       st.lists(st.tuples(st.sampled_from(["admit", "finish", "abort", "preempt"]), st.integers(0, 31)), max_size=200))
def test_slots_never_leak_or_overlap(num_slots, rows_per_slot, ops):
    alloc = StateSlotAllocator(num_slots, rows_per_slot)
    running: list[int] = []
    next_id = 0
    for op, pick in ops:
        if op == "admit":
            try:
                alloc.allocate(next_id)
                running.append(next_id)
            except OutOfStateSlots:
                assert len(running) == num_slots
            next_id += 1
        elif running:  # finish, abort and preemption all give the slot back
            alloc.free(running.pop(pick % len(running)))
        rows = [r for s in running for r in alloc.rows(alloc.slot_of(s))]
        assert len(rows) == len(set(rows)) == len(running) * rows_per_slot, "two sequences share a state row"
        assert all(0 <= r < alloc.num_rows for r in rows)
        assert len(running) + alloc.num_free == num_slots, "a slot is neither free nor held"
    for s in running:
        alloc.free(s)
    assert alloc.num_free == num_slots
