"""The ``ray`` launcher across nodes: placement, node-aware ranks, failures, clean-up.

Unit tests for the pure rules (rank order, CUDA ordinal, runtime_env, config), then one
simulated two-node cluster (``ray.cluster_utils.Cluster``, two logical CPUs per node) run
in a subprocess (tests/ray_cluster_scenarios.py: the session's shared Ray instance and a
``Cluster`` cannot share a driver). Parity reference: the same checkpoint on one rank, token
for token (see test_ranks_mp.py for why exact).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from specray.config import ParallelConfig
from specray.launch.ray import actor_runtime_env
from specray.launch.ray_placement import check_user_group, cuda_ordinal, order_ranks
from test_ranks_mp import single_rank_tokens

SCENARIOS = Path(__file__).with_name("ray_cluster_scenarios.py")
RAY_ENV = dict(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")


def test_ranks_ordered_by_node_then_bundle_with_the_driver_node_first():
    bundle_nodes = {0: "b", 1: "a", 2: "drv", 3: "a", 4: "b", 5: "drv"}
    ips = {"drv": "10.0.0.9", "a": "10.0.0.10", "b": "10.0.0.10"}  # numeric IP order; equal IPs by node id
    placed = order_ranks(bundle_nodes, "drv", ips)
    assert [(p.bundle_index, p.ray_node_id, p.node_index, p.local_rank) for p in placed] == [
        (2, "drv", 0, 0), (5, "drv", 0, 1), (1, "a", 1, 0), (3, "a", 1, 1), (0, "b", 2, 0), (4, "b", 2, 1)]
    assert [p.rank for p in placed] == list(range(6))
    # The driver's node holds no bundle: the order is still by node, then bundle.
    assert [p.bundle_index for p in order_ranks({0: "b", 1: "a"}, "drv", ips)] == [1, 0]


def test_cuda_ordinal_of_the_gpu_ray_assigned():
    assert cuda_ordinal(["3"], "3") == 0  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU
    assert cuda_ordinal(["3"], "1,3,5") == 1
    assert cuda_ordinal([2], None) == 2  # every GPU visible: the id is the ordinal
    with pytest.raises(RuntimeError, match="assigned no GPU"):
        cuda_ordinal([], "0")
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_ordinal(["4"], "0,1")


def test_actor_environment_is_the_allowlist_under_the_users_runtime_env(monkeypatch):
    monkeypatch.setenv("SPECRAY_KV_MEMORY_FRACTION", "0.3")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("HOME_SECRET_TOKEN", "not forwarded")
    env = actor_runtime_env({"pip": ["x"], "env_vars": {"NCCL_DEBUG": "WARN", "MINE": "1"}})
    assert env["pip"] == ["x"]
    assert env["env_vars"]["SPECRAY_KV_MEMORY_FRACTION"] == "0.3"
    assert env["env_vars"]["NCCL_DEBUG"] == "WARN" and env["env_vars"]["MINE"] == "1"  # the user's win
    assert "HOME_SECRET_TOKEN" not in env["env_vars"]


def test_ray_fields_of_parallel_config_are_validated():
    for fields, rule in [(dict(placement_strategy="pack"), "placement_strategy 'pack' must be one of"),
                         (dict(placement_timeout_s=0), "placement_timeout_s (0) must be > 0"),
                         (dict(failure_timeout_s=-1), "failure_timeout_s (-1) must be > 0"),
                         (dict(placement_group=object(), launcher="mp"), "launcher ('mp') must be 'ray' or 'auto'"),
                         (dict(runtime_env=[]), "runtime_env ([]) must be a dict"),
                         (dict(runtime_env={"env_vars": {"A": 1}}), "must map variable names to string values")]:
        with pytest.raises(ValueError, match=re.escape(rule)):
            ParallelConfig(**fields)

    class Group:
        bundle_specs = [{"CPU": 1.0}, {"CPU": 1.0}]

    check_user_group(Group(), 2, is_gpu=False)
    with pytest.raises(ValueError, match="has 2 bundles, but there are 4 ranks"):
        check_user_group(Group(), 4, is_gpu=False)
    with pytest.raises(ValueError, match="bundle 0 is .* each rank needs at least {'GPU': 1.0}"):
        check_user_group(Group(), 2, is_gpu=True)


@pytest.fixture
def cluster_report(tiny_checkpoints):
    llama, moe = tiny_checkpoints("llama"), tiny_checkpoints("qwen3_moe")
    ray_tmp = tempfile.mkdtemp(prefix="sr", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, **RAY_ENV, RAY_TMPDIR=ray_tmp,
               PYTHONPATH=os.pathsep.join([str(SCENARIOS.parent), *sys.path]))
    try:
        run = subprocess.run([sys.executable, str(SCENARIOS), str(llama), str(moe)], env=env, capture_output=True,
                             text=True, timeout=400)
    finally:
        subprocess.run(["rm", "-rf", ray_tmp], check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), moe


def test_two_node_cluster_placement_failures_and_cleanup(cluster_report):
    report, moe = cluster_report
    driver, worker = report["driver_node"], report["worker_node"]
    timeout_s = 10.0  # FAILURE_TIMEOUT_S of the scenarios

    # An unsatisfiable group: a clear error once placement_timeout_s (3 s) has passed; nothing left.
    bad = report["unsatisfiable"]
    assert bad["error"].startswith("PlacementTimeout: Ray could not place 4 ranks"), bad["error"]
    assert "STRICT_SPREAD puts each rank on its own node, but the cluster has 2 nodes" in bad["error"]
    assert 3.0 <= bad["elapsed_s"] < 3.0 + 10.0 and bad["groups_left"] == []

    # The user's runtime_env reaches the actor on the other node (it makes rank 1 allocate more),
    # and the start-up failure is named and cleaned up.
    fault = report["startup_fault"]
    assert fault["error"].startswith("RankFailure: start-up failed: rank "), fault["error"]
    assert "KV geometry mismatch: rank 1 allocated target.num_blocks" in fault["error"]
    assert fault["groups_left"] == []

    # The user's STRICT_SPREAD group, one rank per node: rank 0 on the driver's node, whichever
    # bundle Ray put there; across nodes the plans travel over the CPU group.
    killed = report["killed"]
    health = killed["health"]
    assert [(h["rank"], h["ray_node_id"], h["node_id"], h["local_rank"], h["plan_transport"], h["is_alive"])
            for h in health] == [(0, driver, 0, 0, "cpu-group", True), (1, worker, 1, 0, "cpu-group", True)]
    assert [h["allreduce"]["tp"] for h in health] == ["torch", "torch"]  # across nodes: never one-shot
    # A rank killed mid-call: an error naming the rank and its node, well within failure_timeout_s.
    assert killed["error_type"] == "RankFailure" and killed["error_ranks"] == [1], killed["error"]
    assert f"rank 1 (pid {health[1]['pid']}) on node 1 (Ray node {worker[:8]} at 127.0.0.1) died" in killed["error"]
    assert killed["error_after_s"] < timeout_s
    assert [h["state"] for h in killed["health_after"]] == ["closed", "closed"]
    assert killed["live_pids"] == [] and killed["actors"] == [] and killed["shm"] == []
    assert killed["pg_state"] == "CREATED"  # the user's group is theirs: used as it is, never removed

    # A fresh LLM in the same driver: TP=4 packed 2 + 2, token-exact against one rank.
    packed = report["packed"]
    assert packed["tokens"] == single_rank_tokens(moe)
    health = packed["health"]
    assert [(h["ray_node_id"], h["node_id"], h["local_rank"], h["local_world_size"]) for h in health] == [
        (driver, 0, 0, 2), (driver, 0, 1, 2), (worker, 1, 0, 2), (worker, 1, 1, 2)]
    # Plans: shared memory for rank 0's node, the CPU group for the other node.
    assert [h["plan_transport"] for h in health] == ["shm+cpu-group", "shm", "cpu-group", "cpu-group"]
    # All-reduce: one-shot in groups inside one node, i.e. the expert groups (0, 1) and (2, 3); tp (all
    # four, 2 + 2) spans both nodes: hierarchical (one-shot per node, leaders over gloo); the
    # expert-parallel groups (0, 2), (1, 3) have one rank per node: torch.distributed.
    assert [h["allreduce"] for h in health] == [dict(tp="hierarchical", moe_tp="one_shot", moe_ep="torch")] * 4
    # A hung rank (SIGSTOP) is named within failure_timeout_s by the driver's pings.
    assert packed["error_type"] == "RankFailure" and packed["error_ranks"] == [3], packed["error"]
    assert f"rank 3 (pid {health[3]['pid']}) on node 1 (Ray node {worker[:8]} at 127.0.0.1) died (no answer" \
        in packed["error"]
    assert packed["error_after_s"] < timeout_s
    assert packed["live_pids"] == [] and packed["actors"] == [] and packed["shm"] == []
    assert packed["pg_state"] == "REMOVED"
