"""Where a fused decode / verify step's time goes, per component (issue 13/18: verify steps).

    python -m benchmarks.profile_cpu_step [--model smollm2-135m] [--steps "decode x1,verify 1x4,verify 1x6"] [--rounds 8]

Builds the CPU kernels once more with ``-DSPECRAY_PROFILE`` (timers around every step of
``fused_layer.c``'s blocks; the shipped build has none) into a temporary directory, runs
``bench_cpu_step``'s steps through it, the steps alternating within every round, and prints
for each step the median over rounds of the milliseconds a step spent in each component
(summed over the layers), the rest of the step (LM head, Python) and the whole step.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_cpu_step import STEPS, make_step
from specray.comm.context import DistContext
from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray.models.presets import resolve_model

COMPONENTS = ("add", "norm", "qkv", "rope", "attn", "o", "gate_up", "silu", "down")


def profiled_kernels(workdir: Path) -> tuple[cpu_kernels.CpuKernels, ctypes.CDLL]:
    lib_path = workdir / "libspecray_profile.so"
    compiler = cpu_kernels.find_compiler()
    if compiler is None:
        raise SystemExit("no C compiler: nothing to profile")
    subprocess.run([compiler, *cpu_kernels.FLAGS, "-DSPECRAY_PROFILE", *map(str, cpu_kernels.SOURCES), "-o",
                    str(lib_path), "-lm"], check=True, timeout=cpu_kernels.COMPILE_TIMEOUT_S)
    lib = ctypes.CDLL(str(lib_path))
    lib.specray_profile_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return cpu_kernels.CpuKernels(lib), lib


def read_profile(lib: ctypes.CDLL) -> list[float]:
    out = (ctypes.c_double * 16)()
    n = lib.specray_profile_read(out, 1)
    return [out[i] * 1e3 for i in range(n)]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", default="decode x1,verify 1x4,verify 1x6")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0: as they are")
    args = parser.parse_args()
    labels = args.steps.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    if set(labels) - set(STEPS):
        raise SystemExit(f"--steps: {sorted(set(labels) - set(STEPS))} are not among {list(STEPS)}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels, lib = profiled_kernels(Path(tmp))
        cpu_kernels.load_cpu_kernels = lambda: kernels  # kernels_for looks it up at call time
        model = load_model(resolve_model(args.model), DistContext.single(), "float32")
        model.is_fused = True
        steps = {label: make_step(model, *STEPS[label]) for label in labels}
        samples = {label: [] for label in labels}
        for _ in range(args.rounds):
            for label, step in steps.items():
                step()  # warm-up
                read_profile(lib)
                start = time.perf_counter()
                step()
                total = (time.perf_counter() - start) * 1e3
                parts = read_profile(lib)
                samples[label].append([*parts, total - sum(parts), total])
    print(f"load average after {os.getloadavg()}")
    names = [*COMPONENTS, "rest", "step"]
    print(f"{'ms (median)':12s} " + " ".join(f"{n:>7s}" for n in names))
    for label in labels:
        cols = list(zip(*samples[label]))
        print(f"{label:12s} " + " ".join(f"{statistics.median(c):7.2f}" for c in cols))


if __name__ == "__main__":
    main()
