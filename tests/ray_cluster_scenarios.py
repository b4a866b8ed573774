"""Run by tests/test_ray_cluster.py in a subprocess: a simulated two-node Ray cluster
(``ray.cluster_utils.Cluster``, two logical CPUs per node, loopback only) and four
scenarios on it, in one driver. Prints one JSON line of observations; the test asserts.

A subprocess because a ``Cluster`` needs a Ray driver of its own: the test session shares
one local Ray instance (conftest's ``ray_cluster``), and a process holds one Ray connection.
The caller sets RAY_TMPDIR to a private directory, so this cluster's address file never
leads another process's ``ray.init()`` here.

    python ray_cluster_scenarios.py LLAMA_DIR MOE_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from faults import STEP_DIR_VAR, fail_mid_call
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.comm.shm import leftover_segments

NODE = dict(num_cpus=2, object_store_memory=100 << 20, node_ip_address="127.0.0.1")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41], [300, 9, 27, 1, 77]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PLACEMENT_TIMEOUT_S, FAILURE_TIMEOUT_S = 3.0, 10.0


def config(model: str, **parallel) -> EngineConfig:
    parallel = dict(dict(launcher="ray", timeout_s=30.0, failure_timeout_s=FAILURE_TIMEOUT_S), **parallel)
    return EngineConfig(model=model, kv=KVConfig(tokens_per_block=16, capacity_tokens=1024),
                        parallel=ParallelConfig(**parallel))


def leftovers(engine, pg) -> dict:
    """What a finished job left behind: live rank processes, actors, its group, shared memory."""
    deadline = time.monotonic() + 20
    alive = list(engine.pids)
    while alive and time.monotonic() < deadline:  # Ray reaps killed actors asynchronously
        alive = [pid for pid in alive if _is_alive(pid)]
        time.sleep(0.1)
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return dict(live_pids=alive, actors=[n for n in named if n.startswith(f"specray-{engine.job_id}")],
                pg_state=placement_group_table(pg)["state"], shm=leftover_segments(engine.job_id))


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def hit_mid_call(llm, rank: int, sig: int) -> dict:
    """What generate raised when ``rank`` got ``sig`` mid-call, as JSON-able data."""
    step_dir = Path(os.environ[STEP_DIR_VAR])
    error, after_s = fail_mid_call(llm, rank, sig, join_s=3 * FAILURE_TIMEOUT_S, step_dir=step_dir)
    return dict(error_type=type(error).__name__, error=str(error), error_ranks=getattr(error, "ranks", None),
                error_after_s=after_s, health_after=llm.health())


def unsatisfiable(llama: str) -> dict:
    """STRICT_SPREAD of 4 ranks on 2 nodes can never be placed."""
    start = time.monotonic()
    result = _start_failure(config(llama, tp_size=4, placement_strategy="STRICT_SPREAD",
                                   placement_timeout_s=PLACEMENT_TIMEOUT_S))
    return dict(result, elapsed_s=time.monotonic() - start)


def startup_fault(llama: str) -> dict:
    """TP=2 across the nodes, rank 1 told by the user's runtime_env to allocate 2 extra blocks:
    the variable must reach the actor on the other node, and the fingerprint check stop start-up."""
    env = {"env_vars": {"SPECRAY_FAULT_KV_EXTRA_BLOCKS": "1:2"}}
    return _start_failure(config(llama, tp_size=2, placement_strategy="STRICT_SPREAD", runtime_env=env))


def _start_failure(engine_config) -> dict:
    """Build an LLM that must fail to start: the error, and the placement groups left over."""
    try:
        LLM(engine_config)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    groups = placement_group_table().values()
    return dict(error=error, groups_left=[g["name"] for g in groups if g["state"] != "REMOVED"])


def killed_rank(llama: str) -> dict:
    """TP=2 in the user's own STRICT_SPREAD group (launcher auto), one rank per node; SIGKILL
    rank 1 (the other node) in the middle of a long call. The user's group must survive."""
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    llm = LLM(config(llama, tp_size=2, launcher="auto", placement_group=pg))
    engine = llm._engine
    out = dict(health=llm.health(), bundle_nodes=placement_group_table(pg)["bundles_to_node_id"],
               **hit_mid_call(llm, 1, signal.SIGKILL))
    llm.close()
    out.update(leftovers(engine, pg))
    remove_placement_group(pg)
    return out


def two_plus_two(moe: str) -> dict:
    """A fresh LLM in the same driver: TP=4 (experts 2 x 2) packed 2 + 2 over the two nodes;
    then rank 3 hangs (SIGSTOP) in the middle of a long call."""
    llm = LLM(config(moe, tp_size=4, moe_tp_size=2, moe_ep_size=2))
    engine, pg = llm._engine, llm._engine._pg
    try:
        out = dict(tokens=[o.token_ids for o in llm.generate(PROMPTS, GREEDY)], health=llm.health(),
                   **hit_mid_call(llm, 3, signal.SIGSTOP))
    finally:
        llm.close()
    return dict(out, **leftovers(engine, pg))


def main(llama: str, moe: str) -> None:
    # every rank (both "nodes" share this host) writes its step count here: hit_mid_call waits on it
    os.environ[STEP_DIR_VAR] = tempfile.mkdtemp(prefix="specray-steps-")
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=dict(NODE, include_dashboard=False))
    try:
        worker = cluster.add_node(**NODE)
        driver_node = ray.get_runtime_context().get_node_id()
        report = dict(driver_node=driver_node, worker_node=worker.node_id, unsatisfiable=unsatisfiable(llama),
                      startup_fault=startup_fault(llama),
                      killed=killed_rank(llama), packed=two_plus_two(moe))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:3])
