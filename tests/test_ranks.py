"""Unit tests of the rank plumbing that need no process group: expert group layout, mapping
validation, the shared-memory plan ring, the token digest and rank-failure messages."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pytest

from specray import LLM, EngineConfig, ParallelConfig
from specray.comm.channel import PeerGone, ShmRing
from specray.comm.context import expert_partitions, node_ids
from specray.comm.shm import leftover_segments, segment_name, unlink_segment
from specray.launch.mapping import validate_mapping
from specray.launch.procs import RankFailure
from specray.models.arch import arch_from_hf_config
from specray.models.presets import PRESETS
from specray.workers.token_check import fold


def test_expert_groups_follow_the_rank_rule():
    # tp rank r -> expert group r // moe_tp (contiguous), moe_tp index r % moe_tp
    tp_groups, ep_groups = expert_partitions(tp_size=4, moe_tp=2)
    assert tp_groups == [(0, 1), (2, 3)]
    assert ep_groups == [(0, 2), (1, 3)]
    assert expert_partitions(4, 4) == ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)])
    assert expert_partitions(4, 1) == ([(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)])


def test_node_ids_number_hosts_from_rank_zero():
    assert node_ids(["b", "b", "a", "c", "a"]) == (0, 0, 1, 2, 1)


@pytest.mark.parametrize("change, parallel, rule", [
    (dict(), ParallelConfig(tp_size=3), "tp_size (3) must divide the attention heads (8)"),
    (dict(num_heads=12, num_kv_heads=8), ParallelConfig(tp_size=3), "kv heads (8) must be divisible by tp_size (3)"),
    (dict(intermediate_size=770), ParallelConfig(tp_size=4), "must divide the MLP intermediate size (770)"),
    (dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=256, moe_layers=(0, 1, 2, 3)),
     ParallelConfig(tp_size=4, moe_tp_size=1, moe_ep_size=4), "moe_ep_size (4) must divide the number of experts (6)"),
    (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=250, moe_layers=(0, 1, 2, 3)),
     ParallelConfig(tp_size=4, moe_tp_size=4, moe_ep_size=1), "moe_tp_size (4) must divide the expert intermediate"),
    (dict(), ParallelConfig(tp_size=2, moe_tp_size=1, moe_ep_size=2), "needs a mixture-of-experts model"),
])
def test_bad_mapping_names_the_rule(change, parallel, rule):
    arch = dataclasses.replace(arch_from_hf_config(PRESETS["tiny-llama"]), **change)
    with pytest.raises(ValueError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        validate_mapping(arch, parallel)


def test_world_size_must_equal_tp_size():
    arch = arch_from_hf_config(PRESETS["tiny-llama"])
    with pytest.raises(ValueError, match=r"world size \(4\) must equal tp_size \(2\)"):
        validate_mapping(arch, ParallelConfig(tp_size=2), world_size=4)
    validate_mapping(arch, ParallelConfig(tp_size=8))  # 8 heads, 4 kv heads replicated twice: fine


def test_bad_mapping_fails_before_any_rank_starts(monkeypatch):
    from specray.launch import spawner

    started = []
    monkeypatch.setattr(spawner.RankServer, "start_rank", lambda self, *args: started.append(args))
    with pytest.raises(ValueError, match=r"tp_size \(3\) must divide the attention heads \(8\)"):
        LLM(EngineConfig(model="tiny-llama", parallel=ParallelConfig(tp_size=3, launcher="mp")))
    assert started == []


def _ring(num_readers: int, num_slots: int = 4, slot_bytes: int = 64):
    name = segment_name("test", "ring")
    writer = ShmRing.create(name, num_readers, num_slots, slot_bytes)
    readers = [ShmRing.attach(name, i) for i in range(num_readers)]
    unlink_segment(name)
    return writer, readers


def test_ring_carries_messages_larger_than_a_slot_and_more_than_the_ring_holds():
    writer, readers = _ring(num_readers=2)
    messages = [bytes([i]) * (i * 37) for i in range(40)]  # 0 .. 1443 bytes over 64-byte slots
    got: list[list[bytes]] = [[], []]

    def read(i: int) -> None:
        for _ in messages:
            got[i].append(readers[i].recv_bytes(timeout_s=20))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        writer.send_bytes(m, timeout_s=20)
    for t in threads:
        t.join(30)
    assert got == [messages, messages]
    assert leftover_segments("test") == []  # unlinked as soon as every reader mapped it


def test_ring_reader_times_out_and_detects_a_dead_writer():
    writer, (reader,) = _ring(num_readers=1)
    with pytest.raises(TimeoutError, match="rank 0's next step plan"):
        reader.recv_bytes(timeout_s=0.3)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    writer.header[0] = int(dead.stdout)  # the writer's pid now names an exited process
    with pytest.raises(PeerGone, match=f"pid {int(dead.stdout)}"):
        reader.recv_bytes(timeout_s=30)


def test_ring_writer_waits_for_a_slow_reader_then_times_out():
    writer, (reader,) = _ring(num_readers=1, num_slots=2)
    writer.send_bytes(b"a", 1)
    writer.send_bytes(b"b", 1)
    with pytest.raises(TimeoutError, match="followers to read"):
        writer.send_bytes(b"c", 0.3)  # both slots unread
    assert reader.recv_bytes(1) == b"a"


def test_shm_segments_are_private_to_the_user():
    from specray.comm.shm import SHM_DIR, create_segment

    name = segment_name("test", "mode")
    create_segment(name, 64).close()
    try:
        assert os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777 == 0o600
    finally:
        unlink_segment(name)


def test_token_digest_depends_on_every_token_and_its_order():
    base = fold(0, [1, 2, 3])
    assert fold(0, [1, 2, 3]) == base
    assert fold(0, [1, 2, 4]) != base
    assert fold(0, [3, 2, 1]) != base
    assert fold(fold(0, [1]), [2, 3]) != base  # steps are folded one at a time: boundaries differ
    assert fold(0, [[1, 2], [3]]) != fold(0, [[1], [2, 3]])  # several tokens per sequence (drafts)


def test_failure_names_the_dead_rank_before_the_ranks_that_only_reported_errors():
    failure = RankFailure.build("generate", dead=[(2, 1234, -9)], errors={0: "DistBackendError: peer closed"})
    assert failure.ranks == [2]
    assert "rank 2 (pid 1234) died (killed by SIGKILL)" in str(failure)
    only_errors = RankFailure.build("generate", dead=[], errors={3: "TokenDivergence: x", 1: "ValueError: y"})
    assert only_errors.ranks == [1] and "rank 1 failed: ValueError: y" in str(only_errors)


class _FakeGroup:
    """Rank 0 of four ranks, rank 2 of which sampled differently: what gather_object returns
    there, and a broadcast that hands back rank 0's verdict."""

    ranks = (0, 1, 2, 3)
    size = 4

    def gather_object(self, value):
        return [value, value, (value[0], 999), value]

    def broadcast_object(self, value, src_in_group=0):
        return value


def test_token_divergence_names_the_rank():
    from specray.workers.token_check import TokenDivergence, check_same_on_every_rank

    with pytest.raises(TokenDivergence, match=r"step 5 tokens: rank\(s\) \[2\] differ from rank 0"):
        check_same_on_every_rank(_FakeGroup(), ([0, 1], [17, 18]), "step 5 tokens")


def test_torchrun_environment_gives_the_rendezvous_and_picks_external(monkeypatch):
    from specray.comm.rendezvous import from_torchrun_env, host_key
    from specray.launch import resolve_launcher

    env = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", TORCHELASTIC_RUN_ID="x")
    rdzv = from_torchrun_env(env)
    assert (rdzv.rank, rdzv.world_size, rdzv.local_rank, rdzv.local_world_size) == (3, 4, 1, 2)
    assert rdzv.node_key == f"{host_key()}/node1" and rdzv.store_port is None  # env:// rendezvous
    with pytest.raises(ValueError, match=r"missing \['MASTER_ADDR', 'MASTER_PORT'\]"):
        from_torchrun_env(dict(RANK="0", WORLD_SIZE="2"))
    for key in env:
        monkeypatch.delenv(key, raising=False)
    assert resolve_launcher(EngineConfig(parallel=ParallelConfig(tp_size=4))) == "mp"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resolve_launcher(EngineConfig(parallel=ParallelConfig(tp_size=4))) == "external"
    assert resolve_launcher(EngineConfig(parallel=ParallelConfig(tp_size=4, launcher="ray"))) == "ray"
