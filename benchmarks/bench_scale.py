"""Cost against world size: start-up by phase, the geometry agreement, the decode step, and the
hierarchical all-reduce against flat gloo. One command:

    python -m benchmarks.bench_scale                 # mp at 1, 2, 4, 8, 16, 32; Ray 4 nodes x 4; all-reduce
    python -m benchmarks.bench_scale --worlds 72     # the 72-rank point (see --max-load)

Each point is a tiny MoE target sized for its world (as many heads as ranks, MoE TP = min(4, n),
EP = n / MoE TP) under ``mp`` with default parallel settings and a fixed 1024-token KV capacity.
The ranks write their start-up phases (``SPECRAY_STARTUP_PROFILE_DIR``, specray/startup_phases.py);
a phase's cost is its maximum over ranks (the slowest rank holds everyone at the next collective),
"process start" the median delay from ``LLM(...)`` to a rank's first line. The first step is the
first generate of one token; the decode step is a later 8-token generate divided by 8, whose
tokens are checked against one unsharded rank (``local``) on the same checkpoint ("exact").

Writes bench-results/scale.json and bench-results/scale.png and prints a table. The machine is
shared: a world above 32 runs only while the 1-minute load average is under ``--max-load`` and
the free memory covers it; otherwise the point is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The simulated Ray cluster stays on loopback, as in the tests (conftest.py, the Makefile): every
# Ray listener on 127.0.0.1, no auth token to provision.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks.scale_allreduce import measure as measure_allreduce  # noqa: E402
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams  # noqa: E402

PHASES = ("process_groups", "node_discovery", "allreduce_setup", "model_load", "geometry_agreement", "plan_channel")
OUT = Path("bench-results")


def scale_checkpoint(world: int, root: Path) -> Path:
    """A tiny Qwen3-MoE checkpoint whose heads, vocabulary and experts split over ``world`` ranks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from checkpoints import make_checkpoint

    heads = max(4, world)
    return make_checkpoint("qwen3_moe", root / f"moe{world}", seed=7, num_attention_heads=heads,
                           num_key_value_heads=4 if heads % 4 == 0 else heads, head_dim=8,
                           num_experts=2 * max(1, world // min(4, world)), vocab_size=16 * heads,
                           intermediate_size=4 * heads)


def moe_sizes(world: int) -> tuple[int, int]:
    moe_tp = min(4, world)
    return moe_tp, world // moe_tp


def run_point(model: Path, world: int, **parallel) -> dict:
    profile = Path(tempfile.mkdtemp(prefix="specray-profile-"))
    os.environ["SPECRAY_STARTUP_PROFILE_DIR"] = str(profile)
    moe_tp, moe_ep = moe_sizes(world)
    config = EngineConfig(model=str(model), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024),
                          parallel=ParallelConfig(tp_size=world, moe_tp_size=moe_tp, moe_ep_size=moe_ep,
                                                  timeout_s=300.0, **parallel))
    start = time.time()
    llm = LLM(config)
    startup_s = time.time() - start
    try:
        t = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, ignore_eos=True))
        first_step_s = time.perf_counter() - t
        t = time.perf_counter()
        tokens = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        decode_step_s = (time.perf_counter() - t) / 8
    finally:
        llm.close()
        del os.environ["SPECRAY_STARTUP_PROFILE_DIR"]
    with LLM(EngineConfig(model=str(model), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as one_rank:
        reference = one_rank.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    ranks = [json.loads(p.read_text()) for p in profile.glob("rank*.json")]
    row = dict(world=world, startup_s=startup_s, first_step_s=first_step_s, decode_step_s=decode_step_s,
               token_exact=tokens == reference,  # the same 8 greedy tokens as one unsharded rank
               num_profiled=len(ranks),
               process_start_s=statistics.median(r["started_at"] - start for r in ranks) if ranks else None)
    row.update({f"{name}_s": max(r["phases"].get(name, 0.0) for r in ranks) if ranks else None for name in PHASES})
    return row


def machine_allows(world: int, max_load: float) -> str:
    """'' when a point of ``world`` ranks may run now, else why not."""
    load = os.getloadavg()[0]
    if world > 32 and load >= max_load:
        return f"load average {load:.1f} >= {max_load} (shared machine): rerun with less load"
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
    # measured at 16 and 32 ranks: MemAvailable falls by 19-28 MiB a rank. Ranks fork from a warm rank
    # server and share its pages (a rank's RSS of ~290 MiB counts them again); 64 MiB leaves room.
    needed = world * (64 << 20)
    if available < needed:
        return f"{available >> 30} GiB free, {world} ranks need about {needed >> 30} GiB"
    return ""


def ray_point(model: Path, num_nodes: int, per_node: int) -> dict:
    """The same job over a simulated Ray cluster (loopback), ``per_node`` logical CPUs a node."""
    import ray
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=per_node, object_store_memory=80 << 20, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=dict(node, include_dashboard=False))
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        return dict(run_point(model, num_nodes * per_node, launcher="ray"), launcher=f"ray {num_nodes}x{per_node}")
    finally:
        ray.shutdown()
        cluster.shutdown()


def print_table(rows: list[dict]) -> None:
    cols = ["startup_s", "process_start_s", *[f"{p}_s" for p in PHASES], "first_step_s", "decode_step_s"]
    print(f"{'launcher':>10} {'world':>5} " + " ".join(f"{c.removesuffix('_s')[:12]:>12}" for c in cols) + "  exact")
    for r in rows:
        if "skipped" in r:
            print(f"{r['launcher']:>10} {r['world']:>5} skipped: {r['skipped']}")
            continue
        cells = " ".join(f"{r[c]:12.3f}" if r.get(c) is not None else f"{'-':>12}" for c in cols)
        print(f"{r['launcher']:>10} {r['world']:>5} {cells}  {r['token_exact']}")


def plot(rows: list[dict], allreduce: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mp_rows = [r for r in rows if r["launcher"] == "mp" and "skipped" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    worlds = [r["world"] for r in mp_rows]
    for key in ("startup_s", "process_start_s", "node_discovery_s", "allreduce_setup_s", "geometry_agreement_s",
                "decode_step_s"):
        left.plot(worlds, [r[key] or 0 for r in mp_rows], "-o", label=key.removesuffix("_s"))
    if mp_rows:  # every world skipped (memory, load): the all-reduce panel alone
        left.set(xscale="log", yscale="log", xlabel="ranks (mp)", ylabel="seconds", title="start-up and decode cost")
        left.set_xticks(worlds, [str(w) for w in worlds])
        left.legend(fontsize=8)
    sizes = sorted(allreduce, key=int)
    right.bar([i - 0.2 for i in range(len(sizes))], [allreduce[s]["flat_us"] for s in sizes], 0.4, label="flat gloo")
    right.bar([i + 0.2 for i in range(len(sizes))], [allreduce[s]["hierarchical_us"] for s in sizes], 0.4,
              label="hierarchical")
    right.set_xticks(range(len(sizes)), [f"{int(s) >> 10} KB" for s in sizes])
    right.set(yscale="log", ylabel="us per all-reduce", title="16 ranks over 4 simulated nodes")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 72])
    parser.add_argument("--max-load", type=float, default=3.0)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="specray-scale-"))
    rows = []
    for world in args.worlds:
        why_not = machine_allows(world, args.max_load)
        if why_not:
            rows.append(dict(launcher="mp", world=world, skipped=why_not, load=os.getloadavg()[0]))
            continue
        load = os.getloadavg()[0]
        rows.append(dict(run_point(scale_checkpoint(world, root), world, launcher="mp"), launcher="mp", load=load))
        print_table(rows[-1:])
    if not args.no_ray:
        load = os.getloadavg()[0]
        try:
            rows.append(dict(ray_point(scale_checkpoint(16, root), 4, 4), load=load))
        except Exception as e:  # a shared machine: Ray's memory monitor may kill a worker; say so
            rows.append(dict(launcher="ray 4x4", world=16, skipped=f"{type(e).__name__}: {str(e)[:200]}", load=load))
    allreduce = {str(k): v for k, v in measure_allreduce(16, 4).items()}
    print_table(rows)
    for size, r in allreduce.items():
        print(f"all-reduce 16 ranks, 4 nodes x 4, {int(size) >> 10} KB: flat gloo {r['flat_us']:.0f} us, "
              f"hierarchical {r['hierarchical_us']:.0f} us ({r['flat_us'] / r['hierarchical_us']:.1f}x)")
    result = dict(rows=rows, allreduce_16x4=allreduce, load_after=os.getloadavg()[0], measured_at=time.ctime())
    (OUT / "scale.json").write_text(json.dumps(result, indent=1))
    plot(rows, allreduce, OUT / "scale.png")
    print(f"wrote {OUT / 'scale.json'} and {OUT / 'scale.png'}")


if __name__ == "__main__":
    main()
