"""Qwen3-Next's parts (``Qwen3NextForCausalLM``; transformers' ``modeling_qwen3_next`` is the
reference for the maths): gated attention, Gated DeltaNet over state slots, the zero-centred
RMSNorm and the MoE with a sigmoid-gated shared expert. ``decoder.py`` assembles them per layer
as the architecture record's ``mixers`` say.

Gated DeltaNet, per token (``gated_delta.py`` has the rule itself)::

    [q k v z] = in_proj_qkvz(x)   grouped per key head: [q_h, k_h, v of its value heads, z of them]
    [b a]     = in_proj_ba(x)     grouped per key head likewise
    q k v     = silu(causal depthwise conv1d over the last conv_kernel_size inputs of [q | k | v])
    g         = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o         = delta rule (q, k L2-normalised), then RMSNorm(o) * silu(z), out_proj

The conv window (the ``conv_kernel_size - 1`` inputs before the step's first token) and the
recurrent state live in the sequence's state row (``kv/state.py``); a sequence at position 0
starts from zeros whatever the row holds, so a row needs no clearing when it changes hands.
Prefill chunks use the chunked rule, decode rows the recurrent rule, as transformers does.

Sharding (tp ranks; the key heads, and with them their value heads, split over tp):

| module                       | split                                          | reduce          |
|------------------------------|------------------------------------------------|-----------------|
| in_proj_qkvz, in_proj_ba     | output rows by key-head group (contiguous)     | -               |
| conv1d, A_log, dt_bias       | channels / value heads of this rank's groups   | -               |
| norm (gated)                 | replicated (per value-head width)              | -               |
| out_proj                     | input columns (value heads)                    | all_reduce (tp) |
| gated attention q_proj       | heads, each with its gate (q and gate per head)| -               |
| shared_expert gate_up / down | intermediate over tp                           | the MoE's one   |
| shared_expert_gate           | replicated                                     | -               |
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.context import DistContext
from specray.models.arch import ModelArch
from specray.models.attention import AttentionMetadata, write_kv
from specray.models.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from specray.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, apply_rope, linear
from specray.models.linear_state import LayerState, LinearPlan, linear_plan, store_snapshots
from specray.models.moe import MoE

PREFILL_CHUNK_SIZE = 64  # the chunked rule's chunk, as transformers' torch_chunk_gated_delta_rule


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + w`` (the checkpoint stores w around zero). The offset is added once
    at load: ``1 + w`` in float32 is the value transformers multiplies by, so the forward is the
    plain RMSNorm's."""

    def load(self, reader, name: str) -> None:
        self.weight.copy_(reader.read(name).float().add(1.0))


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head, the rest passed through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)


def gated_attention_forward(attn, x, cos, sin, pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``Attention.forward`` for a gated layer (``attn.is_gated``): q_proj yields (q, gate) per head,
    partial RoPE, and the output is scaled by sigmoid(gate) before o_proj."""
    heads, kv_heads, dim = attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim
    n = x.shape[0]
    qg, k, v = attn.qkv(x).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, gate = qg.view(n, heads, 2 * dim).chunk(2, dim=-1)
    q = apply_partial_rope(attn.q_norm(q.contiguous()), cos, sin)
    k = apply_partial_rope(attn.k_norm(k.reshape(n, kv_heads, dim)), cos, sin)
    v = v.reshape(n, kv_heads, dim)
    write_kv(pool, k, v, meta.slot_mapping)
    o = attn.kernel(q, k, v, pool, meta, attn.scale)
    return attn.o_proj(o.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1)))


def depthwise_causal_conv(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.conv1d(inputs, weight, groups=channels) without padding: inputs ``[S, C, K - 1 + n]`` (the
    window, then n new inputs), weight ``[C, 1, K]``, out ``[S, C, n]``, as K multiply-adds of shifted
    slices. At these sizes torch's grouped conv1d costs 0.14 ms a call on one CPU thread and 18
    ms with two threads on a loaded machine (its threading overhead on a [1, 512, 4] input), the
    multiply-adds ~20 us (measured at load 4 on 2 CPUs); the sums agree with conv1d up to float32
    rounding (bitwise on the shapes tried; tests/test_qwen3_next.py holds the tokens)."""
    taps, n = weight.shape[-1], inputs.shape[-1] - weight.shape[-1] + 1
    out = inputs[..., :n] * weight[:, :, 0]
    for j in range(1, taps):
        out = out.addcmul_(inputs[..., j:j + n], weight[:, :, j])
    return out


def short_conv(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """silu(causal depthwise conv1d) of the step's rows ``mixed [N, C]``, each sequence continuing its
    window ``[C, K - 1]`` (zeros at position 0); the windows are updated in place, a verify row keeping
    the window ending at each of its positions (``linear_state.py``).
    Shared by every linear mixer (Gated DeltaNet's [q | k | v], KDA's)."""
    out = torch.empty_like(mixed)
    channels, width = mixed.shape[-1], weight.shape[-1] - 1
    for group in plan.recurrent:
        inputs = torch.cat([windows[group.rows].to(mixed.dtype), mixed[group.tokens].transpose(1, 2)], dim=-1)
        out[group.tokens] = depthwise_causal_conv(inputs, weight).transpose(1, 2)
        store_snapshots(windows, group, inputs.unfold(-1, width, 1)[:, :, 1:].transpose(1, 2))
    for s, e, row, has_state in plan.prefills:
        before = windows[row].to(mixed.dtype) if has_state else mixed.new_zeros(channels, width)
        inputs = torch.cat([before, mixed[s:e].T], dim=-1)[None]
        out[s:e] = depthwise_causal_conv(inputs, weight)[0].T
        windows[row] = inputs[0, :, -width:].float()
    return F.silu(out)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        lin, tp, dev, h = arch.linear, ctx.tp, ctx.device, arch.hidden_size
        if lin.num_k_heads % tp.size:
            raise ValueError(f"linear_num_key_heads ({lin.num_k_heads}) must be divisible by tp_size ({tp.size}): "
                             f"each rank holds whole key-head groups")
        self.lin, self.tp = lin, tp
        self.num_k_heads, self.num_v_heads = lin.num_k_heads // tp.size, lin.num_v_heads // tp.size
        self.key_dim, self.value_dim = self.num_k_heads * lin.k_head_dim, self.num_v_heads * lin.v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = ColumnParallelLinear(h, [2 * lin.key_dim + 2 * lin.value_dim], tp, False, dtype, dev)
        self.in_proj_ba = ColumnParallelLinear(h, [2 * lin.num_v_heads], tp, False, dtype, dev)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, lin.conv_kernel_size, dtype=dtype, device=dev),
                                        requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=dev), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=dev), requires_grad=False)
        self.norm = RMSNorm(lin.v_head_dim, arch.rms_norm_eps, dtype, dev)  # gated, plain w (not zero-centred)
        self.out_proj = RowParallelLinear(lin.value_dim, h, tp, False, dtype, dev)

    def forward(self, x, cos, sin, state: LayerState, meta: AttentionMetadata) -> torch.Tensor:
        lin, n = self.lin, x.shape[0]
        r, dk, dv = lin.v_per_k, lin.k_head_dim, lin.v_head_dim
        q, k, v, z = self.in_proj_qkvz(x).view(n, self.num_k_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(n, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        plan = linear_plan(meta, x.device)
        q, k, v = self._conv(mixed, state.conv, plan).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.reshape(n, self.num_v_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(n, self.num_v_heads).float() + self.dt_bias)
        core = self._delta(q.reshape(n, self.num_k_heads, dk), k.reshape(n, self.num_k_heads, dk),
                           v.reshape(n, self.num_v_heads, dv), g, beta, state.recurrent, plan)
        out = self.norm(core.reshape(-1, dv)) * F.silu(z.reshape(-1, dv).float())
        return self.out_proj(out.to(x.dtype).view(n, -1))

    def _conv(self, mixed: torch.Tensor, windows: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
        return short_conv(mixed, windows, self.conv_weight, plan)

    def _delta(self, q, k, v, g, beta, states: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
        """The delta rule per sequence from its state row (zeros at position 0); rows updated in
        place (a verify row's state after each position, ``linear_state.py``)."""
        out = torch.empty_like(v)
        for group in plan.recurrent:
            t = group.tokens
            o, after = recurrent_gated_delta_rule(q[t], k[t], v[t], g[t], beta[t], initial_state=states[group.rows],
                                                  l2_normalize_qk=True, return_all_states=True)
            out[t] = o
            store_snapshots(states, group, after)
        for s, e, row, has_state in plan.prefills:
            o, new = chunk_gated_delta_rule(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                            initial_state=states[row][None] if has_state else None,
                                            chunk_size=PREFILL_CHUNK_SIZE, l2_normalize_qk=True)
            out[s:e] = o[0]
            states[row] = new[0]
        return out

    def load(self, reader, prefix: str) -> None:
        self.in_proj_qkvz.load(reader, [f"{prefix}.in_proj_qkvz"])
        self.in_proj_ba.load(reader, [f"{prefix}.in_proj_ba"])
        lin, rank = self.lin, self.tp.rank_in_group
        # the conv's channels are [q of every head | k | v]: this rank's heads are one slice of each
        parts, offset = [], 0
        for total, local in ((lin.key_dim, self.key_dim), (lin.key_dim, self.key_dim), (lin.value_dim, self.value_dim)):
            start = offset + rank * local
            parts.append(reader.read(f"{prefix}.conv1d.weight", 0, start, start + local))
            offset += total
        self.conv_weight.copy_(torch.cat(parts))
        v0 = rank * self.num_v_heads
        self.A_log.copy_(reader.read(f"{prefix}.A_log", 0, v0, v0 + self.num_v_heads))
        self.dt_bias.copy_(reader.read(f"{prefix}.dt_bias", 0, v0, v0 + self.num_v_heads))
        self.norm.load(reader, f"{prefix}.norm.weight")
        self.out_proj.load(reader, f"{prefix}.out_proj")


class SharedExpertMoE(MoE):
    """Softmax top-k routed experts (``MoE``) plus one shared expert scaled per token by
    ``sigmoid(shared_expert_gate(x))`` (transformers' Qwen2-MoE / Qwen3-Next sparse block)."""

    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__(arch, ctx, dtype)
        h, dev, inter = arch.hidden_size, ctx.device, arch.shared_expert_intermediate_size
        self.shared_gate_up = ColumnParallelLinear(h, [inter, inter], ctx.tp, False, dtype, dev)
        self.shared_down = RowParallelLinear(inter, h, ctx.tp, False, dtype, dev)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, h, dtype=dtype, device=dev), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local_experts(x, *self.route(x))
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        # this rank's partial of the shared expert (the sigmoid is the same scalar per token on
        # every rank), summed with the routed partials by the one all_reduce
        shared = linear(F.silu(gate) * up, self.shared_down.weight, None)
        return self.tp.all_reduce(out + torch.sigmoid(linear(x, self.shared_expert_gate, None)) * shared)

    def load(self, reader, prefix: str) -> None:
        super().load(reader, prefix)
        self.shared_gate_up.load(reader, [f"{prefix}.shared_expert.gate_proj", f"{prefix}.shared_expert.up_proj"])
        self.shared_down.load(reader, f"{prefix}.shared_expert.down_proj")
        self.shared_expert_gate.copy_(reader.read(f"{prefix}.shared_expert_gate.weight"))
