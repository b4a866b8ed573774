"""One-shot all-reduce lifetime and safety: no segment outlives its group (normal close, an
exception, a killed rank), a dead rank is named (from its pid, before the timeout), the
segment is private to the user; and the selection's fallback to torch.distributed."""

from __future__ import annotations

import os
import signal
import stat
from types import SimpleNamespace

import pytest
import torch

from specray.comm import one_shot, shm
from specray.comm.allreduce import make_reducer, select_path
from specray.comm.group import TorchGroup
from test_one_shot import join_world, spawn_ranks  # tests/ is on sys.path (no __init__.py)


def my_segments() -> list[str]:
    """Segment names this process created that still exist (the name carries the creator's pid)."""
    return shm.segments_created_by(os.getpid())


def _cannot_map(path: str, size: int):
    raise OSError("injected failure")


def _failed_setup(rank: int, group: TorchGroup) -> dict:
    """Rank 1 cannot map the segment: every rank falls back (auto) or raises (one_shot) together."""
    real_attach = shm.attach_segment
    if rank == 1:
        shm.attach_segment = _cannot_map
    try:
        auto = make_reducer(group, [0] * group.size, "auto", 30.0)
        try:
            make_reducer(group, [0] * group.size, "one_shot", 30.0)
            forced_error = None
        except one_shot.OneShotUnavailable as e:
            forced_error = str(e)
    finally:
        shm.attach_segment = real_attach
    return dict(auto=auto, forced_error=forced_error, leftover=my_segments())


def _lifetime_body(rank: int, world: int, store_path: str, queue) -> None:
    group = join_world(rank, world, store_path)
    queue.put((rank, "setup_failure", _failed_setup(rank, group)))

    reducer = make_reducer(group, [0] * world, "auto", 30.0)
    group.barrier()  # the creator unlinks the name before its make_reducer returns
    name_gone_while_in_use = not os.path.exists(reducer.one_shot.path)
    x = reducer(torch.full((5,), float(rank + 1)))
    reducer.close()
    queue.put((rank, "normal", dict(name_gone=name_gone_while_in_use, sum=x.tolist(), leftover=my_segments())))
    try:
        reducer(torch.ones(5))
    except RuntimeError as e:
        queue.put((rank, "after_close", str(e)))

    reducer = make_reducer(group, [0] * world, "auto", timeout_s=3.0)
    reducer(torch.ones(5))
    group.barrier()
    if rank == 0:
        queue.put((rank, "pid", os.getpid()))
        queue.close()
        queue.join_thread()  # flush what this rank reported before it dies
        os.kill(os.getpid(), signal.SIGKILL)  # the creator of the segment dies mid-job
    errors = []
    for _ in range(2):
        try:
            reducer(torch.ones(5))
        except (TimeoutError, RuntimeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    queue.put((rank, "dead_rank", errors))
    raise RuntimeError("leaving with a live reducer, as a failing rank would")


def test_no_segment_left_after_close_exception_or_killed_rank_and_dead_rank_named(tmp_path):
    messages, exitcodes = spawn_ranks(3, _lifetime_body, tmp_path, timeout_s=90.0)
    got = {(rank, kind): value for rank, kind, value in messages}
    assert exitcodes == [-signal.SIGKILL, 1, 1]
    for rank in range(3):
        failure = got[(rank, "setup_failure")]
        assert failure["auto"] is None, "auto falls back to torch when a rank cannot map the segment"
        assert "rank 1 cannot map" in failure["forced_error"] and "injected failure" in failure["forced_error"]
        assert failure["leftover"] == []
        normal = got[(rank, "normal")]
        assert normal["name_gone"], "the segment's name is unlinked as soon as every rank mapped it"
        assert normal["sum"] == [6.0] * 5 and normal["leftover"] == []
        assert "is closed" in got[(rank, "after_close")]
    for rank in (1, 2):
        first, again = got[(rank, "dead_rank")]  # named from its pid, well before timeout_s
        assert first.startswith("PeerGone: ranks [0] did not arrive"), first
        assert f"rank 0 (pid {got[(0, 'pid')]}) has exited" in first
        assert again.startswith("RuntimeError:") and "failed earlier" in again
        assert "leaving with a live reducer" in got[(rank, "error")]
    assert shm.segments_created_by(got[(0, "pid")]) == []


def test_segment_is_created_exclusively_with_mode_0600_whatever_the_umask():
    name = shm.segment_name("test", "mode")
    old_umask = os.umask(0)
    try:
        shm.create_segment(name, 3 * 4096).close()
        with pytest.raises(FileExistsError):
            shm.create_segment(name, 4096)  # O_EXCL: never adopt a file someone else made
        st = os.stat(os.path.join(shm.SHM_DIR, name))
    finally:
        os.umask(old_umask)
        shm.unlink_segment(name)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 3 * 4096 and st.st_uid == os.getuid()


def test_ranks_refuse_to_map_a_segment_other_users_could_read_or_of_another_size():
    name = shm.segment_name("test", "perm")
    path = os.path.join(shm.SHM_DIR, name)
    try:
        shm.create_segment(name, 4096).close()
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="mode 644"):
            shm.attach_segment(name, 4096)
        os.chmod(path, 0o600)
        with pytest.raises(PermissionError, match="4096 bytes; expected .* 8192 bytes"):
            shm.attach_segment(name, 8192)
        shm.attach_segment(name, 4096).close()
    finally:
        shm.unlink_segment(name)


def test_bad_selection_arguments_are_rejected_before_any_collective():
    group = SimpleNamespace(size=2, ranks=(0, 1), rank_in_group=0, backend="gloo")
    with pytest.raises(ValueError, match="allreduce 'fast' must be one of"):
        make_reducer(group, [0, 0], "fast", 30.0)
    with pytest.raises(ValueError, match="node_ids has 3 entries, but the group has 2 ranks"):
        make_reducer(group, [0, 0, 0], "auto", 30.0)
    assert make_reducer(group, [0, 1], "one_shot", 30.0) is None, "a group across nodes uses torch"
    assert make_reducer(SimpleNamespace(**{**vars(group), "backend": "nccl"}), [0, 0], "auto", 30.0) is None
    with pytest.raises(ValueError, match="group of 2 to 64 ranks"):
        one_shot.OneShotAllReduce(SimpleNamespace(size=1, ranks=(0,), rank_in_group=0), 4096, 30.0)


SERVABLE = dict(group_size=4, node_ids=[0, 0, 0, 0], backend="gloo", is_supported_machine=True)


@pytest.mark.parametrize("mode, changes, path, reason", [
    ("auto", {}, "one_shot", ""),
    ("one_shot", {}, "one_shot", ""),
    ("torch", {}, "torch", "allreduce='torch'"),
    ("auto", dict(group_size=1, node_ids=[0]), "torch", "group of 1"),
    ("auto", dict(node_ids=[0, 0, 1, 1]), "hierarchical", ""),  # see test_hierarchical_allreduce.py
    ("one_shot", dict(node_ids=[0, 0, 1, 1]), "torch", "spans nodes [0, 1] (allreduce='one_shot'"),
    ("auto", dict(backend="nccl"), "torch", "backend 'nccl'"),
    ("auto", dict(is_supported_machine=False), "torch", "not x86-64"),
    ("auto", dict(group_size=72, node_ids=[0] * 72), "torch", "groups of 2 to 64 ranks, this group has 72"),
    ("auto", dict(group_size=65, node_ids=[0] * 65), "torch", "this group has 65"),
    ("one_shot", dict(group_size=64, node_ids=[0] * 64), "one_shot", ""),
])
def test_selection_falls_back_to_torch_wherever_one_shot_cannot_serve(mode, changes, path, reason):
    got_path, got_reason = select_path(mode, **{**SERVABLE, **changes})
    assert got_path == path and reason in got_reason


def test_forced_one_shot_over_the_limit_says_what_to_choose_instead():
    with pytest.raises(ValueError, match=r"allreduce='one_shot': one-shot all-reduce takes groups of 2 to 64 ranks, "
                                         r"this group has 72; choose allreduce='auto' .* or 'torch'"):
        select_path("one_shot", **{**SERVABLE, "group_size": 72, "node_ids": [0] * 72})


def _over_the_limit_body(rank: int, world: int, store_path: str, queue) -> dict:
    """A 3-rank group with the one-shot limit lowered to 2: auto falls back, one_shot refuses."""
    group = join_world(rank, world, store_path)
    group.reducer = make_reducer(group, [0] * world, "auto", 30.0, max_group_size=2)
    total = group.all_reduce(torch.full((4,), float(rank + 1))).tolist()
    try:
        make_reducer(group, [0] * world, "one_shot", 30.0, max_group_size=2)
        forced = None
    except ValueError as e:
        forced = str(e)
    group.barrier()  # both choices were made without a collective: the group is still in step
    return dict(reducer=group.reducer, total=total, forced=forced)


def test_auto_over_the_one_shot_limit_runs_on_torch(tmp_path):
    from test_one_shot import results_by_rank

    results = results_by_rank(*spawn_ranks(3, _over_the_limit_body, tmp_path, timeout_s=90.0))
    for rank in range(3):
        assert results[rank]["reducer"] is None
        assert results[rank]["total"] == [6.0] * 4
        assert "this group has 3; choose allreduce='auto'" in results[rank]["forced"]
