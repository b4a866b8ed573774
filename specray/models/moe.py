"""Routed experts: ``MoE`` (softmax top-k: Qwen3-MoE, Mixtral) and ``DeepSeekMoE`` (sigmoid
router with a score-correction bias, group-limited top-k, routed scaling and shared experts:
DeepSeek-V3, Kimi-K2).

Sharding (tp ranks, moe_tp * moe_ep == tp):

| part                | split                                                      | reduce              |
|---------------------|------------------------------------------------------------|---------------------|
| routed experts      | contiguous expert groups over moe_ep; each expert's        | one all_reduce (tp) |
|                     | intermediate over moe_tp                                   | sums every partial  |
| shared experts      | intermediate over tp (a dense MLP)                         | the same all_reduce |
| router (gate, bias) | replicated                                                 | -                   |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.context import DistContext
from specray.models.arch import ModelArch
from specray.models.layers import ColumnParallelLinear, RowParallelLinear, linear


class MoE(nn.Module):
    """Top-k routed experts. This rank holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep), each
    split over moe_tp; partial outputs of both splits are summed by one all_reduce over tp."""

    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        ep, mtp = ctx.moe_ep, ctx.moe_tp
        self.tp = ctx.tp
        self.top_k = arch.num_experts_per_tok
        self.norm_topk = arch.norm_topk_prob
        self.names = arch.family.expert_names
        self.num_local = arch.num_experts // ep.size
        self.first_expert = ep.rank_in_group * self.num_local
        self.inter_shard = arch.moe_intermediate_size // mtp.size
        self.inter_start = mtp.rank_in_group * self.inter_shard
        h, dev = arch.hidden_size, ctx.device
        self.gate = nn.Parameter(torch.empty(arch.num_experts, h, dtype=dtype, device=dev), requires_grad=False)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_shard, h, dtype=dtype, device=dev),
                                      requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(self.num_local, h, self.inter_shard, dtype=dtype, device=dev),
                                   requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [N, top_k]. Routing as transformers does it: softmax in
        float32, top-k, optional renormalisation."""
        probs = F.softmax(F.linear(x, self.gate), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.local_experts(x, *self.route(x)))

    def local_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's part of the routed experts' weighted sum (before the all_reduce)."""
        out = torch.zeros_like(x)
        local = experts - self.first_expert
        for e in torch.unique(local[(local >= 0) & (local < self.num_local)]).tolist():
            token, slot = torch.nonzero(local == e, as_tuple=True)
            gate, up = F.linear(x[token], self.w_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w_down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def load(self, reader, prefix: str) -> None:
        self.gate.copy_(reader.read(f"{prefix}.gate.weight"))
        g, u, d = self.names
        lo, hi = self.inter_start, self.inter_start + self.inter_shard
        for i in range(self.num_local):
            p = f"{prefix}.experts.{self.first_expert + i}"
            self.w_gate_up[i, : self.inter_shard].copy_(reader.read(f"{p}.{g}.weight", 0, lo, hi))
            self.w_gate_up[i, self.inter_shard:].copy_(reader.read(f"{p}.{u}.weight", 0, lo, hi))
            self.w_down[i].copy_(reader.read(f"{p}.{d}.weight", 1, lo, hi))


def grouped_topk(scores: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                 top_k: int) -> torch.Tensor:
    """DeepSeek-V3's choice of experts, [N, top_k]: the bias shifts the choice (not the weights);
    each of ``n_group`` equal groups is scored by the sum of its top-2 choice scores, the best
    ``topk_group`` groups are kept, and the top_k experts are chosen from those."""
    choice = scores + bias
    if topk_group == n_group:  # every group kept (Kimi-K2: one group): the mask would change nothing
        return torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    n, num_experts = choice.shape
    group_scores = choice.view(n, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1], 1)
    allowed = kept[:, :, None].expand(n, n_group, num_experts // n_group).reshape(n, num_experts).bool()
    return torch.topk(choice.masked_fill(~allowed, float("-inf")), top_k, dim=-1, sorted=False)[1]


class DeepSeekMoE(MoE):
    """Routed experts plus shared experts, routed by DeepSeek-V3's sigmoid router in float32."""

    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype):
        super().__init__(arch, ctx, dtype)
        r, h, dev = arch.router, arch.hidden_size, ctx.device
        self.router = r
        # float32 whatever the model's dtype, as transformers keeps gate.weight and the bias
        self.gate = nn.Parameter(torch.empty(arch.num_experts, h, dtype=torch.float32, device=dev), requires_grad=False)
        self.score_bias = nn.Parameter(torch.zeros(arch.num_experts, dtype=torch.float32, device=dev),
                                       requires_grad=False)
        self.shared_gate_up = self.shared_down = None
        if r.num_shared_experts:
            inter = arch.moe_intermediate_size * r.num_shared_experts
            self.shared_gate_up = ColumnParallelLinear(h, [inter, inter], ctx.tp, False, dtype, dev)
            self.shared_down = RowParallelLinear(inter, h, ctx.tp, False, dtype, dev)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights from the unbiased sigmoid scores of the chosen experts, renormalised when
        norm_topk_prob, times routed_scaling_factor (transformers' DeepseekV3TopkRouter)."""
        r = self.router
        scores = F.linear(x.float(), self.gate).sigmoid()
        experts = grouped_topk(scores, self.score_bias, r.n_group, r.topk_group, self.top_k)
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * r.routed_scaling_factor).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local_experts(x, *self.route(x))
        if self.shared_gate_up is not None:
            # this rank's partial of the shared experts' down projection, summed by the one
            # all_reduce below with the routed experts' partials (so not shared_down's own reduce)
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + linear(F.silu(gate) * up, self.shared_down.weight, None)
        return self.tp.all_reduce(out)

    def load(self, reader, prefix: str) -> None:
        super().load(reader, prefix)
        self.gate.copy_(reader.read_exact(f"{prefix}.gate.weight").float())
        bias = f"{prefix}.gate.e_score_correction_bias"
        if reader.has(bias):
            self.score_bias.copy_(reader.read_exact(bias).float())
        if self.shared_gate_up is not None:
            self.shared_gate_up.load(reader, [f"{prefix}.shared_experts.gate_proj", f"{prefix}.shared_experts.up_proj"])
            self.shared_down.load(reader, f"{prefix}.shared_experts.down_proj")
