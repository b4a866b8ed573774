"""The drafters' decoder layer for training: plain torch with autograd (the serving layers
in models/ run under no_grad with fused kernels and sharded weights). Module names are
Hugging Face's, so ``state_dict()`` keys are the published formats' tensor names.

Attention takes explicit key/value lists and a visibility mask, because the two training
objectives attend in shapes no causal kernel covers: EAGLE-3's unroll adds one diagonal key
per earlier unroll step, DFlash's blocks see a context prefix plus their own block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.arch import ModelArch
from specray.models.layers import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def linear(in_size: int, out_size: int, std: float = 0.02) -> nn.Linear:
    layer = nn.Linear(in_size, out_size, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class SelfAttention(nn.Module):
    def __init__(self, arch: ModelArch, in_size: int, has_qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_proj = linear(in_size, arch.num_heads * arch.head_dim)
        self.k_proj = linear(in_size, arch.num_kv_heads * arch.head_dim)
        self.v_proj = linear(in_size, arch.num_kv_heads * arch.head_dim)
        self.o_proj = linear(arch.num_heads * arch.head_dim, arch.hidden_size)
        if has_qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.has_qk_norm = has_qk_norm

    def queries(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        return apply_rope(self.q_norm(q) if self.has_qk_norm else q, cos, sin)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(k) if self.has_qk_norm else k, cos, sin)
        return k, self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               extra: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """q [N, heads, d] over keys k, v [M, kv_heads, d] where ``visible`` [N, M]; each pair of
        ``extra`` adds one key/value per query row ([N, kv_heads, d], EAGLE-3's diagonal keys)."""
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = self.head_dim ** -0.5
        scores = torch.einsum("nhd,mhd->nhm", q, k) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        diag = [(q * ek.repeat_interleave(group, dim=1)).sum(-1, keepdim=True) * scale for ek, _ in extra]
        probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
        out = torch.einsum("nhm,mhd->nhd", probs[..., :k.shape[0]], v)
        for i, (_, ev) in enumerate(extra):
            out = out + probs[..., k.shape[0] + i, None] * ev.repeat_interleave(group, dim=1)
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj, self.up_proj = linear(hidden, intermediate), linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Llama (or, with q/k norm, Qwen3) decoder layer whose attention reads ``in_size`` inputs."""

    def __init__(self, arch: ModelArch, in_size: int, has_qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = SelfAttention(arch, in_size, has_qk_norm)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))
