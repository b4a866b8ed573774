"""specray's CPU kernels (``csrc/*.c``), built on first use and called through ctypes.

- ``small_gemm``: one to a few dozen rows (the batch-1 GEMV, a batch of one token per
  sequence, k + 1 verify rows) times a weight. The time goes into reading the weight, which
  this kernel does at close to streaming speed where BLAS, MKL and oneDNN do not (see
  ``small_gemm.c``).
- ``panel_gemm``: more rows (prefill), packing the weight panel by panel as it goes, so the
  model keeps one copy of each weight (see ``panel_gemm.c``).
- ``rms_norm``, ``rope_store_kv`` and ``paged_attention``: the per-layer steps of decoding
  whose torch cost is the number of ops, fused into one call each (see ``decode_ops.c``).
- ``quant.gemv``: ``small_gemm`` on a weight kept in its GGUF blocks, the same bits
  (see ``quant_gemv.c``, ``quant_kernels.py``).

They are compiled on the machine that runs them (``cc -O3 -march=native -fopenmp``, about
two seconds) into ``$SPECRAY_CACHE/kernels/<hash of sources, compiler and CPU flags>/``;
a new build deletes the builds nothing has loaded for 30 days.
The library links ``libgomp.so.1``, which the loader resolves to the OpenMP runtime torch
already loaded, so the kernels share torch's threads and ``torch.set_num_threads``.
Without a C compiler, or with ``SPECRAY_CPU_KERNELS=0``, ``load_cpu_kernels`` returns None
and every layer keeps using torch's ops.
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
import time
from pathlib import Path

import torch

from specray.envs import cache_root
from specray.errors import SpecrayError
from specray.models.quant_kernels import QuantGemv

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
HEADERS = sorted(CSRC.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
COMPILE_TIMEOUT_S = 120
STALE_BUILD_DAYS = 30  # builds of other source versions unused this long are deleted
GEMV_PLANS = ("tuned", "first", "before verify work")  # small_gemm.c's enum, in its order


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check(rc: int, what: str) -> None:
    if rc == -1:
        raise MemoryError(f"{what}: could not allocate its scratch")
    if rc == -3:
        raise ValueError(f"{what}: a capture layer is not among the layers run, or not in increasing order")
    if rc:
        raise ValueError(f"{what}: more rows than small_gemm's limit")


class FusedLayerKernels:
    """The dense-layer blocks of ``fused_layer.c`` (see ``fused_decode.py``): every argument
    is a contiguous tensor; ``layer``, ``shape`` and ``step`` are int64 address/shape tables."""

    def attention_block(self, layer, shape, step, eps: float, scale: float, x: torch.Tensor,
                        delta: torch.Tensor | None, delta_bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(x)
        _check(self._attn_block(layer.data_ptr(), shape.data_ptr(), step.data_ptr(), eps, scale, x.data_ptr(),
                                _ptr(delta), _ptr(delta_bias), out.data_ptr()), "attention block")
        return out

    def mlp_block(self, layer, shape, eps: float, x: torch.Tensor, delta: torch.Tensor,
                  delta_bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(x)
        _check(self._mlp_block(layer.data_ptr(), shape.data_ptr(), eps, x.data_ptr(), delta.data_ptr(),
                               _ptr(delta_bias), out.data_ptr()), "MLP block")
        return out

    def eagle3_attention_block(self, layer, shape, step, eps: float, scale: float, emb: torch.Tensor,
                               hidden_norm: torch.Tensor, norm_residual: bool, x: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's attention over [norm(emb); hidden_norm(x)]; x becomes the layer's residual."""
        out = torch.empty_like(x)
        _check(self._eagle3_block(layer.data_ptr(), shape.data_ptr(), step.data_ptr(), eps, scale, emb.data_ptr(),
                                  hidden_norm.data_ptr(), int(norm_residual), x.data_ptr(), out.data_ptr()),
               "EAGLE-3 attention block")
        return out

    def dense_layers(self, table, shape, step, eps: float, scale: float, x: torch.Tensor,
                     scratch: torch.Tensor, capture_at: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every layer of ``table`` on x in place; with ``capture_at`` (int64 layer indices,
        increasing), returns [len(capture_at), *x.shape]: the residual stream after each."""
        if capture_at is None or not len(capture_at):
            _check(self._layers(table.shape[0], table.data_ptr(), shape.data_ptr(), step.data_ptr(), eps, scale,
                                x.data_ptr(), scratch.data_ptr()), "dense layers")
            return None
        captured = torch.empty(len(capture_at), *x.shape)
        _check(self._layers_capture(table.shape[0], table.data_ptr(), shape.data_ptr(), step.data_ptr(), eps, scale,
                                    x.data_ptr(), scratch.data_ptr(), len(capture_at), capture_at.data_ptr(),
                                    captured.data_ptr()), "dense layers")
        return captured


class CpuKernels(FusedLayerKernels):
    """The loaded library's entry points, for float32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._gemm = lib.specray_small_gemm
        self._gemm.argtypes = [ptr] * 4 + [i64] * 3
        self._gemm.restype = ctypes.c_int
        self._gemm_plan = lib.specray_small_gemm_plan
        self._gemm_plan.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int] * 4
        self._gemm_plan.restype = ctypes.c_int
        self._use_plans = lib.specray_small_gemm_use_plans
        self._use_plans.argtypes = [ctypes.c_int]
        self._use_plans.restype = None
        self._panel = lib.specray_panel_gemm
        self._panel.argtypes = [ptr] * 4 + [i64] * 3
        self._panel.restype = ctypes.c_int
        self._norm = lib.specray_rms_norm
        self._norm.argtypes = [ptr] * 3 + [i64] * 2 + [f32]
        self._norm.restype = None
        self._norm_heads = lib.specray_rms_norm_heads
        self._norm_heads.argtypes = [ptr] * 2 + [i64] * 5 + [f32]
        self._norm_heads.restype = None
        self._argmax = lib.specray_argmax_rows
        self._argmax.argtypes = [ptr, i64, i64, ptr]
        self._argmax.restype = None
        self._attn = lib.specray_paged_attention
        self._attn.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 5 + [f32, ctypes.c_int, ptr]
        self._attn.restype = None
        self._attn_extra = lib.specray_paged_attention_extra
        self._attn_extra.argtypes = ([ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 5 + [f32, ctypes.c_int]
                                     + [ptr, ptr, i64, ptr])
        self._attn_extra.restype = None
        self._silu = lib.specray_silu_mul
        self._silu.argtypes = [ptr] * 2 + [i64] * 2
        self._silu.restype = None
        self._rope = lib.specray_rope_store_kv
        self._rope.argtypes = [ptr] * 4 + [i64] * 4 + [ptr] * 4 + [i64]
        self._rope.restype = None
        self._attn_block = lib.specray_attention_block
        self._attn_block.argtypes = [ptr] * 3 + [f32, f32] + [ptr] * 4
        self._attn_block.restype = ctypes.c_int
        self._mlp_block = lib.specray_mlp_block
        self._mlp_block.argtypes = [ptr] * 2 + [f32] + [ptr] * 4
        self._mlp_block.restype = ctypes.c_int
        self._eagle3_block = lib.specray_eagle3_attention_block
        self._eagle3_block.argtypes = [ptr] * 3 + [f32, f32] + [ptr] * 2 + [ctypes.c_int] + [ptr] * 2
        self._eagle3_block.restype = ctypes.c_int
        self._layers = lib.specray_dense_layers
        self._layers.argtypes = [i64] + [ptr] * 3 + [f32, f32] + [ptr] * 2
        self._layers.restype = ctypes.c_int
        self._layers_capture = lib.specray_dense_layers_capture
        self._layers_capture.argtypes = [i64] + [ptr] * 3 + [f32, f32] + [ptr] * 2 + [i64] + [ptr] * 2
        self._layers_capture.restype = ctypes.c_int
        self.max_rows = lib.specray_small_gemm_max_rows()
        self.max_head_dim = lib.specray_max_head_dim()  # paged_attention's limit
        self.quant = QuantGemv(lib)  # the GGUF block-quantized GEMV (quant_kernels.py)

    def small_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for 1..max_rows rows (contiguous float32 CPU tensors, matching
        shapes: the caller checks, as the kernel cannot)."""
        x = x.contiguous()
        rows, n = x.shape[0], weight.shape[0]
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        if self._gemm(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), rows, n, weight.shape[1]):
            raise ValueError(f"small_gemm takes 1..{self.max_rows} rows, not {rows}")
        return y

    def small_gemm_plan(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows_of_w: int,
                        prefetch: int, threads: int, halves: int = 0) -> torch.Tensor:
        """``small_gemm`` with its plan given (benchmarks and tests): ``rows_of_w`` (1, 2 or 4) rows of
        the weight per pass, ``prefetch`` 0 (none), 1 (into L1, 4 KB ahead) or 2 (into L2),
        ``threads`` (capped at torch's), ``halves`` 0, 1 (8-float FMAs) or 2 (the same, walking K
        in L1-sized chunks of x), 1 and 2 with one row of w only. Every plan gives the same bits."""
        x = x.contiguous()
        rows, n = x.shape[0], weight.shape[0]
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        rc = self._gemm_plan(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), rows, n, weight.shape[1],
                             rows_of_w, int(prefetch), threads, int(halves))
        if rc == -1:
            raise ValueError(f"small_gemm takes 1..{self.max_rows} rows, not {rows}")
        if rc:
            raise ValueError(f"small_gemm's plan takes 1, 2 or 4 rows of w, prefetch 0, 1 or 2, >= 1 threads and "
                             f"halves 0, 1 or 2 (1 and 2 with 1 row of w only), not {rows_of_w}, {int(prefetch)}, "
                             f"{threads} and {int(halves)}")
        return y

    def use_gemv_plans(self, which: str) -> None:
        """Process-wide: which plans ``small_gemm`` (the fused layers' included) runs, one of
        ``GEMV_PLANS``: "tuned" (specray's), "first" (issue 18's first version: four rows of w at
        a time at any row count, every thread) or "before verify work" (the tuned batch-1 GEMV,
        the first plan at 2+ rows). Benchmarks compare them in one process; the bits are the same."""
        if which not in GEMV_PLANS:
            raise ValueError(f"gemv plans must be one of {GEMV_PLANS}, not {which!r}")
        self._use_plans(GEMV_PLANS.index(which))

    def panel_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for any number of rows, packing the weight panel by panel."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if self._panel(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), x.shape[0], weight.shape[0],
                       weight.shape[1]):
            raise MemoryError(f"panel_gemm could not allocate its panel buffers (K = {weight.shape[1]})")
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of a contiguous float32 tensor."""
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self._norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
        return y

    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, first: int, count: int, dim: int,
                       eps: float) -> None:
        """In place: RMSNorm (``rms_norm``'s bits) of heads ``first .. first + count - 1`` of each
        row of a contiguous [rows, heads * dim] fused projection (Qwen3's q_norm / k_norm)."""
        rows = x.shape[0]
        self._norm_heads(x.data_ptr(), weight.data_ptr(), rows, x.numel() // (rows * dim), first, count, dim, eps)

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """``logits.argmax(-1).tolist()`` of a contiguous float32 [rows, n] tensor (n >= 1): the
        same indices (the first maximum; the first NaN where there is one), one pass over each row."""
        rows, n = logits.shape
        if n < 1 or logits.dtype != torch.float32 or not logits.is_contiguous():  # the C loop reads x[0] of each row
            raise ValueError(f"argmax_rows takes contiguous float32 [rows, n >= 1] logits, not {logits.dtype} "
                             f"{tuple(logits.shape)}{'' if logits.is_contiguous() else ' (not contiguous)'}")
        out = (ctypes.c_int64 * rows)()
        self._argmax(logits.data_ptr(), rows, n, out)
        return list(out)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a contiguous float32 [rows, 2 * inter] fused projection (the fused
        MLP's activation)."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        act = torch.empty(rows, inter, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), act.data_ptr(), rows, inter)
        return act

    def block_attention(self, q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_lens: torch.Tensor, q_starts: torch.Tensor,
                        extra_k: torch.Tensor, extra_v: torch.Tensor, scale: float) -> torch.Tensor:
        """``paged_attention`` without a causal mask, every query also seeing its sequence's
        ``extra_k.shape[0] // S`` keys of extra_k / extra_v ([S * n, kv_heads, dim], contiguous) after
        its ``context_lens`` pool keys: DFlash's query block attending to itself."""
        _, _, kv_heads, block_size, dim = pool.shape
        num_seqs = context_lens.shape[0]
        out = torch.empty_like(q)
        self._attn_extra(q.data_ptr(), pool.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                         context_lens.data_ptr(), query_lens.data_ptr(), q_starts.data_ptr(), num_seqs, q.shape[1],
                         kv_heads, block_size, dim, scale, 0, extra_k.data_ptr(), extra_v.data_ptr(),
                         extra_k.shape[0] // num_seqs, out.data_ptr())
        return out

    def rope_store_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                      pool: torch.Tensor | None, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k) from a contiguous fused qkv [N, (heads + 2 kv_heads) * dim]; k and v are
        stored into the contiguous pool layer at ``slots`` (no pool: nothing is stored)."""
        rows, dim = qkv.shape[0], pool.shape[4] if pool is not None else cos.shape[-1]
        q = torch.empty(rows, heads, dim, dtype=qkv.dtype)
        k = torch.empty(rows, kv_heads, dim, dtype=qkv.dtype)
        self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), None, rows, heads, kv_heads, dim, q.data_ptr(),
                   k.data_ptr(), _ptr(pool), _ptr(slots), pool.shape[3] if pool is not None else 1)
        return q, k

    def paged_attention(self, q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_lens: torch.Tensor, q_starts: torch.Tensor,
                        causal: bool, scale: float) -> torch.Tensor:
        """q: [N, heads, dim] contiguous; pool: one contiguous layer; int64 metadata tensors."""
        _, _, kv_heads, block_size, dim = pool.shape
        out = torch.empty_like(q)
        self._attn(q.data_ptr(), pool.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                   context_lens.data_ptr(), query_lens.data_ptr(), q_starts.data_ptr(), context_lens.shape[0],
                   q.shape[1], kv_heads, block_size, dim, scale, int(causal), out.data_ptr())
        return out


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
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _touch(library: Path) -> None:
    """Mark a build as in use, so no newer build prunes it (a read-only cache stays as it is)."""
    try:
        os.utime(library)
    except OSError:
        pass


def prune_stale_builds(root: Path, keep: Path, max_age_days: float = STALE_BUILD_DAYS) -> list[Path]:
    """Delete the builds under ``root`` (one directory per source version) that nothing has
    loaded for ``max_age_days``; returns what was deleted. A process that still has one
    mapped keeps its copy (unlinking does not unmap), and a later load rebuilds it."""
    cutoff = time.time() - max_age_days * 86400
    removed = []
    for build in root.iterdir():
        library = build / "libspecray_cpu.so"
        try:
            stale = build != keep and build.is_dir() and library.stat().st_mtime < cutoff
        except OSError:  # a build in progress, not a build at all, or not ours to read
            continue
        if stale:
            shutil.rmtree(build, ignore_errors=True)
            removed.append(build)
    return removed


class KernelBuildError(SpecrayError, RuntimeError):
    """A C compiler is here, but specray's CPU kernels did not build or load (the message
    carries the compiler's output)."""


def find_compiler() -> str | None:
    """The C compiler's path (``$CC``, else ``cc``), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def build_cpu_kernels(compiler: str) -> CpuKernels:
    """The kernels from ``SOURCES``, built with ``compiler`` unless this exact build is cached;
    raises ``KernelBuildError`` when the compiler cannot build or the library cannot load."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        parts = [*(p.read_text() for p in SOURCES + HEADERS), version, " ".join(FLAGS), _cpu_flags()]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        target = cache_root() / "kernels" / key[:16] / "libspecray_cpu.so"
        if not target.exists():
            _build(compiler, target)
            prune_stale_builds(target.parent.parent, keep=target.parent)
        else:
            _touch(target)
        return CpuKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:  # AttributeError: a missing symbol
        detail = getattr(e, "stderr", "") or e
        raise KernelBuildError(f"could not build specray's CPU kernels with {compiler}: {detail}") from e


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels, built if this machine has none cached; None where they cannot be had.

    A failed build is logged and serves with torch's ops (a user's job keeps running); the
    test suite builds through ``build_cpu_kernels`` instead, so there a failed build fails."""
    if os.environ.get("SPECRAY_CPU_KERNELS", "1").strip() == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler: CPU layers use torch's ops only")
        return None
    try:
        return build_cpu_kernels(compiler)
    except KernelBuildError as e:
        log.warning("%s; using torch's ops", e)
        return None


def kernels_for(*tensors: torch.Tensor) -> CpuKernels | None:
    """specray's CPU kernels when every tensor is a contiguous float32 CPU tensor, else None."""
    if all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return load_cpu_kernels()
    return None
