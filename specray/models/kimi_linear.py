"""Kimi Linear's KDA mixer (``KimiLinearForCausalLM``'s linear-attention layers; transformers'
``modeling_kimi_linear`` is the reference for the maths). Its full-attention layers are MLA without
RoPE (``mla.py``, ``MLAArch.has_rope``) and its MoE is DeepSeek's (``moe.py``); ``decoder.py``
assembles the layers as the architecture record's ``mixers`` say (``"kda"``).

KDA, per token (``kda.py`` has the rule itself)::

    q, k, v = silu(short causal depthwise conv of q_proj(x), k_proj(x), v_proj(x)), one conv each
    g       = -exp(A_log[head]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)     per channel
    beta    = sigmoid(b_proj(x))                                                per head
    o       = KDA rule (q, k L2-normalised), then RMSNorm(o) * w * sigmoid(g_b_proj(g_a_proj(x))), o_proj

The three convs' windows are one conv window of channels ``[q | k | v]`` in the sequence's state
row (``kv/state.py``), so the state pool has Gated DeltaNet's layout: conv_dim = 3 x heads x
head_dim, the recurrent state ``[heads, head_dim, head_dim]``. The steps are planned by
``linear_state.py`` exactly as Gated DeltaNet's: decode and verify rows through the recurrent rule
(a verify row keeping the state after each position for the commit), prefill chunks through the
chunked rule; a sequence at position 0 starts from zeros whatever its row holds.

Sharding (tp ranks; heads split over tp, contiguous):

| module                        | split                                       | reduce          |
|-------------------------------|---------------------------------------------|-----------------|
| q_proj, k_proj, v_proj        | output rows by head                         | -               |
| q/k/v_conv1d                  | channels of this rank's heads               | -               |
| f_a_proj, g_a_proj            | replicated (low-rank, head_dim wide)        | -               |
| f_b_proj, g_b_proj, dt_bias   | output rows / channels by head              | -               |
| A_log, b_proj                 | by head                                     | -               |
| o_norm                        | replicated (per head_dim)                   | -               |
| o_proj                        | input columns (heads)                       | all_reduce (tp) |
"""

from __future__ import annotations

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.models.arch import ModelArch
from specray.models.attention import AttentionMetadata
from specray.models.kda import chunk_kda, recurrent_kda
from specray.models.layers import ColumnParallelLinear, RowParallelLinear
from specray.models.linear_state import LayerState, LinearPlan, linear_plan, store_snapshots
from specray.models.mla import ReplicatedLinear
from specray.models.qwen3_next import PREFILL_CHUNK_SIZE, short_conv

SOFTPLUS_LINEAR_ABOVE = 20.0  # softplus(x) is x above this, as transformers' forget gate takes it


def kda_step(q, k, v, g, beta, states: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """The KDA rule per sequence from its state row (zeros at position 0); rows updated in place
    (a verify row's state after each position, ``linear_state.py``)."""
    out = torch.empty_like(v)
    for group in plan.recurrent:
        t = group.tokens
        o, after = recurrent_kda(q[t], k[t], v[t], g[t], beta[t], initial_state=states[group.rows],
                                 return_all_states=True)
        out[t] = o
        store_snapshots(states, group, after)
    for s, e, row, has_state in plan.prefills:
        o, new = chunk_kda(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                           initial_state=states[row][None] if has_state else None, chunk_size=PREFILL_CHUNK_SIZE)
        out[s:e] = o[0]
        states[row] = new[0]
    return out


class KimiDeltaAttention(nn.Module):
    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        lin, tp, dev, h = arch.linear, ctx.tp, ctx.device, arch.hidden_size
        if lin.num_k_heads % tp.size:
            raise ValueError(f"KDA heads (linear_num_heads {lin.num_k_heads}) must be divisible by tp_size "
                             f"({tp.size}): each rank holds whole heads")
        self.lin, self.tp, self.eps = lin, tp, arch.rms_norm_eps
        self.num_heads = self.num_v_heads = lin.num_k_heads // tp.size  # num_v_heads: what StateLayout reads
        self.head_dim = lin.k_head_dim
        width = self.num_heads * self.head_dim
        self.conv_dim = 3 * width
        full = lin.key_dim
        self.qkv = ColumnParallelLinear(h, [full, full, full], tp, False, dtype, dev)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, lin.conv_kernel_size, dtype=dtype, device=dev),
                                        requires_grad=False)
        self.f_a_proj = ReplicatedLinear(h, self.head_dim, False, dtype, dev)
        self.f_b_proj = ColumnParallelLinear(self.head_dim, [full], tp, False, dtype, dev)
        # float32 whatever the model's dtype, as transformers keeps dt_bias
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32, device=dev), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=dev), requires_grad=False)
        self.b_proj = ColumnParallelLinear(h, [lin.num_k_heads], tp, False, dtype, dev)
        self.g_a_proj = ReplicatedLinear(h, self.head_dim, False, dtype, dev)
        self.g_b_proj = ColumnParallelLinear(self.head_dim, [full], tp, False, dtype, dev)
        self.o_norm_weight = nn.Parameter(torch.empty(self.head_dim, dtype=dtype, device=dev), requires_grad=False)
        self.o_proj = RowParallelLinear(full, h, tp, False, dtype, dev)

    def forward(self, x, cos, sin, state: LayerState, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, dim = x.shape[0], self.num_heads, self.head_dim
        plan = linear_plan(meta, x.device)
        q, k, v = short_conv(self.qkv(x), state.conv, self.conv_weight, plan).view(n, 3, heads, dim).unbind(1)
        core = kda_step(q, k, v, self.decay(x), torch.sigmoid(self.b_proj(x)), state.recurrent, plan)
        return self.o_proj(self.gated_norm(core, self.g_b_proj(self.g_a_proj(x))).to(x.dtype).view(n, -1))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay g ``[N, heads, head_dim]``, float32."""
        a = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(x.shape[0], self.num_heads, self.head_dim)
        # log(1 + exp(a)) as transformers writes it (not log1p), linear above the threshold
        softplus = torch.where(a > SOFTPLUS_LINEAR_ABOVE, a, torch.log(1.0 + torch.exp(a)))
        return -self.A_log.float().exp()[:, None] * softplus

    def gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head, times its weight and sigmoid(gate), all in float32 (transformers'
        KimiLinearRMSNormGated keeps the weight and the gate in float32 too)."""
        h = core.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.o_norm_weight.float() * h * torch.sigmoid(gate.view_as(h).float())

    def load(self, reader, prefix: str) -> None:
        self.qkv.load(reader, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        local, rank = self.num_heads * self.head_dim, self.tp.rank_in_group
        lo, hi = rank * local, (rank + 1) * local
        self.conv_weight.copy_(torch.cat([reader.read(f"{prefix}.{part}_conv1d.weight", 0, lo, hi)
                                          for part in ("q", "k", "v")]))
        self.f_a_proj.load(reader, f"{prefix}.f_a_proj")
        self.f_b_proj.load(reader, [f"{prefix}.f_b_proj"])
        self.dt_bias.copy_(reader.read_exact(f"{prefix}.dt_bias").float()[lo:hi])
        h0 = rank * self.num_heads  # A_log is stored [1, 1, heads, 1]
        self.A_log.copy_(reader.read(f"{prefix}.A_log").reshape(-1)[h0:h0 + self.num_heads])
        self.b_proj.load(reader, [f"{prefix}.b_proj"])
        self.g_a_proj.load(reader, f"{prefix}.g_a_proj")
        self.g_b_proj.load(reader, [f"{prefix}.g_b_proj"])
        self.o_norm_weight.copy_(reader.read(f"{prefix}.o_norm.weight"))
        self.o_proj.load(reader, f"{prefix}.o_proj")
