"""The batch-1 (and few-row) GEMV of a CPU rank: GB/s of weight read, BLAS against small_gemm.

    python -m benchmarks.bench_gemv [--rows 1,4,6,8] [--threads 1,2] [--rounds 5] [--plans]
    python -m benchmarks.bench_gemv --quant   (the GGUF block-quantized GEMV, bench_quant)

For each weight shape of SmolLM2-135M (qkv, o, gate_up, down, LM head and its TP 3 shard)
and mid-llama (gate_up, down), each row count and thread count: ``F.linear`` (BLAS),
``small_gemm`` with issue 18's first plan ("old": four rows of w at a time up to 4 rows of
x, two beyond, a 4 KB software prefetch into L1), with the plans before the verify-step work
("prev": the tuned batch-1 GEMV, "old" at 2+ rows) and with the tuned plans specray runs
("new"); with ``--plans`` also every candidate plan the tuned ones were chosen from, named
c<rows of w>[p: L1 prefetch, q: L2 prefetch][h: 8-float halves, k: halves in chunks of K].
Every kernel alternates within each round, in one process (the machine may
be shared; its memory bandwidth swings), and the fastest of ``--rounds`` counts.

A decode step reads each weight from memory (SmolLM2's 513 MiB do not fit a 32 MiB L3), so
each timing cycles through enough copies of the weight to exceed ``--footprint-mib``: a
weight read back from L3 would flatter every kernel. Prints the load average before and
after and writes the table as JSON to bench-results/gemv.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specray.models.cpu_kernels import load_cpu_kernels
from specray.models.quant_kernels import FAST_ROWS

SHAPES = {  # [out, in]
    "smollm2 qkv": (960, 576),
    "smollm2 o": (576, 576),
    "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536),
    "smollm2 lm head": (49152, 576),
    "smollm2 lm head / 3": (49152 // 3, 576),
    "mid-llama gate_up": (5632, 1024),
    "mid-llama down": (1024, 2816),
}
# (rows of w per pass, prefetch: 0 none / 1 L1 / 2 L2, 8-float halves: 0 no / 1 yes / 2 in chunks of K)
CANDIDATES = [(c, pf, 0) for c in (1, 2, 4) for pf in (0, 1, 2)] + [(1, pf, h) for pf in (0, 1, 2) for h in (1, 2)]


def kernels_under_test(kernels, threads: int, plans: bool) -> dict:
    """name -> f(x, w): BLAS, the old and the tuned plan, and with ``plans`` every candidate."""
    def tuned(x, w):
        return kernels.small_gemm(x, w, None)

    def with_plans(which):
        def f(x, w):
            kernels.use_gemv_plans(which)
            try:
                return kernels.small_gemm(x, w, None)
            finally:
                kernels.use_gemv_plans("tuned")
        return f

    out = {"blas": lambda x, w: F.linear(x, w), "old": with_plans("first"), "prev": with_plans("before verify work"),
           "new": tuned}
    if plans:
        for c, pf, halves in CANDIDATES:
            out[f"c{c}{['', 'p', 'q'][pf]}{['', 'h', 'k'][halves]}"] = (
                lambda x, w, c=c, pf=pf, h=halves: kernels.small_gemm_plan(x, w, None, c, pf, threads, h))
    return out


def gbps(f, x: torch.Tensor, weights: list[torch.Tensor], min_bytes: int, turn: int) -> float:
    """GB/s of weight read over enough calls to read min_bytes (at least one), cycling through
    the copies from copy ``turn`` on; the copy before them is read first, as a warm-up."""
    size = weights[0].numel() * weights[0].element_size()
    calls = max(1, -(-min_bytes // size))
    f(x, weights[(turn - 1) % len(weights)])  # warm-up (code, x, scratch)
    start = time.perf_counter()
    for i in range(turn, turn + calls):
        f(x, weights[i % len(weights)])
    return calls * size / (time.perf_counter() - start) / 1e9


def bench(rows_list, threads_list, rounds: int, footprint: int, read: int, plans: bool) -> list[dict]:
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("specray's CPU kernels are not available here (no compiler, or SPECRAY_CPU_KERNELS=0)")
    results, saved = [], torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n, k) in SHAPES.items():
        size = n * k * 4
        weights = [torch.randn(n, k, generator=gen) for _ in range(max(2, -(-footprint // size)))]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            for threads in threads_list:
                torch.set_num_threads(threads)
                fs = kernels_under_test(kernels, threads, plans)
                best = dict.fromkeys(fs, 0.0)
                turn = 0
                for _ in range(rounds):
                    for name, f in fs.items():
                        best[name] = max(best[name], gbps(f, x, weights, read, turn))
                        turn += 2 + read // size
                results.append({"shape": shape_name, "n": n, "k": k, "rows": rows, "threads": threads,
                                "gbps": {name: round(v, 2) for name, v in best.items()}})
                print_row(results[-1], first=len(results) == 1)
        del weights
    torch.set_num_threads(saved)
    return results


# SmolLM2's layer shapes as its shipped GGUF file holds them: Q4_1 layers, the Q8_0 embedding (the tied LM head)
# the fused weights the model runs (q/k/v and gate/up are one weight each since the fused layers)
QUANT_SHAPES = {"smollm2 qkv": (960, 576, "Q4_1"), "smollm2 o": (576, 576, "Q4_1"),
                "smollm2 gate_up": (3072, 576, "Q4_1"), "smollm2 down": (576, 1536, "Q4_1"),
                "smollm2 lm head": (49152, 576, "Q8_0"),
                # mid-llama written as Q4_K_M (bench_vs_llamacpp --model mid-llama --weights q4_k_m)
                "mid-llama gate_up": (5632, 1024, "Q4_K"), "mid-llama down": (1024, 2816, "Q6_K"),
                "mid-llama lm head": (32000, 1024, "Q6_K")}
SCALES_AT = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
"""Where a block's fp16 scales sit, where not only at byte 0."""


def random_blocks(ggml_type, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks with finite fp16 scales (the speed does not depend on the values)."""
    from gguf import GGML_QUANT_SIZES

    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = torch.randint(0, 256, (n * k // block_size, block_bytes), dtype=torch.uint8, generator=gen)
    for at in SCALES_AT.get(ggml_type.name, (0,)):
        blocks[:, at : at + 2] = torch.tensor([0x00, 0x2C], dtype=torch.uint8)  # 0.0625
    return blocks.reshape(n, -1)


def bench_quant(rows_list, threads_list, rounds: int, footprint: int, read: int) -> list[dict]:
    """GB/s of quantized bytes read by the block-quantized GEMV against small_gemm on the same
    weight in float32 (GB/s of its float32 bytes), and their time ratio, alternating per round;
    where the type has one, also SPECRAY_CPU_QUANT=fast's kernel on the same blocks ("fast")."""
    from gguf import GGMLQuantizationType, quants

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("specray's CPU kernels are not available here (no compiler, or SPECRAY_CPU_KERNELS=0)")
    results, saved = [], torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    for shape_name, (n, k, type_name) in QUANT_SHAPES.items():
        qtype = GGMLQuantizationType[type_name]
        first = random_blocks(qtype, n, k, gen)
        dense = torch.from_numpy(quants.dequantize(first.numpy(), qtype))
        more_f32, more_quant = (max(1, -(-footprint // size) - 1) for size in (n * k * 4, first.numel()))
        copies = {"f32": [dense] + [dense.clone() for _ in range(more_f32)],
                  "quant": [first] + [random_blocks(qtype, n, k, gen) for _ in range(more_quant)]}
        has_fast = kernels.quant.has_fast_kernel(qtype) and n % FAST_ROWS == 0
        if has_fast:  # SPECRAY_CPU_QUANT=fast's kernel on the same blocks, repacked
            copies["fast"] = [kernels.quant.fast_repack(c, qtype, (n, k)) for c in copies["quant"]]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            for threads in threads_list:
                torch.set_num_threads(threads)
                fs = {"f32": lambda x, w: kernels.small_gemm(x, w, None),
                      "quant": lambda x, w: kernels.quant.gemv(x, w, qtype, (n, k))}
                if has_fast:
                    fs["fast"] = lambda x, w: kernels.quant.fast_gemv(x, w, qtype, (n, k))
                best, turn = dict.fromkeys(fs, 0.0), 0
                for _ in range(rounds):
                    for name, f in fs.items():
                        best[name] = max(best[name], gbps(f, x, copies[name], read, turn))
                    turn += 2 + read // first.numel()
                ratio = (best["quant"] / first.numel()) / (best["f32"] / (n * k * 4))  # f32 time / quant time
                results.append({"shape": shape_name, "type": type_name, "n": n, "k": k, "rows": rows,
                                "threads": threads, "gbps": {m: round(v, 2) for m, v in best.items()},
                                "f32_time_over_quant_time": round(ratio, 2)})
                fast = f", fast {best['fast']:6.1f} GB/s" if has_fast else ""
                print(f"{shape_name:18s} {type_name:5s} rows {rows:2d} thr {threads}: f32 {best['f32']:6.1f} GB/s, "
                      f"quant {best['quant']:6.1f} GB/s of blocks{fast}, f32 time / quant time {ratio:5.2f}", flush=True)
        del copies
    torch.set_num_threads(saved)
    return results


def print_row(r: dict, first: bool) -> None:
    names = list(r["gbps"])
    if first:
        print(f"{'shape':20s} {'rows':>4s} {'thr':>3s} " + " ".join(f"{n:>6s}" for n in names)
              + f" {'new/blas':>8s} {'new/old':>7s} {'new/prev':>8s}   (GB/s of weight read)")
    g = r["gbps"]
    print(f"{r['shape']:20s} {r['rows']:4d} {r['threads']:3d} " + " ".join(f"{g[n]:6.1f}" for n in names)
          + f" {g['new'] / g['blas']:8.2f} {g['new'] / g['old']:7.2f} {g['new'] / g['prev']:8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,6,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--footprint-mib", type=int, default=128, help="weight copies cycled per timing (> L3)")
    parser.add_argument("--read-mib", type=int, default=128,
                        help="weight read per timing (0: one call; with many rounds, the fastest call "
                             "estimates an uncontended machine's speed)")
    parser.add_argument("--plans", action="store_true", help="also every candidate plan")
    parser.add_argument("--quant", action="store_true",
                        help="the GGUF block-quantized GEMV (SmolLM2's shipped types, mid-llama's Q4_K_M) "
                             "against small_gemm in float32")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated names from SHAPES (with --quant: QUANT_SHAPES); default: all")
    parser.add_argument("--out", default="bench-results/gemv.json")
    args = parser.parse_args()
    table = QUANT_SHAPES if args.quant else SHAPES
    if args.shapes is not None:
        unknown = set(args.shapes.split(",")) - set(table)
        if unknown:
            raise SystemExit(f"--shapes: {sorted(unknown)} are not among {list(table)}")
        for name in list(table):
            if name not in args.shapes.split(","):
                del table[name]
    if args.quant and args.out == "bench-results/gemv.json":
        args.out = "bench-results/gemv_quant.json"
    load_before = os.getloadavg()
    print(f"load average before {load_before}; torch threads {torch.get_num_threads()}")
    with torch.inference_mode():
        if args.quant:
            results = bench_quant([int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")],
                                  args.rounds, args.footprint_mib * 2**20, args.read_mib * 2**20)
        else:
            results = bench([int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")],
                        args.rounds, args.footprint_mib * 2**20, args.read_mib * 2**20, args.plans)
    load_after = os.getloadavg()
    print(f"load average after {load_after}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_before": load_before, "load_after": load_after, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
