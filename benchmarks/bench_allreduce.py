"""One-shot shared-memory all-reduce against gloo, and what it does to TP decoding, in one run.

    PYTHONPATH=. python -m benchmarks.bench_allreduce [--sizes 4096,65536,...] [--worlds 2,4]
                                                      [--decode-tokens 64] [--skip-decode]

1. Collectives: for each world size, spawns that many processes (gloo over loopback, FileStore
   rendezvous) and times float32 all-reduces of each size through gloo, the one-shot path
   (slots as large as the largest size) and the ``auto`` reducer, in blocks of back-to-back
   calls, the paths taking turns block by block. A row reports the median per-call time of a
   block on rank 0 and the slowest rank's mean.
2. Decoding: ``mid-llama`` batch-1 greedy decoding at TP=1 (local), TP=2 with
   ``allreduce="torch"`` and TP=2 with ``allreduce="one_shot"`` (mp launcher); median TPOT.

Prints tables and writes bench-results/allreduce.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specray.comm.allreduce import AUTO_THRESHOLD_BYTES, make_reducer
from specray.comm.group import TorchGroup
from specray.comm.one_shot import OneShotAllReduce

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
WORLDS = (2, 4)
TIMEOUT_S = 120.0


def _schedule(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per block) for a message size: about a second per world and size."""
    return (20, 10) if nbytes <= 64 << 10 else (10, 4) if nbytes <= 1 << 20 else (5, 2)


def _time_interleaved(paths: dict, x0: torch.Tensor, nbytes: int, group: TorchGroup) -> dict[str, list[float]]:
    """Per-call time of each block of back-to-back calls (block time / calls), the paths taking
    turns block by block: on a shared machine whose load changes from second to second, every
    path then sees the same conditions. Back-to-back calls are what a decoder makes; the untimed
    barrier before each block keeps one path's skew between ranks out of the next one's time."""
    rounds, block = _schedule(nbytes)
    x = x0.clone()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(rounds + 1):  # round 0 warms up: page faults, gloo buffers
        for name, reduce in paths.items():
            x.copy_(x0)  # fresh input per block: block-many in-place sums stay far from overflow
            group.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                reduce(x)
            if i > 0:
                times[name].append((time.perf_counter() - t0) / block)
    return times


def _rank_main(rank: int, world: int, store_path: str, sizes: list[int], queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    group = TorchGroup(tuple(range(world)), rank, "gloo", TIMEOUT_S)
    one_shot = OneShotAllReduce(group, max(sizes), TIMEOUT_S)
    auto = make_reducer(group, [0] * world, "auto", TIMEOUT_S)
    paths = {"gloo": lambda x: dist.all_reduce(x, group=group.pg), "one_shot": one_shot,
             "auto": auto if auto is not None else (lambda x: dist.all_reduce(x, group=group.pg))}
    rows = []
    for nbytes in sizes:
        x0 = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        for name, times in _time_interleaved(paths, x0, nbytes, group).items():
            means = group.all_gather_object(sum(times) / len(times))
            rows.append(dict(world=world, bytes=nbytes, path=name, median_us=statistics.median(times) * 1e6,
                             slowest_rank_mean_us=max(means) * 1e6, blocks=len(times),
                             calls_per_block=_schedule(nbytes)[1]))
    group.barrier()
    one_shot.close()
    if auto is not None:
        auto.close()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_world(world: int, sizes: list[int]) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(tmp, "store"), sizes, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"benchmark ranks exited with {[p.exitcode for p in procs]}")
    return rows


DECODE_RUNS = (("TP=1", 1, "torch", None), ("TP=1 1 thread", 1, "torch", 1), ("TP=2 torch", 2, "torch", None),
               ("TP=2 one_shot", 2, "one_shot", None))
"""(label, tp, allreduce, intra-op threads of the TP=1 process; None: torch's default, all cores).
TP=2 ranks take one core each (the mp launcher splits the cores). TP=1 runs twice because on a
loaded two-core machine two OpenMP threads can be far slower than one (they spin on each other)."""


def run_decode(num_tokens: int, repeats: int = 5) -> list[dict]:
    """mid-llama batch-1 greedy decoding: median TPOT per setup. Every engine stays up and the
    setups take turns, one generation each, so load that comes and goes hits them alike."""
    from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams

    prompt = [[1, 450, 4996, 17354, 1701, 432, 17204, 975]]
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    default_threads = torch.get_num_threads()
    tpots: dict[str, list[float]] = {label: [] for label, *_ in DECODE_RUNS}
    tokens: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for _, tp, mode, _ in DECODE_RUNS:
            if (tp, mode) not in engines:
                engines[tp, mode] = stack.enter_context(LLM(EngineConfig(
                    model="mid-llama", kv=KVConfig(capacity_tokens=2048), parallel=ParallelConfig(
                        tp_size=tp, launcher="local" if tp == 1 else "mp", allreduce=mode))))
                engines[tp, mode].generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for _ in range(repeats):
            for label, tp, mode, threads in DECODE_RUNS:
                torch.set_num_threads(threads or default_threads)
                out = engines[tp, mode].generate(prompt, params)[0]
                tpots[label].append(out.metrics["tpot_s"])
                tokens[label] = out.token_ids
        torch.set_num_threads(default_threads)
    rows = []
    for label, tp, mode, threads in DECODE_RUNS:
        tpot = statistics.median(tpots[label])
        rows.append(dict(setup=label, tp=tp, allreduce=mode, tp1_threads=threads or default_threads if tp == 1
                         else None, tpot_ms=tpot * 1e3, tok_per_s=1.0 / tpot,
                         same_tokens_as_tp1=tokens[label] == tokens[DECODE_RUNS[0][0]]))
    for row in rows:
        row["speedup_vs_tp1"] = row["tok_per_s"] / rows[0]["tok_per_s"]
    return rows


def _decode_table(rows: list[dict]) -> str:
    lines = [f"{'mid-llama batch 1':<18} {'TPOT ms':>9} {'tok/s':>8} {'vs TP=1':>8} {'tokens = TP=1':>14}"]
    lines += [f"{r['setup']:<18} {r['tpot_ms']:>9.2f} {r['tok_per_s']:>8.1f} {r['speedup_vs_tp1']:>7.2f}x "
              f"{str(r['same_tokens_as_tp1']):>14}" for r in rows]
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    by_key = {(r["world"], r["bytes"], r["path"]): r["median_us"] for r in rows}
    lines = [f"{'world':>5} {'size':>8} {'gloo us':>10} {'one-shot us':>12} {'auto us':>10} "
             f"{'gloo/one-shot':>14} {'gloo/auto':>10}"]
    for world, nbytes in dict.fromkeys((r["world"], r["bytes"]) for r in rows):
        g, o, a = (by_key[(world, nbytes, p)] for p in ("gloo", "one_shot", "auto"))
        size = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
        lines.append(f"{world:>5} {size:>8} {g:>10.1f} {o:>12.1f} {a:>10.1f} {g / o:>13.1f}x {g / a:>9.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decoding run")
    parser.add_argument("--skip-decode", action="store_true", help="only the collectives table")
    parser.add_argument("--out", default="bench-results/allreduce.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [row for world in map(int, args.worlds.split(",")) for row in run_world(world, sizes)]
    print(_table(rows))
    print(f"auto threshold: {AUTO_THRESHOLD_BYTES} bytes; {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    decode = [] if args.skip_decode else run_decode(args.decode_tokens)
    if decode:
        print(_decode_table(decode))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(auto_threshold_bytes=AUTO_THRESHOLD_BYTES, cpus=os.cpu_count(),
                                   load_average=os.getloadavg(), allreduce=rows, decode=decode), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
