"""A fused decode / verify step on this checkout's CPU kernels against another revision's, in one process.

    python -m benchmarks.ab_cpu_step --base edfdb4c [--rounds 20] [--lm-head-rows last|all] [--threads 0]

Builds ``specray/models/csrc`` as it was at ``--base`` (``git archive``, the same compiler
flags) into a temporary directory, loads it beside this checkout's build, and times SmolLM2's
decode x1, verify 1x4 and verify 1x6 steps (``bench_cpu_step.make_step``) on each, the two
alternating within every round (the machine may be shared); the fastest of ``--rounds``
counts. Only the C kernels differ between the two columns: the Python around them is this
checkout's. Reported: each step's time, before / after, and each step over the decode step.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_cpu_step import STEPS, make_step
from specray.comm.context import DistContext
from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray.models.presets import resolve_model

LABELS = ("decode x1", "verify 1x4", "verify 1x6")
# the entry points a fused step calls, which every revision since 2026-12-07's RoPE by positions
# exports with these signatures and step table (an older --base reads the table differently)
ENTRY_POINTS = {"_gemm": "specray_small_gemm", "_panel": "specray_panel_gemm", "_norm": "specray_rms_norm",
                "_attn": "specray_paged_attention", "_rope": "specray_rope_store_kv",
                "_attn_block": "specray_attention_block", "_mlp_block": "specray_mlp_block",
                "_layers": "specray_dense_layers"}


def base_kernels(revision: str, workdir: Path, current: cpu_kernels.CpuKernels) -> cpu_kernels.CpuKernels:
    """``revision``'s kernels, bound with the current build's signatures for ENTRY_POINTS."""
    archive = subprocess.run(["git", "archive", revision, "specray/models/csrc"], check=True, capture_output=True,
                             timeout=60).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(workdir)
    sources = sorted((workdir / "specray/models/csrc").glob("*.c"))
    library = workdir / "libspecray_base.so"
    subprocess.run([cpu_kernels.find_compiler(), *cpu_kernels.FLAGS, *map(str, sources), "-o", str(library), "-lm"],
                   check=True, timeout=cpu_kernels.COMPILE_TIMEOUT_S)
    lib = ctypes.CDLL(str(library))
    kernels = cpu_kernels.CpuKernels.__new__(cpu_kernels.CpuKernels)
    for attr, symbol in ENTRY_POINTS.items():
        f, like = getattr(lib, symbol), getattr(current, attr)
        f.argtypes, f.restype = like.argtypes, like.restype
        setattr(kernels, attr, f)
    kernels.max_rows, kernels.max_head_dim = lib.specray_small_gemm_max_rows(), lib.specray_max_head_dim()
    return kernels


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a git revision of this repository")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lm-head-rows", choices=("last", "all"), default="last")
    parser.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0: as they are")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    after = cpu_kernels.load_cpu_kernels()
    if after is None:
        raise SystemExit("specray's CPU kernels are not available here (no compiler, or SPECRAY_CPU_KERNELS=0)")
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"before": base_kernels(args.base, Path(tmp), after), "after": after}
        print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}; base {args.base}; "
              f"LM head on the {args.lm_head_rows} rows of a verify step")
        model = load_model(resolve_model("smollm2-135m"), DistContext.single(), "float32")
        steps = {label: make_step(model, *STEPS[label], args.lm_head_rows) for label in LABELS}
        best = {}
        for _ in range(args.rounds):
            for label, step in steps.items():
                for mode, k in kernels.items():
                    cpu_kernels.load_cpu_kernels = lambda k=k: k  # kernels_for looks it up at call time
                    step()  # warm-up of this build
                    start = time.perf_counter()
                    step()
                    best[label, mode] = min(best.get((label, mode), float("inf")), time.perf_counter() - start)
    print(f"load average after {os.getloadavg()}")
    print(f"{'step':12s} {'before ms':>10s} {'after ms':>9s} {'before/after':>13s} {'before/decode':>14s} "
          f"{'after/decode':>13s}")
    for label in LABELS:
        b, a = best[label, "before"], best[label, "after"]
        print(f"{label:12s} {b * 1e3:10.2f} {a * 1e3:9.2f} {b / a:13.2f} {b / best['decode x1', 'before']:14.2f} "
              f"{a / best['decode x1', 'after']:13.2f}")


if __name__ == "__main__":
    main()
