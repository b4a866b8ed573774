"""Verification of drafted tokens: pure functions, no I/O.

Every rank calls these with the same logits (the LM head gathers them) and a per-request
generator in the same state, so every rank accepts the same drafts and draws the same
bonus token without exchanging anything.

Rules:
- greedy: accept the longest prefix of drafts equal to the target's argmax; the bonus is
  the target's argmax at the first position not accepted (or after the last draft). The
  output is therefore exactly what plain greedy decoding produces.
- sampling: accept draft j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection draw the replacement from normalise(max(0, p_j - q_j)); if all k are
  accepted draw the bonus from p_k. The emitted tokens are distributed as the target's
  own samples (Leviathan et al. 2023, Chen et al. 2023). A drafter that does not sample
  (ngram) proposed d_j with probability 1: q_j is one-hot at d_j, so d_j is accepted with
  probability p_j(d_j) and a rejection draws from p_j without d_j (as vLLM treats n-gram drafts).
- forced acceptance (benchmarking only, changes outputs): the integer part of f is always
  emitted, one more with probability frac(f); the drafts in that prefix are accepted
  whatever their value and the bonus is the target's token after them.
"""

from __future__ import annotations

import math

import torch


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> int:
    """Number of drafts accepted: the longest prefix where the draft equals the target's argmax."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n


def accept_rejection(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generator: torch.Generator) -> tuple[int, int]:
    """(drafts accepted, bonus token) by rejection sampling.

    p: [k + 1, V] target probabilities at the k + 1 verified positions; q: [k, V] the
    draft probabilities each draft was sampled from."""
    k = len(drafts)
    for j, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator, device=generator.device))
        # accept with probability min(1, p/q): u < p/q  <=>  u * q < p (q(d) > 0: d was drawn from q)
        if u * float(q[j, d]) < float(p[j, d]):
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        total = float(residual.sum())
        # p == q at every token leaves no residual mass; then p itself is the right law
        dist = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def one_hot_draft_probs(drafts: list[int], vocab_size: int, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """q for drafts proposed deterministically: row j puts all its mass on drafts[j]."""
    q = torch.zeros(len(drafts), vocab_size, dtype=dtype, device=device)
    q[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.int64)] = 1.0
    return q


def forced_num_emitted(force: float, k: int, generator: torch.Generator) -> int:
    """Tokens one verify step emits under forced acceptance: floor(f), plus one w.p. frac(f)."""
    whole = math.floor(force)
    frac = force - whole
    u = float(torch.rand((), generator=generator, device=generator.device))
    return min(whole + (1 if u < frac else 0), k + 1)
