"""The small-row GEMM kernel for CPU ranks (``csrc/small_gemm.c``), built on first use.

Decode and verify steps multiply a few rows (a batch of one token per sequence, or k + 1
verify rows) by every weight: the time goes into reading the weights, and the kernel
reads them at close to streaming speed where MKL and oneDNN do not (see the C file).

It is compiled on the machine that runs it (``cc -O3 -march=native -fopenmp``, about a
second) into ``$SPECRAY_CACHE/kernels/<hash of source, compiler and CPU flags>/`` and
loaded with ctypes. It links ``libgomp.so.1``, which the loader resolves to the OpenMP
runtime torch already loaded, so it shares torch's threads and ``torch.set_num_threads``.
Without a C compiler, or with ``SPECRAY_CPU_KERNELS=0``, ``load_small_gemm`` returns None
and the linear layers keep using torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "small_gemm.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
COMPILE_TIMEOUT_S = 120


class SmallGemm:
    """``y = x @ w.T (+ bias)`` for float32 CPU tensors with 1..max_rows rows."""

    def __init__(self, lib: ctypes.CDLL):
        self._gemm = lib.specray_small_gemm
        self._gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._gemm.restype = ctypes.c_int
        self.max_rows = lib.specray_small_gemm_max_rows()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        rows, n = x.shape[0], weight.shape[0]
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        rc = self._gemm(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                        y.data_ptr(), rows, n, weight.shape[1])
        if rc != 0:
            raise ValueError(f"small_gemm takes 1..{self.max_rows} rows, not {rows}")
        return y

    def accepts(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dim() == 2 and 1 <= x.shape[0] <= self.max_rows and x.dtype == weight.dtype == torch.float32
                and x.device.type == "cpu" and weight.is_contiguous())


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build next to the target and rename: ranks of one host may build at the same time
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_small_gemm() -> SmallGemm | None:
    """The kernel, built if this machine has none cached; None where it cannot be had."""
    if os.environ.get("SPECRAY_CPU_KERNELS", "1").strip() == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: CPU linears use torch's kernels at every row count")
        return None
    from specray.models.presets import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()
    target = cache_root() / "kernels" / key[:16] / "libspecray_small_gemm.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return SmallGemm(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the CPU small-row GEMM kernel (%s); using torch's kernels", detail)
        return None
