"""One-shot shared-memory all-reduce: bitwise results, selection and isolation of groups; and the
process harness the other test_one_shot_* files share.

Each multi-process test starts its ranks once (gloo, FileStore rendezvous in tmp_path, no port)
and runs many checks inside, because starting processes dominates the cost on two cores; ranks
fork from a forkserver that imported torch once, rather than each importing it again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specray.comm.allreduce import AUTO_THRESHOLD_BYTES, make_reducer
from specray.comm.group import TorchGroup

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
THRESHOLD = AUTO_THRESHOLD_BYTES
"""The production threshold, so 'above the threshold' means what it means for users."""


# ---------------------------------------------------------------- process harness


def join_world(rank: int, world: int, store_path: str) -> TorchGroup:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    return TorchGroup(tuple(range(world)), rank, "gloo", 60.0)


def _rank_entry(rank: int, world: int, store_path: str, body, queue) -> None:
    torch.set_num_threads(1)
    try:
        queue.put((rank, "result", body(rank, world, store_path, queue)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def spawn_ranks(world: int, body, tmp_path, timeout_s: float = 120.0):
    """Run body(rank, world, store_path, queue) on `world` fresh processes; return (messages, exitcodes).

    Messages are drained while the ranks run: a child cannot exit before its queue is flushed."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "specray.comm.allreduce", "specray.comm.context", "test_one_shot"])
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, str(tmp_path / "store"), body, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    messages, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (any(p.is_alive() for p in procs) or not queue.empty()):
            try:
                messages.append(queue.get(timeout=0.1))
            except Empty:
                pass
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    return messages, [p.exitcode for p in procs]


def results_by_rank(messages, exitcodes) -> dict[int, object]:
    errors = [m[2] for m in messages if m[1] == "error"]
    assert not errors, "\n".join(errors)
    assert exitcodes == [0] * len(exitcodes), exitcodes
    return {rank: value for rank, kind, value in messages if kind == "result"}


# ---------------------------------------------------------------- inputs and references


@functools.lru_cache(maxsize=None)
def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per rank, magnitudes spread over 1e-3..1e3 so that summation order changes
    the rounded result (a wrong order then fails the bitwise check). Made once per rank and
    dtype; cases take windows of it."""
    g = torch.Generator().manual_seed(rank)
    n = 2 * THRESHOLD // dtype.itemsize + 8192
    return (torch.randn(n, generator=g) * torch.pow(10.0, torch.empty(n).uniform_(-3, 3, generator=g))).to(dtype)


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, case: int) -> torch.Tensor:
    """A fresh tensor (the reducers sum in place) from a window of _values chosen by case."""
    values, numel = _values(rank, dtype), torch.Size(shape).numel()
    start = (case * 7919) % (len(values) - numel + 1)
    return values[start:start + numel].view(shape).clone()


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, parts)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def check_bitwise(reducer, rank: int, world: int, shape, dtype, case: int, make_input=None) -> bytes:
    """Reduce one case; assert bitwise equality with the rank-order reference; return the bytes."""
    make_input = make_input or (lambda r: rank_input(r, shape, dtype, case))
    x = make_input(rank)
    out = reducer(x)
    ref = rank_order_sum([make_input(r).contiguous() for r in range(world)])
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(bits(out), bits(ref)), f"{dtype} {shape} case {case}: differs from rank-order sum"
    return bits(out).numpy().tobytes()


# ---------------------------------------------------------------- correctness, selection, isolation


def subgroup(ranks: tuple[int, ...], rank: int) -> TorchGroup | None:
    """Every rank must create every process group, in the same order; members get a TorchGroup."""
    if rank in ranks:
        return TorchGroup(ranks, rank, "gloo", 60.0)
    dist.new_group(list(ranks), backend="gloo")
    return None


def check_group(group: TorchGroup) -> tuple[tuple[str, str], list[bytes]]:
    """Forced one-shot over every dtype and size up to above the threshold; auto around it."""
    rank, world = group.rank_in_group, group.size
    forced = make_reducer(group, [0] * world, "one_shot", 30.0, slot_bytes=2 * THRESHOLD)
    auto = make_reducer(group, [0] * world, "auto", 30.0)
    digests, case = [], 10 * world
    for dtype in DTYPES:
        per_threshold = THRESHOLD // dtype.itemsize
        for numel in (1, 7, 4099, per_threshold, per_threshold + 1):
            case += 1
            digests.append(check_bitwise(forced, rank, world, (numel,), dtype, case))
        case += 1  # non-contiguous: a transposed matrix and a strided slice
        digests.append(check_bitwise(forced, rank, world, (48, 33), dtype, case,
                                     lambda r: rank_input(r, (33, 48), dtype, case).t()))
        digests.append(check_bitwise(forced, rank, world, (16, 20), dtype, case,
                                     lambda r: rank_input(r, (16, 40), dtype, case)[:, ::2]))
        with torch.inference_mode():
            case += 1
            digests.append(check_bitwise(forced, rank, world, (3, 5, 64), dtype, case))
    digests.append(check_bitwise(forced, rank, world, (5,), torch.float32, 77,  # outside inference mode
                                 lambda r: rank_input(r, (5,), torch.float32, 77).requires_grad_()))
    assert forced.one_shot.num_calls == len(digests), "every forced call fits the slot and goes one-shot"

    # auto: a message of exactly the threshold goes one-shot, one element more goes to torch (gloo)
    below, above = (THRESHOLD // 4,), (THRESHOLD // 4 + 1,)
    routes = (auto.route(torch.empty(below)), auto.route(torch.empty(above)))
    digests.append(check_bitwise(auto, rank, world, below, torch.float32, 99))
    assert auto.one_shot.num_calls == 1
    above_sum = auto(rank_input(rank, above, torch.float32, 98))
    assert auto.one_shot.num_calls == 1, "the message above the threshold went one-shot"
    ref = rank_order_sum([rank_input(r, above, torch.float32, 98) for r in range(world)])
    torch.testing.assert_close(above_sum, ref, rtol=1e-5, atol=1e-3)  # gloo adds in its own order
    digests.append(bits(above_sum).numpy().tobytes())
    assert auto.route(torch.ones(4, dtype=torch.int64)) == "torch", "integer tensors go to torch"
    forced.close(), auto.close()
    return routes, digests


def check_groups_do_not_interfere(rank: int, groups: list[TorchGroup]) -> int:
    """Interleave all-reduces on overlapping groups, each with its own segment."""
    reducers = [make_reducer(g, [0] * g.size, "auto", 30.0) for g in groups]
    num_checked = 0
    for step in range(12):
        for k, (g, reducer) in enumerate(zip(groups, reducers)):
            shape, case = (1 + 37 * step + 5 * k,), 500 + 10 * step + k
            make_input = lambda r_in_group: rank_input(g.ranks[r_in_group], shape, torch.bfloat16, case)
            check_bitwise(reducer, g.rank_in_group, g.size, shape, torch.bfloat16, case, make_input)
            num_checked += 1
    assert [r.one_shot.num_calls for r in reducers] == [12] * len(groups)
    for r in reducers:
        r.close()
    return num_checked


def _groups_body(rank: int, world: int, store_path: str, queue) -> dict:
    world_group = join_world(rank, world, store_path)
    groups = {ranks: subgroup(ranks, rank) for ranks in [(0, 1), (0, 1, 2)]}
    groups[(0, 1, 2, 3)] = world_group
    pairs = [subgroup(ranks, rank) for ranks in [(0, 1), (2, 3), (0, 2), (1, 3)]]
    result = {"routes": {}}
    for ranks, group in groups.items():
        if group is not None:
            routes, digests = check_group(group)
            every_rank = group.all_gather_object([hashlib.sha256(d).hexdigest() for d in digests])
            assert all(h == every_rank[0] for h in every_rank), f"ranks {ranks} disagree on some result"
            result["routes"][ranks] = routes
            result.setdefault("num_checked", []).append(len(digests))
    mine = [world_group] + [g for g in pairs if g is not None]
    result["interleaved"] = check_groups_do_not_interfere(rank, mine)

    # a group over two nodes (faked): hierarchical under auto (test_hierarchical_allreduce.py), torch
    # under one_shot; mode torch gets no reducer
    across = [make_reducer(world_group, [0, 0, 1, 1], mode, 30.0) for mode in ("auto", "one_shot")]
    result["across_nodes"] = [r if r is None else r.path for r in across]
    across[0].close()
    result["torch_mode"] = make_reducer(world_group, [0] * 4, "torch", 30.0)
    world_group.barrier()
    return result


def test_groups_of_2_3_4_ranks_bitwise_selection_and_isolation(tmp_path):
    """Group sizes 2, 3 and 4 inside one 4-process world: the algorithm only sees its group,
    and one spawn instead of three keeps the test fast."""
    results = results_by_rank(*spawn_ranks(4, _groups_body, tmp_path))
    assert sorted(results) == [0, 1, 2, 3]
    for rank, value in results.items():
        expected_groups = [g for g in [(0, 1), (0, 1, 2), (0, 1, 2, 3)] if rank in g]
        assert list(value["routes"]) == expected_groups
        assert all(routes == ("one_shot", "torch") for routes in value["routes"].values())
        assert value["num_checked"] == [3 * 8 + 3] * len(expected_groups)
        assert value["interleaved"] == 12 * 3
        assert value["across_nodes"] == ["hierarchical", None] and value["torch_mode"] is None


def test_rank_inputs_make_summation_order_visible():
    """Guards the bitwise check: with these inputs, another order gives different bits."""
    for dtype in DTYPES:
        parts = [rank_input(r, (4099,), dtype, 5) for r in range(3)]
        assert not torch.equal(bits(rank_order_sum(parts)), bits(rank_order_sum(parts[::-1])))
