"""Hierarchical all-reduce against flat gloo for a group spanning simulated nodes (the all-reduce
part of bench_scale.py; also ``python -m benchmarks.scale_allreduce --world 16 --per-node 4``).

The ranks are processes on this host with gloo over loopback; node membership is simulated
(rank r is on node r // per_node), which is what shared memory and the leaders' exchange see.
Both paths run on the same processes, in alternating blocks, so load drift hits both alike;
the figure is the median over calls of rank 0's time per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specray.comm.allreduce import make_reducer
from specray.comm.group import TorchGroup

SIZES = (4 << 10, 64 << 10, 1 << 20)


def _time_calls(reduce, x: torch.Tensor, num_calls: int, group: TorchGroup) -> list[float]:
    group.barrier()
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        reduce(x)
        times.append(time.perf_counter() - start)
    return times


def _rank_body(rank: int, world: int, per_node: int, store: str, sizes, num_calls: int, blocks: int, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        group = TorchGroup(tuple(range(world)), rank, "gloo", 120.0)
        nodes = [r // per_node for r in range(world)]
        hier = make_reducer(group, nodes, "auto", 120.0, threshold_bytes=max(sizes), hierarchical_min_ranks=2)
        assert hier is not None and hier.path == "hierarchical", "the hierarchical path did not set up"
        result = {}
        for size in sizes:
            x = torch.ones(size // 4)
            flat, fast = [], []
            for _ in range(blocks):
                flat += _time_calls(lambda t: dist.all_reduce(t, group=group.pg), x, num_calls, group)
                fast += _time_calls(hier, x, num_calls, group)
            result[size] = dict(flat_us=1e6 * statistics.median(flat), hierarchical_us=1e6 * statistics.median(fast))
        hier.close()
        group.barrier()
        queue.put((rank, result))
    except BaseException as e:
        queue.put((rank, f"error: {e!r}"))
        raise


def measure(world: int, per_node: int, sizes=SIZES, num_calls: int = 20, blocks: int = 3,
            timeout_s: float = 300.0) -> dict[int, dict]:
    """{size: {flat_us, hierarchical_us}} as rank 0 measured them."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "specray.comm.allreduce"])
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_rank_body, args=(r, world, per_node, store, sizes, num_calls, blocks, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=timeout_s) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    errors = [v for v in results.values() if isinstance(v, str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    result = measure(args.world, args.per_node, num_calls=args.calls)
    for size, r in result.items():
        print(f"{args.world} ranks ({args.world // args.per_node} nodes x {args.per_node}) {size >> 10:5d} KB: "
              f"flat gloo {r['flat_us']:9.0f} us, hierarchical {r['hierarchical_us']:9.0f} us, "
              f"{r['flat_us'] / r['hierarchical_us']:.1f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
