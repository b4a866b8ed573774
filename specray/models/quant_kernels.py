"""The GGUF block-quantized GEMV of ``csrc/quant_gemv.c``: ``x @ W.T (+ bias)`` for 1..32
float32 rows of x, with W kept in its GGUF blocks (a uint8 tensor of raw blocks, row-major,
as ``GGUFReader`` gives a tensor's data) and dequantized in registers.

The contract is bit-equality: the result is ``small_gemm``'s on ``gguf.quants.dequantize``'s
float32 weight, at every row and thread count (``tests/test_quant_gemv.py``). The model runs it
on the weights the loader keeps in their blocks (``quant_weight.py``; ``layers.linear`` and,
inside the fused decode step, ``fused_layer.c``).
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType


FAST_ROWS = 16  # quant_fast.c's output rows per group


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{n}], not {bias.dtype} {tuple(bias.shape)}")


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"GGML type {ggml_type}"


class QuantGemv:
    """The loaded library's quantized entry points (built with the other CPU kernels)."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._gemv = lib.specray_quant_gemv
        self._gemv.argtypes = [cint] + [ptr] * 4 + [i64] * 3 + [cint]
        self._gemv.restype = cint
        self._format = lib.specray_quant_format
        self._format.argtypes = [cint, ctypes.POINTER(cint), ctypes.POINTER(cint)]
        self._format.restype = cint
        self._dequantize = lib.specray_quant_dequantize
        self._dequantize.argtypes = [cint, ptr, ptr, i64, i64]
        self._dequantize.restype = cint
        self.max_rows = lib.specray_quant_max_rows()
        self._fast_gemv = lib.specray_quant_fast_gemv
        self._fast_gemv.argtypes = [cint] + [ptr] * 4 + [i64] * 3 + [cint]
        self._fast_gemv.restype = cint
        self._fast_repack = lib.specray_quant_fast_repack
        self._fast_repack.argtypes = [cint, ptr, ptr, i64, i64]
        self._fast_repack.restype = cint
        self._fast_rows = lib.specray_quant_fast_rows
        self._fast_rows.argtypes = [cint, ptr, ptr, i64, i64, ptr, i64]
        self._fast_rows.restype = cint
        self._rows = lib.specray_quant_rows
        self._rows.argtypes = [cint, ptr, ptr, i64, i64, ptr, i64]
        self._rows.restype = cint
        self.has_fast = bool(lib.specray_quant_fast_available())
        self._fast_types = frozenset(int(t) for t in GGMLQuantizationType if lib.specray_quant_fast_has_kernel(int(t)))
        self._layouts = {int(t): self._read_layout(int(t)) for t in GGMLQuantizationType}  # the C table, read once

    def _read_layout(self, ggml_type: int) -> tuple[int, int] | None:
        size, nbytes = ctypes.c_int(), ctypes.c_int()
        if self._format(ggml_type, ctypes.byref(size), ctypes.byref(nbytes)):
            return None
        return size.value, nbytes.value

    def block_layout(self, ggml_type: int) -> tuple[int, int] | None:
        """(weights per block, bytes per block) of a type the kernel takes, None for one it does not."""
        return self._layouts.get(int(ggml_type))

    def has_kernel(self, ggml_type: int) -> bool:
        return self.block_layout(ggml_type) is not None

    def gemv(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
             bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``, W of ``shape`` (out_features, in_features) held as ``blocks``.
        ``threads`` None: one thread for one row below 0.5 MiB of float32 weight (quant_gemv.c's
        QUANT_PARALLEL_MIN_BYTES), else torch's; a number is capped at torch's."""
        n, k = shape
        self._check(x, blocks, ggml_type, n, k, bias)
        x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._gemv(int(ggml_type), x.data_ptr(), blocks.data_ptr(), bias.data_ptr() if bias is not None else None,
                        y.data_ptr(), x.shape[0], n, k, 0 if threads is None else max(int(threads), 1))
        if rc:  # _check rules these out; a non-zero code here is a mismatch with the C table
            raise RuntimeError(f"specray_quant_gemv returned {rc} for {_type_name(ggml_type)} {shape}")
        return y

    def has_fast_kernel(self, ggml_type: int) -> bool:
        """Whether SPECRAY_CPU_QUANT=fast has a kernel for the type on this machine (VNNI)."""
        return int(ggml_type) in self._fast_types  # the C table, read once

    @property
    def fast_type_names(self) -> str:
        """The types with a fast kernel here, for messages: "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K"."""
        names = [_type_name(t) for t in sorted(self._fast_types)]
        return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)

    def fast_repack(self, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
        """The GGUF rows ``blocks`` in quant_fast.c's layout (16 output rows interleaved), the same
        bytes in another order; out_features must be a multiple of FAST_ROWS."""
        n, k = shape
        self._check_blocks(blocks, ggml_type, n, k)
        out = torch.empty_like(blocks)
        rc = self._fast_repack(int(ggml_type), blocks.data_ptr(), out.data_ptr(), n, k)
        if rc:
            raise ValueError(f"no fast layout for {_type_name(ggml_type)} {shape}: it takes {self.fast_type_names} "
                             f"with out_features a multiple of {FAST_ROWS} (code {rc})")
        return out

    def fast_gemv(self, x: torch.Tensor, packed: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                  bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` by quant_fast.c's int8 rule, any number of rows, W repacked by
        ``fast_repack``. Not the float32 path's bits; each row's bits do not depend on the others."""
        n, k = shape
        self._check_blocks(packed, ggml_type, n, k)
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k or not x.shape[0]:
            raise ValueError(f"x must be a float32 CPU tensor [rows >= 1, {k}], not {x.dtype} {tuple(x.shape)}")
        _check_bias(bias, n)
        x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._fast_gemv(int(ggml_type), x.data_ptr(), packed.data_ptr(),
                             bias.data_ptr() if bias is not None else None, y.data_ptr(), x.shape[0], n, k,
                             0 if threads is None else max(int(threads), 1))
        if rc == -1:
            raise MemoryError("specray_quant_fast_gemv: could not allocate its scratch")
        if rc:
            raise ValueError(f"no fast kernel for {_type_name(ggml_type)} {shape} here (code {rc})")
        return y

    def rows(self, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` of a weight in GGUF rows (an embedding lookup): gguf's values.
        ``blocks`` as a ``QuantWeight`` holds them (checked when it was built)."""
        return self._lookup(self._rows, "GGUF rows", blocks, ggml_type, shape, ids)

    def fast_rows(self, packed: torch.Tensor, ggml_type: int, shape: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` of a repacked weight: the dequantized values (an embedding lookup)."""
        return self._lookup(self._fast_rows, "fast layout", packed, ggml_type, shape, ids)

    @staticmethod
    def _lookup(entry, layout: str, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                ids: torch.Tensor) -> torch.Tensor:
        """The C lookup checks the ids (a step's one embedding row costs one call, no pass of torch
        ops over them) and writes nothing when one is out of range."""
        n, k = shape
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        rc = entry(int(ggml_type), blocks.data_ptr(), ids.data_ptr(), ids.numel(), n, out.data_ptr(), k)
        if rc == -4:
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise ValueError(f"row ids must be in [0, {n}): got {int(bad)}")
        if rc == -1:
            raise MemoryError("the row lookup could not allocate its scratch")
        if rc:
            raise ValueError(f"no {layout} lookup for {_type_name(ggml_type)} {shape} (code {rc})")
        return out

    def dequantize(self, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
        """The float32 [n, k] weight ``blocks`` hold: ``gguf.quants.dequantize``'s values, from the
        GEMV's own dequantizer, on torch's threads (prefill's panels)."""
        n, k = shape
        self._check_blocks(blocks, ggml_type, n, k)
        out = torch.empty(n, k, dtype=torch.float32)
        rc = self._dequantize(int(ggml_type), blocks.data_ptr(), out.data_ptr(), n, k)
        if rc:  # _check_blocks rules these out
            raise RuntimeError(f"specray_quant_dequantize returned {rc} for {_type_name(ggml_type)} {shape}")
        return out

    def _check(self, x, blocks, ggml_type, n, k, bias) -> None:
        self._check_blocks(blocks, ggml_type, n, k)
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be a float32 CPU tensor [rows, {k}], not {x.dtype} {tuple(x.shape)}")
        if not 1 <= x.shape[0] <= self.max_rows:
            raise ValueError(f"the quantized GEMV takes 1..{self.max_rows} rows of x, not {x.shape[0]}")
        _check_bias(bias, n)

    def _check_blocks(self, blocks, ggml_type, n, k) -> None:
        layout = self.block_layout(ggml_type)
        if layout is None:
            raise ValueError(f"no quantized CPU kernel for {_type_name(ggml_type)}")
        size, nbytes = layout
        if n < 1 or k < 1 or k % size:
            raise ValueError(f"{_type_name(ggml_type)} weight shape {(n, k)}: in_features must be a positive "
                             f"multiple of the block size {size}")
        expected = n * (k // size) * nbytes
        if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous():
            raise ValueError(f"blocks must be a contiguous uint8 CPU tensor, not {blocks.dtype} on {blocks.device}")
        if blocks.numel() != expected:
            raise ValueError(f"{_type_name(ggml_type)} weight {(n, k)} takes {expected} bytes of blocks, "
                             f"not {blocks.numel()}")
