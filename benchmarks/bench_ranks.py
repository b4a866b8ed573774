"""Ranks benchmark: ``python -m benchmarks.bench_ranks`` (table on stdout, JSON under bench-results/).

1. mid-llama, batch 1 decoding: TP=1 (local) against TP=2 (mp), as tok/s and their ratio, in one run.
2. The control channel alone: what sending one step plan costs, inside a node (shared-memory
   ring) and over the CPU group (gloo broadcast). Measured as a ping-pong between two
   processes (rank 0 sends a plan, rank 1 answers with an empty message over the same kind
   of channel), reported as half the round trip: the one-way latency a follower sees.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.workers.plan import StepPlan


def decode_plan(batch: int) -> StepPlan:
    """What a decode step sends: one new token per sequence, a new page now and then."""
    return StepPlan(seq_ids=list(range(batch)), input_ids=[[1234] for _ in range(batch)],
                    start_positions=[500 + i for i in range(batch)], new_blocks=[[] for _ in range(batch)])


def bench_decode(tp: int, max_tokens: int, timeout_s: float) -> dict:
    config = EngineConfig(model="mid-llama", kv=KVConfig(capacity_tokens=4096), parallel=ParallelConfig(
        tp_size=tp, launcher="local" if tp == 1 else "mp", timeout_s=timeout_s))
    with LLM(config) as llm:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        llm.generate([list(range(1, 17))], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        tpots = [llm.generate([list(range(1, 17))], params)[0].metrics["tpot_s"] for _ in range(3)]
    tpot = statistics.median(tpots)
    return dict(tp=tp, tpot_ms=tpot * 1e3, tok_per_s=1.0 / tpot)


def _shm_peer(names: tuple[str, str], payload: bytes, rounds: int, rank: int, out) -> None:
    from specray.comm.channel import ShmRing
    from specray.comm.shm import attach_segment

    # rank 0 writes plans into ring A and reads answers from ring B; rank 1 the other way.
    send = ShmRing(attach_segment(names[rank]), None)
    recv = ShmRing.attach(names[1 - rank], 0)
    out.send("ready")
    out.recv()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            send.send_bytes(payload, 30)
            recv.recv_bytes(30)
        else:
            pickle.loads(recv.recv_bytes(30))
            send.send_bytes(b"", 30)
        times.append(time.perf_counter() - start)
    out.send(times)


def bench_shm(plan: StepPlan, rounds: int) -> float:
    from specray.comm.channel import ShmRing
    from specray.comm.shm import segment_name, unlink_segment

    names = (segment_name("bench", "a"), segment_name("bench", "b"))
    for name in names:
        ShmRing.create(name, 1, 8, 64 << 10).close()
    payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_shm_peer, args=(names, payload, rounds, r, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for conn, _ in pipes:
            conn.recv()
    finally:
        for name in names:
            unlink_segment(name)
    for conn, _ in pipes:
        conn.send("go")
    times = pipes[0][0].recv()
    pipes[1][0].recv()
    for p in procs:
        p.join()
    return statistics.median(times[rounds // 10:]) / 2


def _gloo_peer(rank: int, port: int, plan: StepPlan, rounds: int, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], backend="gloo")
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        box = [plan if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        box = [None]
        dist.broadcast_object_list(box, src=1, group=group)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    if rank == 0:
        out.send(times)


def bench_gloo(plan: StepPlan, rounds: int) -> float:
    from specray.comm.rendezvous import host_store

    store = host_store(60)
    ctx = mp.get_context("spawn")
    recv_end, send_end = ctx.Pipe()
    procs = [ctx.Process(target=_gloo_peer, args=(r, store.port, plan, rounds, send_end)) for r in range(2)]
    for p in procs:
        p.start()
    times = recv_end.recv()
    for p in procs:
        p.join()
    return statistics.median(times[rounds // 10:]) / 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--tp1-threads", type=int, default=None,
                        help="intra-op threads of the TP=1 run (default: torch's, all cores); on a host shared "
                             "with other work, 1 avoids the OpenMP spin-wait collapse of an oversubscribed CPU")
    args = parser.parse_args(argv)
    if args.tp1_threads:
        torch.set_num_threads(args.tp1_threads)

    load_before = os.getloadavg()[0]
    decode = [bench_decode(tp, args.max_tokens, timeout_s=300) for tp in (1, 2)]
    ratio = decode[1]["tok_per_s"] / decode[0]["tok_per_s"]
    channel = []
    for batch in (1, 32):
        plan = decode_plan(batch)
        size = len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        channel.append(dict(batch=batch, plan_bytes=size, shm_us=bench_shm(plan, args.rounds) * 1e6,
                            cpu_group_us=bench_gloo(plan, args.rounds // 4) * 1e6))

    print(f"mid-llama batch-1 decode ({args.max_tokens} tokens, median TPOT of 3 calls)")
    print(f"{'tp':>4} {'TPOT ms':>9} {'tok/s':>8}")
    for row in decode:
        print(f"{row['tp']:>4} {row['tpot_ms']:>9.2f} {row['tok_per_s']:>8.1f}")
    print(f"TP=2 / TP=1 tok/s ratio: {ratio:.2f}")
    print("\ncontrol channel, one plan one way (half a ping-pong round trip, median)")
    print(f"{'batch':>6} {'plan B':>7} {'shm us':>8} {'cpu-group us':>13}")
    for row in channel:
        print(f"{row['batch']:>6} {row['plan_bytes']:>7} {row['shm_us']:>8.1f} {row['cpu_group_us']:>13.1f}")

    cpus = len(os.sched_getaffinity(0))
    print(f"\n{cpus} cores, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after: TP=1 runs "
          f"{torch.get_num_threads()} intra-op threads in this process, each TP=2 rank {max(1, cpus // 2)}; on a "
          f"loaded host the numbers measure the contention as much as the ranks")
    result = dict(decode=decode, tp2_over_tp1=ratio, channel=channel, host=platform.node(), cpus=cpus,
                  load_average=[load_before, os.getloadavg()[0]], torch_threads_tp1=torch.get_num_threads(), time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_ranks-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
