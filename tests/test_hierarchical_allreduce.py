"""Hierarchical all-reduce (comm/hierarchical.py) for groups spanning simulated nodes: every
rank holds bitwise the same result, equal to the nested sum in its fixed order (ranks of a node
in group order, then nodes in order), for every dtype; and ``auto`` picks it only where it
measured faster (selection rules, with literals).

Node membership is simulated under processes of one host (rank r on node r // per_node): shared
memory and the leaders' exchange see exactly what they would on real nodes. One spawn per
world size, every check inside it (starting processes dominates on two cores).
"""

from __future__ import annotations

import pytest
import torch

from specray.comm.allreduce import HIERARCHICAL_MIN_RANKS, HIERARCHICAL_THRESHOLD_BYTES, make_reducer, select_path
from specray.comm.hierarchical import node_layout, reference_sum
from test_one_shot import DTYPES, bits, join_world, rank_input, rank_order_sum, results_by_rank, spawn_ranks

LAYOUTS = {4: 2, 6: 2, 16: 4}
"""world size -> ranks per node: 2 nodes x 2, 3 x 2, 4 x 4."""


def test_node_layout_orders_nodes_by_lowest_rank_and_ranks_by_group_order():
    assert node_layout([0, 1, 2, 3, 4, 5], [1, 1, 0, 0, 2, 2]) == [(0, 1), (2, 3), (4, 5)]
    assert node_layout([3, 5, 8], [7, 2, 7]) == [(3, 8), (5,)]


def test_reference_sum_nests_node_partials():
    inputs = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    # ((1e8 + 1) + (-1e8 + 1)) in float32: 1e8 + 1 rounds to 1e8, so the nested order gives 0
    assert reference_sum(inputs, [(0, 1), (2, 3)], [0, 1, 2, 3]).item() == 0.0
    assert reference_sum(inputs, [(0, 2), (1, 3)], [0, 1, 2, 3]).item() == 2.0  # (1e8 - 1e8) + (1 + 1)


BASE = dict(backend="gloo", is_supported_machine=True)


@pytest.mark.parametrize("mode, node_ids, path, reason", [
    ("auto", [0, 0, 1, 1], "hierarchical", ""),
    ("auto", [0, 0, 0, 1, 1, 1], "hierarchical", ""),
    ("auto", [0, 1], "torch", f"from {HIERARCHICAL_MIN_RANKS} ranks"),  # below the measured threshold
    ("auto", [0, 0, 1], "torch", f"from {HIERARCHICAL_MIN_RANKS} ranks"),
    ("auto", [0, 1, 2, 3], "torch", "one rank on each"),
    ("auto", [0] * 65 + [1], "torch", "a node holds 65 ranks"),
    ("one_shot", [0, 0, 1, 1], "torch", "hierarchical only under 'auto'"),
    ("torch", [0, 0, 1, 1], "torch", "allreduce='torch'"),
])
def test_auto_selects_hierarchical_only_where_it_measured_faster(mode, node_ids, path, reason):
    got_path, got_reason = select_path(mode, group_size=len(node_ids), node_ids=node_ids, **BASE)
    assert got_path == path and reason in got_reason, got_reason
    assert HIERARCHICAL_MIN_RANKS == 4  # 2 nodes x 2: the smallest layout bench_scale.py measured faster


def _check(reducer, rank, world, layout, shape, dtype, case, make_input=None) -> bytes:
    make_input = make_input or (lambda r: rank_input(r, shape, dtype, case))
    out = reducer(make_input(rank))
    ref = reference_sum([make_input(r).contiguous() for r in range(world)], layout, list(range(world)))
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(bits(out), bits(ref)), f"{dtype} {shape} case {case}: differs from the nested sum"
    return bits(out).numpy().tobytes()


def _body(rank: int, world: int, store_path: str, queue) -> dict:
    group = join_world(rank, world, store_path)
    nodes = [r // LAYOUTS[world] for r in range(world)]
    layout = node_layout(range(world), nodes)
    reducer = make_reducer(group, nodes, "auto", 30.0, job_id="hier")
    assert reducer is not None and reducer.path == "hierarchical"
    digests, case = [], 0
    for dtype in DTYPES:
        for shape in [(1,), (4099,), (3, 5, 64)]:
            case += 1
            digests.append(_check(reducer, rank, world, layout, shape, dtype, case))
        case += 1  # non-contiguous input: a transposed matrix
        digests.append(_check(reducer, rank, world, layout, (48, 33), dtype, case,
                              lambda r: rank_input(r, (33, 48), dtype, case).t()))
    # the nested order is not the flat rank order: the check above would catch a flat sum
    flat = rank_order_sum([rank_input(r, (4099,), torch.bfloat16, 5) for r in range(world)])
    nested = reference_sum([rank_input(r, (4099,), torch.bfloat16, 5) for r in range(world)], layout, range(world))
    routes = [reducer.route(torch.empty(HIERARCHICAL_THRESHOLD_BYTES // 4)),
              reducer.route(torch.empty(HIERARCHICAL_THRESHOLD_BYTES // 4 + 1))]
    big = reducer(torch.full((HIERARCHICAL_THRESHOLD_BYTES // 4 + 1,), float(rank)))  # to gloo
    calls = reducer.fast.num_calls
    reducer.close()
    group.barrier()
    return dict(digests=digests, orders_differ=not torch.equal(bits(flat), bits(nested)), routes=routes,
                big=big[:2].tolist(), calls=calls)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_hierarchical_is_bitwise_equal_on_every_rank_and_to_the_nested_sum(tmp_path, world):
    results = results_by_rank(*spawn_ranks(world, _body, tmp_path, timeout_s=240.0))
    assert sorted(results) == list(range(world))
    first = results[0]
    assert len(first["digests"]) == 4 * len(DTYPES)
    for rank, value in results.items():
        assert value["digests"] == first["digests"], f"rank {rank} holds other bytes than rank 0"
        assert value["routes"] == ["hierarchical", "torch"]  # up to the threshold, then flat gloo
        assert value["calls"] == 4 * len(DTYPES)  # the message above the threshold went to gloo
        assert value["big"] == [float(sum(range(world)))] * 2
    assert first["orders_differ"], "these inputs must tell the nested order from the flat one"
