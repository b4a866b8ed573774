"""Token sampling from full-vocabulary logits.

Every rank holds the same logits (the LM head gathers them) and the same per-request
generator state, so every rank draws the same token without exchanging it.
"""

from __future__ import annotations

import torch

from specray.config import SamplingParams
from specray.models.cpu_kernels import kernels_for


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: temperature, then top-k, then top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of logits."""
    if params.is_greedy:
        return argmax_rows(logits.reshape(1, -1))[0]
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def _argmax_kernels(logits: torch.Tensor):
    return kernels_for(logits) if logits.dim() == 2 and logits.shape[1] > 0 else None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1).tolist()`` for [rows, n] logits; on a CPU rank with specray's kernels
    one C pass a row (torch's took ~48 us over a 49152-token vocabulary, most of a sampling step)."""
    kernels = _argmax_kernels(logits)
    return kernels.argmax_rows(logits) if kernels is not None else logits.argmax(-1).tolist()


def argmax_tensor(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for [rows, n] logits, by ``argmax_rows``' kernel where it applies."""
    kernels = _argmax_kernels(logits)
    return torch.tensor(kernels.argmax_rows(logits)) if kernels is not None else logits.argmax(-1)


def sample_rows(logits: torch.Tensor, samplers: list[tuple[SamplingParams, torch.Generator]]) -> list[int]:
    """One token per row; greedy rows share one argmax over the batch."""
    tokens = argmax_rows(logits)
    for i, (params, generator) in enumerate(samplers):
        if not params.is_greedy:
            tokens[i] = sample(logits[i], params, generator)
    return tokens
