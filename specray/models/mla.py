"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a latent pool.

Per token the layer computes (transformers' ``DeepseekV3Attention`` is the reference)::

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x)      [H, nope + rope]
    [c | k_rot]  = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)           [rank], [rope]
    q_rot, k_rot = RoPE (interleaved pairs when rope_interleave, as transformers applies it)
    kv_b_proj(c) = per head [k_nope | v]                                   [H, nope + v]

The pool stores the latent row ``[c | k_rot]`` per token (pool kind ``latent``, one "head"),
never per-head K and V. Whole prompts expand it (k = [k_nope | k_rot], v) and run SDPA as
transformers does. Decode and verify rows attend in the latent space with the absorbed
projections: with W_uk, W_uv the K and V parts of kv_b_proj (per head [nope, rank], [v, rank]),

    score = q_nope . (W_uk c) + q_rot . k_rot = [W_uk^T q_nope | q_rot] . [c | k_rot]
    out   = W_uv (sum_t p_t c_t)

so one latent row serves every head (multi-query attention over rows of rank + rope), and the
cache is read once per step however many heads there are.

Sharding (tp ranks):

| module              | split                          | reduce          |
|---------------------|--------------------------------|-----------------|
| q_a_proj, q_proj    | q_a replicated; q_proj by head | -               |
| q_b_proj, kv_b_proj | output rows by head            | -               |
| kv_a_proj_with_mqa  | replicated                     | -               |
| norms               | replicated                     | -               |
| o_proj              | input columns (heads)          | all_reduce (tp) |

Kimi Linear's full-attention layers are this MLA without positional encoding (``MLAArch.has_rope``
false): q_rot and k_rot keep their widths and pass unrotated (``no_rope``).

The latent projections and the latent cache are the same on every rank (docs/parallelism.md
says what that costs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.models.arch import ModelArch
from specray.models.attention import PAGED_ATTENTION_PAGE_SIZES, AttentionMetadata, _attend_fresh, step_plan
from specray.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, apply_rope,
                                   linear)
from specray.models.mla_arch import YarnRope

# Kernel capability of the CPU path below: it gathers whole pages by index and masks by length,
# so any power of two works (as paged_attention).
MLA_CPU_PAGE_SIZES = PAGED_ATTENTION_PAGE_SIZES
# MLA decode kernels of GPU serving stacks and the page sizes they accept: data for the geometry
# agreement (kv/page_size.py), so a rank that runs one reports it; these kernels are not built
# in specray. FlashMLA takes 64-token pages; trtllm-gen's MLA decode 32 or 64 (it rejects 128);
# CUTLASS MLA 128; the FP4 MLA path 128 only (the seed's case).
MLA_DECODE_KERNELS: dict[str, frozenset[int]] = {
    "flashmla": frozenset({64}),
    "trtllm_gen_mla": frozenset({32, 64}),
    "cutlass_mla": frozenset({128}),
    "fp4_mla": frozenset({128}),
    "mla_cpu": MLA_CPU_PAGE_SIZES,
}


def mla_kernel_rule(name: str) -> dict[str, frozenset[int]]:
    """The capability a rank reports for the named MLA decode kernel (``SPECRAY_MLA_KERNEL``)."""
    if name not in MLA_DECODE_KERNELS:
        raise ValueError(f"SPECRAY_MLA_KERNEL={name!r} is not an MLA decode kernel; known: "
                         f"{sorted(MLA_DECODE_KERNELS)}")
    return {name: MLA_DECODE_KERNELS[name]}


def yarn_inv_freq(yarn: YarnRope, dim: int, theta: float) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (transformers'
    ``_compute_yarn_parameters``, the same float32 expressions)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotary_for(arch: ModelArch, device: torch.device) -> RotaryEmbedding:
    """The model's RoPE tables: plain, or YaRN-scaled (inv_freq and cos/sin scaling)."""
    if arch.yarn is None:
        return RotaryEmbedding(arch.rope_dim, arch.rope_theta, device)
    return RotaryEmbedding(arch.rope_dim, arch.rope_theta, device,
                           inv_freq=yarn_inv_freq(arch.yarn, arch.rope_dim, arch.rope_theta),
                           attention_scaling=arch.yarn.attention_factor)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, dim] with pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the
    output is de-interleaved ([rotated evens | rotated odds]), exactly as transformers' output."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)  # as transformers casts them
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def no_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA without positional encoding (Kimi Linear, ``MLAArch.has_rope`` false): q_rot and k_rot
    pass unrotated, so the latent row stores k_rot as projected."""
    return x


class ReplicatedLinear(nn.Module):
    """A projection every rank holds whole (MLA's latent projections)."""

    def __init__(self, in_size: int, out_size: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_size, in_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load(self, reader, name: str) -> None:
        self.weight.copy_(reader.read(f"{name}.weight"))
        if self.bias is not None:
            self.bias.copy_(reader.read(f"{name}.bias"))


def write_latent(pool: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store latent rows ([N, rank + rope]) into their slots of one latent pool layer."""
    block_size = pool.shape[3]
    pool[slot_mapping // block_size, 0, 0, slot_mapping % block_size] = latent


def attend_latent(q: torch.Tensor, rows: torch.Tensor, plan, scale: float, rank: int) -> torch.Tensor:
    """Multi-query attention over latent rows: q [N, heads, rank + rope] (absorbed), rows
    [blocks, tokens_per_block, rank + rope] (one pool layer); returns [N, heads, rank], the
    probabilities times each row's c part. The pages are gathered once (the row is the key and,
    its first ``rank`` values, the value), then every head of every query is a row of one matmul."""
    num_seqs, n, heads = plan.hidden.shape[0], plan.n, q.shape[1]
    keys = rows.index_select(0, plan.index).view(num_seqs, -1, rows.shape[-1])  # [S, pages * B, rank + rope]
    if plan.padded is None:
        qp = q.view(num_seqs, n * heads, -1)
    else:
        qp = q.new_zeros(num_seqs, n, heads, q.shape[-1])
        qp[plan.padded] = q
        qp = qp.view(num_seqs, n * heads, -1)
    scores = torch.matmul(qp, keys.transpose(1, 2)).view(num_seqs, n, heads, -1)
    scores = scores.float().mul_(scale).masked_fill_(plan.hidden[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(keys.dtype).view(num_seqs, n * heads, -1)
    o = torch.matmul(probs, keys[..., :rank]).view(num_seqs, n, heads, rank)
    return o.reshape(-1, heads, rank) if plan.padded is None else o[plan.padded]


class MLAttention(nn.Module):
    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        m, tp, dev, h = arch.mla, ctx.tp, ctx.device, arch.hidden_size
        self.mla = m
        self.num_local_heads = arch.num_heads // tp.size
        heads, bias = arch.num_heads, arch.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, [heads * m.qk_head_dim], tp, False, dtype, dev)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, bias, dtype, dev)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, dtype, dev)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [heads * m.qk_head_dim], tp, False, dtype, dev)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.latent_dim, bias, dtype, dev)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, dtype, dev)  # transformers' default eps for both
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, [heads * (m.qk_nope_head_dim + m.v_head_dim)], tp,
                                              False, dtype, dev)
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, h, tp, bias, dtype, dev)
        self.rope = no_rope if not m.has_rope else apply_rope_interleaved if m.rope_interleave else apply_rope
        self.scale = m.qk_head_dim ** -0.5 * (arch.yarn.softmax_factor if arch.yarn is not None else 1.0)

    def layout(self, num_layers: int) -> KVLayout:
        """One latent row per token, the same on every rank."""
        return KVLayout(num_layers, 1, self.mla.latent_dim, kind="latent")

    def forward(self, x, cos, sin, pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m, heads = self.mla, self.num_local_heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(-1, heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_rot, k_rot = self.rope(q_rot, cos, sin), self.rope(k_rot[:, None, :], cos, sin)
        write_latent(pool, torch.cat([c, k_rot[:, 0]], dim=-1), meta.slot_mapping)
        both = pool.expand(-1, 2, -1, -1, -1)  # the latent row is the key and (its c part) the value
        plan = step_plan(meta, q, both)
        out = q.new_empty(q.shape[0], heads, m.v_head_dim)
        for s, e in plan.prompts:
            out[s:e] = self._expanded(q_nope[s:e], q_rot[s:e], c[s:e], k_rot[s:e])
        cached = plan.rows if plan.prompts else slice(None)
        if plan.rows is not None or not plan.prompts:
            out[cached] = self._absorbed(q_nope[cached], q_rot[cached], both, plan)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _expanded(self, q_nope, q_rot, c, k_rot) -> torch.Tensor:
        """A whole prompt: per-head K and V from its own latents, causal SDPA (transformers' way)."""
        m, heads = self.mla, self.num_local_heads
        k_nope, v = self.kv_b_proj(c).view(-1, heads, m.qk_nope_head_dim + m.v_head_dim).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, heads, -1)], dim=-1)
        return _attend_fresh(torch.cat([q_nope, q_rot], dim=-1), k, v, self.scale)

    def _absorbed(self, q_nope, q_rot, both: torch.Tensor, plan) -> torch.Tensor:
        """Cached rows (decode, verify): attention over the latent rows with kv_b_proj absorbed."""
        m, heads = self.mla, self.num_local_heads
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        # per-head matmuls as bmm over the head dimension (einsum spends ~30 us a call parsing at these sizes)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :m.qk_nope_head_dim]).transpose(0, 1)
        o_latent = attend_latent(torch.cat([q_latent, q_rot], dim=-1), both[:, 0, 0], plan, self.scale, m.kv_lora_rank)
        return torch.bmm(o_latent.transpose(0, 1), w[:, m.qk_nope_head_dim:].transpose(1, 2)).transpose(0, 1)

    def load(self, reader, prefix: str) -> None:
        if self.mla.q_lora_rank is None:
            self.q_proj.load(reader, [f"{prefix}.q_proj"])
        else:
            self.q_a_proj.load(reader, f"{prefix}.q_a_proj")
            self.q_a_layernorm.load(reader, f"{prefix}.q_a_layernorm.weight")
            self.q_b_proj.load(reader, [f"{prefix}.q_b_proj"])
        self.kv_a_proj_with_mqa.load(reader, f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm.load(reader, f"{prefix}.kv_a_layernorm.weight")
        self.kv_b_proj.load(reader, [f"{prefix}.kv_b_proj"])
        self.o_proj.load(reader, f"{prefix}.o_proj")
