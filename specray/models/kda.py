"""The Kimi delta rule (KDA, Kimi Linear's linear attention) in plain torch.

KDA is the gated delta rule (``gated_delta.py``) with a decay per key channel instead of one per
head: per head, with the state ``S`` of shape ``[head_dim_k, head_dim_v]``, a decay vector
``g_t <= 0`` (log space, one entry per key channel) and a write strength ``beta_t`` in (0, 1),

    S <- diag(exp(g_t)) S                      each key channel's memory decays at its own rate
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t                              (q_t and k_t L2-normalised, q_t / sqrt(head_dim))

``recurrent_kda`` runs that loop (decode and verify) and can return the state after every
position, what a verify commits (``linear_state.py``).

``chunk_kda`` (prefill) takes C tokens at a time. With ``G_t`` the cumulative log decay (a vector)
inside the chunk and ``S_0`` the state before it, ``d(t, s) = exp(G_t - G_s)`` per channel:

    (I + A) U = beta * V - beta * (exp(G) * K) S_0,   A[t, s] = beta_t sum_c k_t[c] k_s[c] d(t, s)[c]  (s < t)
    o_t = (exp(G_t) * q_t)^T S_0 + sum_{s<=t} (sum_c q_t[c] k_s[c] d(t, s)[c]) u_s
    S_C = diag(exp(G_C)) S_0 + sum_s (exp(G_C - G_s) * k_s) u_s^T

The per-channel decays do not factor out of the dot products, so ``d`` is built whole,
``[C, C, head_dim]`` per head, with the s > t entries masked before the exp (they would be exp of
a positive sum). Both rules agree up to float32 rounding (tests/test_kimi_linear.py).

Layout as transformers': q, k and g ``[batch, seq, heads, head_dim_k]``, v ``[batch, seq, heads,
head_dim_v]``, beta ``[batch, seq, heads]``, the state ``[batch, heads, head_dim_k, head_dim_v]``.
The maths runs in float32; outputs return in the input dtype, states in float32.

Sharding: heads are independent, so TP splits them and these rules need no collective.
"""

from __future__ import annotations

import torch

from specray.models.gated_delta import initial_state_for, run_recurrence


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim: a division, as KDA's kernels (and transformers)
    compute it, not the multiply by rsqrt that Gated DeltaNet uses."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32, heads first ([batch, heads, seq, ...]), q and k normalised, q scaled."""
    q, k, v, g, beta = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                  initial_state: torch.Tensor | None = None,
                  return_all_states: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. Returns (output ``[batch, seq, heads, head_dim_v]``, states): the final
    state, or with ``return_all_states`` the state after every position ``[batch, seq, heads,
    head_dim_k, head_dim_v]`` (state j: after tokens 0..j)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out, final = run_recurrence(q, k, v, g, beta, initial_state_for(initial_state, k, v), return_all_states)
    return out.transpose(1, 2).to(dtype), final


def _chunk(q, k, v, g, beta, state):
    """One chunk of the chunked rule (module docstring): its output and the state after it."""
    size = g.shape[-2]
    cum = g.cumsum(-2)  # G_t, [batch, heads, C, dk]
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # G_t - G_s, [batch, heads, C, C, dk]
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    kk = (k[..., :, None, :] * decay * k[..., None, :, :]).sum(-1)
    qk = (q[..., :, None, :] * decay * k[..., None, :, :]).sum(-1)  # zero above the diagonal
    system = (beta[..., None] * kk).tril(-1) + torch.eye(size, dtype=kk.dtype, device=kk.device)
    u_from_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * (cum.exp() * k), upper=False, unitriangular=True)
    u = u_from_v - w @ state
    out = (q * cum.exp()) @ state + qk @ u
    to_end = (cum[..., -1:, :] - cum).exp()  # exp(G_C - G_s) per channel
    new_state = cum[..., -1, :, None].exp() * state + (k * to_end).transpose(-1, -2) @ u
    return out, new_state


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              initial_state: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_size`` tokens at a time (prefill). Returns (output, final state) as the recurrent
    rule does; the last chunk may be shorter (each chunk is solved on its own, no padding)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = initial_state_for(initial_state, k, v)
    out = torch.empty_like(v)
    for start in range(0, v.shape[2], chunk_size):
        end = start + chunk_size
        out[:, :, start:end], state = _chunk(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                             g[:, :, start:end], beta[:, :, start:end], state)
    return out.transpose(1, 2).to(dtype), state
