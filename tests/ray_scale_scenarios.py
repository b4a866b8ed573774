"""Run by tests/test_ray_scale.py in a subprocess: the seed's deployment at its own shape on a
simulated 4-node Ray cluster (``ray.cluster_utils.Cluster``, 4 logical CPUs per node, loopback):
a tiny MoE target at TP16 with MoE TP4 x EP4 and a standalone DSpark drafter (published format)
at target page size 64. Prints one JSON line of observations; the test asserts.

Two jobs in one driver (a start-up costs most of the time on two cores):

1. default kernels: every rank's pools and the tokens;
2. an MLA target (tiny DeepSeek-V3: latent pool, DeepSeekMoE) with its own DSpark drafter, the
   four ranks of the second node narrowed to {32} for the drafter kernel, through the user's
   runtime_env: every rank's pools and the tokens; then a rank on the third node is killed
   (SIGKILL) during decoding, and what is left behind afterwards.

    python ray_scale_scenarios.py TARGET_DIR DRAFTER_DIR MLA_TARGET_DIR MLA_DRAFTER_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

from ray_cluster_scenarios import hit_mid_call, leftovers
from faults import STEP_DIR_VAR
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig

NODE = dict(num_cpus=4, object_store_memory=80 << 20, node_ip_address="127.0.0.1")
NUM_NODES = 4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41], [300, 9, 27, 1, 77]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
FAILURE_TIMEOUT_S = 10.0
NARROWED_NODE, KILLED_NODE = 1, 2  # the second and third nodes (ranks 4-7 and 8-11)


def config(target: str, drafter: str | None, **parallel) -> EngineConfig:
    spec = SpecConfig(method="dspark", draft_model=drafter, num_draft_tokens=3) if drafter else SpecConfig()
    parallel = dict(dict(launcher="ray", timeout_s=120.0, failure_timeout_s=FAILURE_TIMEOUT_S, tp_size=16,
                         moe_tp_size=4, moe_ep_size=4), **parallel)
    return EngineConfig(model=target, kv=KVConfig(tokens_per_block=64, capacity_tokens=2048),
                        parallel=ParallelConfig(**parallel), spec=spec)


def run_job(target: str, drafter: str, runtime_env: dict | None = None) -> tuple[dict, LLM]:
    start = time.monotonic()
    llm = LLM(config(target, drafter, runtime_env=runtime_env))
    started = time.monotonic()
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    health = llm.health()
    return dict(startup_s=started - start, decode_s=time.monotonic() - started, tokens=tokens,
                geometry={name: g.tokens_per_block for name, g in llm.geometry.items()},
                ranks=[dict(rank=h["rank"], node_id=h["node_id"], ray_node_id=h["ray_node_id"], kv=h["kv"],
                            allreduce=h["allreduce"], pid=h["pid"]) for h in health]), llm


class Timeline:
    """Seconds from the scenario's start to the end of each step (docs/scale.md's breakdown)."""

    def __init__(self) -> None:
        self.begin, self.marks = time.monotonic(), {}

    def mark(self, step: str) -> None:
        self.marks[step] = round(time.monotonic() - self.begin, 2)


def start_cluster(timeline: Timeline) -> tuple[Cluster, list[str]]:
    """The head (the driver's node), then the other nodes started together: each node's start
    is mostly its Python agents importing Ray, so one wait for all of them beats one per node."""
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=dict(NODE, include_dashboard=False))
    timeline.mark("head_node")
    try:
        nodes = [cluster.add_node(wait=False, **NODE) for _ in range(NUM_NODES - 1)]
        cluster.wait_for_nodes(timeout=120)  # Ray's default 30 s is short on two loaded cores
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    timeline.mark("other_nodes")
    return cluster, [ray.get_runtime_context().get_node_id()] + [n.node_id for n in nodes]


def main(target: str, drafter: str, mla_target: str, mla_drafter: str) -> None:
    os.environ[STEP_DIR_VAR] = tempfile.mkdtemp(prefix="specray-steps-")
    timeline = Timeline()
    cluster, nodes = start_cluster(timeline)
    try:
        report = dict(nodes=nodes)
        report["default"], llm = run_job(target, drafter)
        llm.close()
        timeline.mark("default_job")
        narrowed = [r for r in range(16) if r // 4 == NARROWED_NODE]
        env = {"env_vars": {"SPECRAY_DRAFT_KERNEL_PAGE_SIZES": ";".join(f"{r}:32" for r in narrowed)}}
        report["narrowed"], llm = run_job(mla_target, mla_drafter, runtime_env=env)
        timeline.mark("narrowed_job")
        engine, pg = llm._engine, llm._engine._pg  # close forgets the group: keep it to ask Ray about it
        victim = 4 * KILLED_NODE + 1
        report["killed"] = dict(rank=victim, **hit_mid_call(llm, victim, signal.SIGKILL))
        llm.close()
        report["killed"].update(leftovers(engine, pg))
        timeline.mark("killed_rank")
    finally:
        ray.shutdown()
        cluster.shutdown()
    timeline.mark("shutdown")
    report["timeline"] = timeline.marks
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:5])
