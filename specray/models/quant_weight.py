"""A weight kept in its GGUF blocks on a CPU rank, and the rule for when the loader keeps one.

``QuantWeight`` is what a linear layer, the embedding and the LM head hold instead of a float32
copy: the raw blocks of its rows (a uint8 tensor, one row of the weight per row of bytes, as
``gguf.GGUFReader`` lays a tensor out), the GGML type and the (out_features, in_features)
shape. The maths stays the float32 model's: ``linear`` runs the block GEMV of
``quant_kernels.py`` (bitwise equal to ``small_gemm`` on the dequantized weight) at 1-32 rows
and dequantizes a panel of rows at a time into the float32 kernels beyond; an embedding row is
dequantized on lookup. Both dequantize with the GEMV's own code, which gives the values of the
gguf package's dequantizer (the one the float32 path loads with; ``dequantize`` and ``rows``
below call that one, for ranks without the kernels).

Sharding works on whole rows and whole blocks, so it never splits a block:

| weight kind              | shard                                                | needs                   |
|--------------------------|------------------------------------------------------|-------------------------|
| column-parallel (q/k/v,  | rows of blocks (q/k rows un-permuted per head first) | -                       |
| gate/up, embedding, head)| fused parts: rows of each part concatenated (parts   | -                       |
|                          | of different types: FusedQuantWeight, side by side)  |                         |
| row-parallel (o, down)   | the same whole blocks of K of every row              | K / tp % block size == 0|

``SPECRAY_CPU_QUANT`` picks the mode: unset or ``exact`` keeps the blocks, ``0`` dequantizes
at load as before. A type without a kernel, or a shard that would split blocks, is loaded as
float32 with one log line saying why. ``fast`` keeps them too, then repacks the Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights for ``quant_fast.c`` (int8 activations, VNNI: not the float32
path's bits; see ``to_fast_layout``); other types, and weights whose rows are not whole groups
of 16, run the exact kernels, with one log line per reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

from specray.models import cpu_kernels
from specray.models.quant_kernels import FAST_ROWS

log = logging.getLogger(__name__)

QUANT_MODES = ("exact", "fast", "0")
QUANT_FAST_BIT = 1 << 16  # quant_gemv.c's mark on a repacked weight's type
# every kernel format works on 32 weights at a time (quant_gemv.c's BLOCK_SIZE): GGUF's blocks of
# 32, and BF16's single weights 32 at a time, so a BF16 weight whose in_features (or shard) is not
# a multiple of 32 stays float32
KERNEL_BLOCK_WEIGHTS = 32


def quant_mode() -> str:
    """``SPECRAY_CPU_QUANT``: "exact" (the default: keep GGUF blocks on CPU ranks), "fast" (keep
    them, int8 activations where a kernel exists) or "0" (dequantize at load)."""
    mode = os.environ.get("SPECRAY_CPU_QUANT", "exact").strip() or "exact"
    if mode not in QUANT_MODES:
        raise ValueError(f"SPECRAY_CPU_QUANT must be one of {QUANT_MODES} (unset means exact), not {mode!r}")
    return mode


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QuantWeight:
    blocks: torch.Tensor  # uint8 [out_features, bytes per row], contiguous, on the CPU
    ggml_type: int
    shape: tuple[int, int]  # (out_features, in_features), as the float32 weight would be
    # the same bytes in quant_fast.c's order (16 rows interleaved, block by block): a row of
    # ``blocks`` is then no longer one output row, so slicing goes through the kernels
    is_fast: bool = False

    def __post_init__(self):
        name = GGMLQuantizationType(self.ggml_type).name
        size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        n, k = self.shape
        if k % size:
            raise ValueError(f"{name} weight {self.shape}: in_features must be a multiple of the block size {size}")
        expected = (n, k // size * nbytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected or not self.blocks.is_contiguous():
            raise ValueError(f"{name} weight {self.shape} takes contiguous uint8 blocks of shape {expected}, "
                             f"not {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def kernel_type(self) -> int:
        """The type quant_gemv.c (and the fused layers) take: the GGML type, marked when repacked."""
        return self.ggml_type | QUANT_FAST_BIT if self.is_fast else self.ggml_type

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """float32 rows [start, end) of the weight, as the float32 path loads them."""
        if self.is_fast:
            return self.rows(torch.arange(start, self.shape[0] if end is None else end))
        return _dequantize(self.blocks[start:end], self.ggml_type)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` (an embedding lookup), [len(ids), in_features]."""
        kernels = cpu_kernels.load_cpu_kernels()  # fast weights are only built where the kernels are
        if self.is_fast:
            return kernels.quant.fast_rows(self.blocks, self.ggml_type, self.shape, ids)
        if kernels is not None and kernels.quant.has_kernel(self.ggml_type):  # one call, gguf's values
            return kernels.quant.rows(self.blocks, self.ggml_type, self.shape, ids)
        return _dequantize(self.blocks[ids.reshape(-1)], self.ggml_type)


def _dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    values = quants.dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FusedQuantWeight:
    """Fused projections whose parts have different types (llama.cpp's mixes quantize v, or up,
    apart): each part keeps its own blocks; the output is the parts' outputs side by side."""
    parts: tuple[QuantWeight, ...]

    def __post_init__(self):
        if len(self.parts) < 2 or len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(f"a fused weight takes 2 or more parts of one in_features, not "
                             f"{[p.shape for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def fused_rows(parts: list[QuantWeight]) -> QuantWeight | FusedQuantWeight:
    """Fused projections (q/k/v, gate/up): one QuantWeight where the parts share a type, else
    the parts side by side."""
    if len({p.ggml_type for p in parts}) == 1:
        return concat_rows(parts)
    return FusedQuantWeight(parts=tuple(parts))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Fused projections (q/k/v, gate/up): the parts' rows one after another, one type for all."""
    types = {p.ggml_type for p in parts}
    widths = {p.shape[1] for p in parts}
    if len(types) != 1 or len(widths) != 1:
        raise ValueError(f"fused parts must share one type and in_features, not {[p.type_name for p in parts]} "
                         f"and {sorted(widths)}")
    blocks = torch.cat([p.blocks for p in parts]) if len(parts) > 1 else parts[0].blocks
    return QuantWeight(blocks=blocks, ggml_type=parts[0].ggml_type,
                       shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]))


def padded_rows(weight: QuantWeight, rows: int) -> QuantWeight:
    """``weight`` with zero blocks appended up to ``rows`` rows (a vocab shard's padding: zero
    bytes are d = 0 in every legacy format, so the rows are zero, as the float32 padding is)."""
    missing = rows - weight.shape[0]
    if missing <= 0:
        return weight
    pad = torch.zeros(missing, weight.blocks.shape[1], dtype=torch.uint8)
    return QuantWeight(blocks=torch.cat([weight.blocks, pad]), ggml_type=weight.ggml_type,
                       shape=(rows, weight.shape[1]))


def set_weight(module: nn.Module, weight: torch.Tensor | QuantWeight) -> None:
    """Replace ``module.weight`` (a Parameter) with a QuantWeight, or back; the float32
    parameter allocated at construction is freed."""
    if "weight" in module._parameters:
        del module.weight
    if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter):
        weight = nn.Parameter(weight, requires_grad=False)
    module.weight = weight


def quantized_weights(model: nn.Module) -> list[QuantWeight]:
    """Every QuantWeight the model's modules hold, each once (a tied head shares the embedding's)."""
    seen: dict[int, QuantWeight] = {}
    for module in model.modules():
        for value in vars(module).values():
            for weight in value.parts if isinstance(value, FusedQuantWeight) else (value,):
                if isinstance(weight, QuantWeight):
                    seen[id(weight)] = weight
    return list(seen.values())


def kernel_types(dtype: torch.dtype, device: torch.device) -> frozenset[int]:
    """The GGML types whose blocks a rank loading in ``dtype`` on ``device`` keeps: those the
    quantized CPU kernels take, on float32 CPU ranks in the exact mode; none elsewhere (GPUs,
    other dtypes, ``SPECRAY_CPU_QUANT=0``, no kernels built: every tensor dequantized at load)."""
    if quant_mode() == "0" or torch.device(device).type != "cpu" or dtype != torch.float32:
        return frozenset()
    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        return frozenset()
    return frozenset(int(t) for t in GGMLQuantizationType if kernels.quant.has_kernel(int(t)))



def to_fast_layout(model: nn.Module) -> None:
    """SPECRAY_CPU_QUANT=fast: every QuantWeight of ``model`` that has a fast kernel repacked in
    place (a tied head stays the embedding's one object); the others keep the exact kernels, with
    one log line per type or reason. Weight memory does not change: the same bytes, reordered."""
    kernels = cpu_kernels.load_cpu_kernels()
    repacked: dict[int, QuantWeight] = {}
    skipped: dict[str, int] = {}
    def fast(weight: QuantWeight) -> QuantWeight:
        if weight.is_fast:
            return weight
        if id(weight) not in repacked:
            reason = _fast_refusal(kernels, weight)
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                repacked[id(weight)] = weight
            else:
                packed = kernels.quant.fast_repack(weight.blocks, weight.ggml_type, weight.shape)
                repacked[id(weight)] = dataclasses.replace(weight, blocks=packed, is_fast=True)
        return repacked[id(weight)]

    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, QuantWeight):
                setattr(module, key, fast(value))
            elif isinstance(value, FusedQuantWeight):
                setattr(module, key, FusedQuantWeight(parts=tuple(map(fast, value.parts))))
    for reason, count in skipped.items():
        log.info("SPECRAY_CPU_QUANT=fast: %d weights run the exact kernels: %s", count, reason)


def _fast_refusal(kernels, weight: QuantWeight) -> str | None:
    """Why ``weight`` cannot take the fast kernel, or None."""
    if kernels is None or not kernels.quant.has_fast:
        return "this CPU has no AVX-512 VNNI (or the kernels are not built)"
    if not kernels.quant.has_fast_kernel(weight.ggml_type):
        return f"the fast kernels take {kernels.quant.fast_type_names}, not {weight.type_name}"
    if weight.shape[0] % FAST_ROWS:
        return f"out_features is not a multiple of {FAST_ROWS} (the fast layout's rows per group)"
    return None
