"""Parallel building blocks. Each layer owns its shard: its weight loader and shard
arithmetic sit next to ``forward``, and the collective it needs is a visible call there.

Sharding (tp = size of the group passed in, r = this rank's index in it):

| layer                        | weight shard                       | forward collective        |
|------------------------------|------------------------------------|---------------------------|
| ColumnParallelLinear         | rows [r*out/tp, (r+1)*out/tp)      | none                      |
| MergedColumnParallelLinear   | each merged part split by rows     | none                      |
| QKVParallelLinear            | q heads split; kv heads split or replicated | none             |
| RowParallelLinear            | columns [r*in/tp, (r+1)*in/tp)     | all_reduce of the output  |
| VocabParallelEmbedding       | vocab rows, padded to tp * shard   | all_reduce                |
| ParallelLMHead               | vocab rows, padded                 | all_gather of the logits  |

Weights are read shard by shard from the checkpoint (``reader.read(name, dim, start, end)``),
so no rank materialises the full weight of a sharded layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.group import Group
from specray.models.cpu_kernels import kernels_for
from specray.models.quant_weight import FusedQuantWeight, QuantWeight, fused_rows, padded_rows, set_weight

PANEL_ROWS = 2048  # a QuantWeight's output rows dequantized at a time past the GEMV's rows (prefill)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# CPU linears keep one copy of each weight, as the checkpoint lays it out ([out, in]; no
# packed second copy), and pick a kernel by row count when specray's kernels serve:
# - up to SMALL_GEMM_MAX_ROWS rows (the batch-1 GEMV, batched decode, k + 1 verify rows):
#   cpu_kernels.small_gemm, which streams the weight once, at one row faster than BLAS's
#   GEMV on every measured shape (docs/cpu-kernels.md), so no shape is routed to BLAS; a
#   verify step's rows and a decode step's row then take the same kernel and the same bits;
# - more rows (prefill, wide verify batches): cpu_kernels.panel_gemm, which packs panels of
#   the weight into a per-thread buffer as it goes. BLAS repacks the whole weight on every
#   call, which is why a oneDNN-packed copy used to be kept (docs/cpu-kernels.md).
# Without the kernels (other dtypes, no compiler) torch's F.linear serves every shape.
# A weight kept in its GGUF blocks (quant_weight.py) takes the same route with the same bits:
# the block GEMV (small_gemm's sums on blocks dequantized in registers) at small_gemm's rows,
# and beyond them this function on PANEL_ROWS rows of the weight dequantized at a time.


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight | FusedQuantWeight,
           bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantWeight):
        return _quant_linear(x, weight, bias)
    if isinstance(weight, FusedQuantWeight):  # parts of different types, side by side
        outs, start = [], 0
        for part in weight.parts:
            end = start + part.shape[0]
            outs.append(_quant_linear(x, part, None if bias is None else bias[start:end]))
            start = end
        return torch.cat(outs, dim=-1)
    kernels = kernels_for(x, weight) if x.dim() == 2 else None
    if kernels is not None and x.shape[1] == weight.shape[1] and x.shape[0] >= 1:
        if bias is None or kernels_for(bias) is not None:
            if x.shape[0] <= kernels.max_rows:
                return kernels.small_gemm(x, weight, bias)
            return kernels.panel_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def _quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    kernels = kernels_for(rows)
    if weight.is_fast:  # SPECRAY_CPU_QUANT=fast: int8 activations at every row count (quant_fast.c)
        y = (kernels.quant.fast_gemv(rows, weight.blocks, weight.ggml_type, weight.shape, bias) if rows.shape[0]
             else rows.new_empty(0, weight.shape[0]))
    elif kernels is not None and 1 <= rows.shape[0] <= kernels.max_rows:
        y = kernels.quant.gemv(rows, weight.blocks, weight.ggml_type, weight.shape, bias)
    else:
        n, k = weight.shape
        y = torch.empty(rows.shape[0], n, dtype=rows.dtype)
        for start in range(0, n, PANEL_ROWS):
            end = min(start + PANEL_ROWS, n)
            if kernels is not None:  # the GEMV's dequantizer: gguf.quants.dequantize's values, ~50x faster
                panel = kernels.quant.dequantize(weight.blocks[start:end], weight.ggml_type, (end - start, k))
            else:
                panel = weight.dequantize(start, end)
            y[:, start:end] = linear(rows, panel, None if bias is None else bias[start:end])
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _read_rows(reader, parts: list[tuple[str, int, int]]) -> QuantWeight | FusedQuantWeight | None:
    """The fused rows [start, start + size) of each (name, start, size) part in GGUF blocks (one
    weight where the parts share a type; llama.cpp's mixes quantize v, or up, apart: then each
    part in its own), or None where the reader has no blocks for one of them."""
    read_blocks = getattr(reader, "read_blocks", None)
    if read_blocks is None:
        return None
    blocks = [read_blocks(f"{name}.weight", 0, start, start + size) for name, start, size in parts]
    if any(b is None for b in blocks):
        return None
    return fused_rows(blocks)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _empty(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is not None:  # one fused call instead of seven ops
            return kernels.rms_norm(x, self.weight, self.eps)
        # Computed in float32 and cast back, as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def load(self, reader, name: str) -> None:
        self.weight.copy_(reader.read(name))


class RotaryEmbedding:
    """cos/sin of the default RoPE, as [N, head_dim] rows for the given positions.

    The tables are computed once for positions [0, size) and doubled when a later position
    needs more, so a step only indexes them. Each entry is the float32 expression
    transformers evaluates per step (position * inv_freq, then cos and sin)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, size: int = 1024,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0):
        """``inv_freq`` and ``attention_scaling`` (what cos and sin are multiplied by) for scaled
        RoPE such as YaRN (mla.py); by default the plain frequencies and no scaling."""
        if inv_freq is None:
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
            inv_freq = 1.0 / (theta ** exponent)
        self.inv_freq = inv_freq.to(device)
        self.attention_scaling = attention_scaling
        self.cos = self.sin = torch.empty(0, head_dim, device=device)
        self._grow(size)

    def _grow(self, size: int) -> None:
        freqs = torch.arange(size, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            self.cos, self.sin = self.cos * self.attention_scaling, self.sin * self.attention_scaling

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``end``: one past the largest position, which callers know from their metadata (so
        no device value is read back on the hot path)."""
        cos, sin = self.tables(end)
        return cos[positions], sin[positions]

    def tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables, [size, head_dim] with size >= ``end`` (a kernel that
        reads a row per position itself)."""
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0]))
        return self.cos, self.sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; the rotate-half convention of Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over the group; output stays sharded."""

    def __init__(self, in_size: int, out_sizes: list[int], group: Group, bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        for size in out_sizes:
            if size % group.size:
                raise ValueError(f"output size {size} must be divisible by the tp group size {group.size}")
        self.group = group
        self.out_sizes = [s // group.size for s in out_sizes]
        self.weight = _empty(sum(self.out_sizes), in_size, dtype=dtype, device=device)
        self.bias = _empty(sum(self.out_sizes), dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load(self, reader, names: list[str]) -> None:
        """One checkpoint tensor per merged part, each split by rows."""
        r = self.group.rank_in_group
        self.load_rows(reader, [(name, r * shard, shard) for name, shard in zip(names, self.out_sizes)])

    def load_rows(self, reader, parts: list[tuple[str, int, int]]) -> None:
        """Rows [start, start + size) of each (name, start, size) part, one after another: in
        GGUF blocks where the reader keeps them for every part in one type, else in float32."""
        quantized = _read_rows(reader, parts)
        if quantized is not None:
            set_weight(self, quantized)
        offset = 0
        for name, start, size in parts:
            if quantized is None:
                self.weight[offset:offset + size].copy_(reader.read(f"{name}.weight", 0, start, start + size))
            if self.bias is not None:
                self.bias[offset:offset + size].copy_(reader.read(f"{name}.bias", 0, start, start + size))
            offset += size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. kv heads are split when there are at least as many as
    ranks, otherwise replicated: rank r uses kv head r * num_kv_heads // tp."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, group: Group,
                 bias: bool, dtype: torch.dtype, device: torch.device):
        tp = group.size
        self.num_local_kv_heads = max(num_kv_heads // tp, 1)
        kv_out = self.num_local_kv_heads * head_dim * tp
        super().__init__(hidden, [num_heads * head_dim, kv_out, kv_out], group, bias, dtype, device)
        self.head_dim = head_dim
        self.kv_start = (group.rank_in_group * num_kv_heads // tp) * head_dim

    def load(self, reader, names: list[str]) -> None:
        q, k, v = self.out_sizes
        r = self.group.rank_in_group
        self.load_rows(reader, [(names[0], r * q, q), (names[1], self.kv_start, k), (names[2], self.kv_start, v)])


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b: W's input columns are split over the group."""

    def __init__(self, in_size: int, out_size: int, group: Group, bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        if in_size % group.size:
            raise ValueError(f"input size {in_size} must be divisible by the tp group size {group.size}")
        self.group = group
        self.in_shard = in_size // group.size
        self.weight = _empty(out_size, self.in_shard, dtype=dtype, device=device)
        self.bias = _empty(out_size, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(linear(x, self.weight, None))
        return y + self.bias if self.bias is not None else y

    def load(self, reader, name: str) -> None:
        start = self.group.rank_in_group * self.in_shard
        read_blocks = getattr(reader, "read_blocks", None)  # whole blocks of K, where the shard splits none
        quantized = read_blocks(f"{name}.weight", 1, start, start + self.in_shard) if read_blocks else None
        if quantized is not None:
            set_weight(self, quantized)
        else:
            self.weight.copy_(reader.read(f"{name}.weight", 1, start, start + self.in_shard))
        if self.bias is not None:
            self.bias.copy_(reader.read(f"{name}.bias"))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the group in contiguous ranges (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, group: Group, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // group.size)
        self.start = group.rank_in_group * self.shard
        self.end = min(self.start + self.shard, vocab_size)
        self.weight = _empty(self.shard, hidden, dtype=dtype, device=device)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, QuantWeight):
            return F.embedding(ids, weight)
        return weight.rows(ids).reshape(*ids.shape, weight.shape[1])  # only the rows looked up are dequantized

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(out)

    def load(self, reader, name: str) -> None:
        quantized = _read_rows(reader, [(name, self.start, self.end - self.start)])
        if quantized is not None:  # the padding rows are zero blocks, as they are zeros in float32
            set_weight(self, padded_rows(quantized, self.shard))
            return
        self.weight.zero_()
        self.weight[: self.end - self.start].copy_(reader.read(f"{name}.weight", 0, self.start, self.end))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the local vocab shard, gathered so every rank holds the full row."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None)
        return self.group.all_gather(logits, dim=-1)[:, : self.vocab_size]
