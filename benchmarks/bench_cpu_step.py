"""A CPU rank's model step before and after issue 18, three ways in one process.

    python -m benchmarks.bench_cpu_step [--models smollm2-135m,mid-llama] [--rounds 5] [--steps "decode x1"]

- "before": what specray did until then, reproduced here, module by module: one row on BLAS
  (``F.linear``), 2-8 rows on ``small_gemm``, more rows on a oneDNN-packed second copy of
  every weight (2x the weight memory);
- "modules": ``layers.linear`` as it is now, module by module (``SPECRAY_CPU_FUSED_LAYERS=0``):
  one copy, ``small_gemm`` up to its row limit (the batch-1 GEMV included), ``panel_gemm``
  beyond;
- "fused": as specray runs now: decode and verify steps through ``fused_decode.py`` (one C
  call over every layer at TP 1); prefill as "modules";
- "fused old": "fused" with ``small_gemm``'s first plan (``CpuKernels.use_gemv_plans("first")``:
  four rows of w per pass at M = 1, every thread): the tuned GEMV plan's effect alone (the two
  give the same bits);
- "fused prev": "fused" with the plans before the verify-step work (``use_gemv_plans("before
  verify work")``: the tuned batch-1 GEMV, the first plan at 2+ rows).

``--modes`` picks some of them; ``--lm-head-rows all`` scores every row of a verify step
through the LM head, as the engine's verify step does (``workers/spec_step.py``), instead of
the last row of each sequence.

Each step is one model forward plus the LM head on the last row of each sequence, float32,
on the current torch threads: decode of 1, 4 and 8 sequences (1 row each, 128 tokens
cached), verify of 4 sequences x 6 rows (k = 5), and prefill of one 128-token prompt. The
two modes alternate within every round (the machine may be shared; its memory bandwidth
swings), and the fastest of ``--rounds`` counts. Reported: the speed of each mode over
"before" (> 1: faster), the weight bytes each holds, and the GEMV floor of a batch-1 step
(``torch.mv`` over every weight shape, as in bench_vs_transformers) in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_vs_transformers import weight_shapes
from specray.comm.context import DistContext
from specray.models import layers
from specray.models.attention import build_metadata
from specray.models.cpu_kernels import load_cpu_kernels
from specray.models.loader import load_model
from specray.models.presets import resolve_model

CONTEXT = 128  # tokens cached before a decode or verify step
BLOCK = 16
MODES = ("before", "modules", "fused", "fused old", "fused prev")
PLANS = {"fused": "tuned", "fused old": "first", "fused prev": "before verify work"}
STEPS = {"decode x1": (1, 1), "verify 1x4": (1, 4), "verify 1x5": (1, 5), "verify 1x6": (1, 6), "decode x4": (4, 1), "decode x8": (8, 1), "verify 4x6": (4, 6), "prefill 128": (1, 128)}


def packed_copies(model) -> dict[int, torch.Tensor]:
    """The oneDNN-packed copy of every 2-d weight that specray kept until issue 18."""
    packed = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and weight.dim() == 2 and weight.data_ptr() not in packed:
            packed[weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
    return packed


@contextlib.contextmanager
def before_issue_18(packed: dict[int, torch.Tensor]):
    """The old dispatch: 1 row on BLAS, 2-8 rows on small_gemm, more on the packed copy."""
    kernels = load_cpu_kernels()
    current = layers.linear

    def old_linear(x, weight, bias):
        rows = x.shape[0]
        if kernels is not None and 2 <= rows <= 8:
            return kernels.small_gemm(x, weight, bias)
        if rows >= 4:
            return torch.ops.mkldnn._linear_pointwise(x, packed[weight.data_ptr()], bias, "none", [], "")
        return F.linear(x, weight, bias)

    layers.linear = old_linear
    try:
        yield
    finally:
        layers.linear = current


def make_step(model, num_seqs: int, rows: int, lm_head_rows: str = "last"):
    """A closure running one step of ``num_seqs`` sequences with ``rows`` new tokens each, the
    LM head on the last row of each ("last") or, for a verify step, on every row ("all")."""
    arch = model.arch
    prefill = rows > 1 and num_seqs == 1 and rows == 128
    cached = 0 if prefill else CONTEXT
    per_seq = -(-(cached + rows) // BLOCK)
    pools = [torch.zeros(num_seqs * per_seq + 1, 2, model.num_local_kv_heads, BLOCK, arch.head_dim)
             for _ in range(arch.num_layers)]
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(num_seqs)]
    positions, meta = build_metadata(tables, BLOCK, [cached] * num_seqs, [rows] * num_seqs, torch.device("cpu"))
    ids = torch.randint(0, arch.vocab_size, (num_seqs * rows,))
    last = torch.arange(rows - 1, num_seqs * rows, rows)
    if lm_head_rows == "all" and not prefill:
        last = torch.arange(num_seqs * rows)

    def step():
        meta.derived.clear()
        hidden = model(ids, positions, pools, meta)
        return model.logits(hidden[last])
    return step


def floor_inputs(shapes: list[tuple[int, int]]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """float32 matrices of every weight shape and a vector per width (bench_vs_transformers' floor)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in shapes], {c: torch.randn(c, generator=gen) for _, c in shapes}


def gemv_pass_ms(weights: list[torch.Tensor], vectors: dict[int, torch.Tensor]) -> float:
    """One pass of ``torch.mv`` over every weight: the GEMV floor of a batch-1 step."""
    start = time.perf_counter()
    for w in weights:
        torch.mv(w, vectors[w.shape[1]])
    return (time.perf_counter() - start) * 1e3


def time_once(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


@torch.inference_mode()
def bench_model(name: str, rounds: int, labels: list[str], modes: list[str], lm_head_rows: str) -> None:
    model = load_model(resolve_model(name), DistContext.single(), "float32")
    weight_bytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    packed = packed_copies(model) if "before" in modes else {}
    packed_bytes = sum(p.numel() * p.element_size() for p in packed.values())
    steps = {label: make_step(model, *STEPS[label], lm_head_rows) for label in labels}
    best = {(label, mode): float("inf") for label in labels for mode in modes}
    kernels = load_cpu_kernels()
    floor_weights, floor = floor_inputs(weight_shapes(model.arch)), float("inf")
    for _ in range(rounds):
        for label, step in steps.items():
            for mode in modes:
                model.is_fused = mode.startswith("fused")
                kernels.use_gemv_plans(PLANS.get(mode, "tuned"))
                with before_issue_18(packed) if mode == "before" else contextlib.nullcontext():
                    step()  # warm-up of this mode
                    best[label, mode] = min(best[label, mode], time_once(step))
                kernels.use_gemv_plans("tuned")
        floor = min(floor, gemv_pass_ms(*floor_weights))
    model.is_fused = True
    print(f"\n{name}: weights {weight_bytes / 2**20:.0f} MiB; before {(weight_bytes + packed_bytes) / 2**20:.0f} MiB "
          f"(+ packed copies), now {weight_bytes / 2**20:.0f} MiB; GEMV floor of a batch-1 step {floor:.2f} ms; "
          f"LM head on the {lm_head_rows} rows of a verify step")
    ratios = [(a, b) for a, b in (("before", "modules"), ("before", "fused"), ("fused old", "fused"),
                                  ("fused prev", "fused")) if a in modes and b in modes]
    print(f"{'step':12s} " + " ".join(f"{m + ' ms':>13s}" for m in modes) + " "
          + " ".join(f"{a + '/' + b:>17s}" for a, b in ratios) + f" {'floor/fused':>12s}")
    for label in labels:
        ms = {mode: best[label, mode] * 1e3 for mode in modes}
        floor_col = f" {floor / ms['fused']:12.2f}" if "fused" in ms else ""
        print(f"{label:12s} " + " ".join(f"{ms[m]:13.2f}" for m in modes) + " "
              + " ".join(f"{ms[a] / ms[b]:17.2f}" for a, b in ratios) + floor_col)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,mid-llama")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {list(STEPS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--lm-head-rows", choices=("last", "all"), default="last")
    parser.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0: as they are")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    labels, modes = args.steps.split(","), args.modes.split(",")
    if set(labels) - set(STEPS):
        raise SystemExit(f"--steps: {sorted(set(labels) - set(STEPS))} are not among {list(STEPS)}")
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes: {sorted(set(modes) - set(MODES))} are not among {list(MODES)}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    for name in args.models.split(","):
        bench_model(name, args.rounds, labels, modes, args.lm_head_rows)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
