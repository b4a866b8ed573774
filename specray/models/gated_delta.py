"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in plain torch.

Per value head, with the recurrent state ``S`` of shape ``[k_head_dim, v_head_dim]``, a decay
``g_t <= 0`` (log space) and a write strength ``beta_t`` in (0, 1), each token does

    S <- exp(g_t) * S                          decay the memory
    u_t = beta_t * (v_t - S^T k_t)             the delta: what the memory got wrong about v_t
    S <- S + k_t u_t^T                         write the correction under key k_t
    o_t = S^T q_t                              read (q_t scaled by 1 / sqrt(k_head_dim))

``recurrent_gated_delta_rule`` runs that loop, one token at a time (decode and verify), and can
return the state after every position: the snapshot a verify row commits when its drafts are
accepted (docs/geometry.md, state slots).

``chunk_gated_delta_rule`` (prefill) computes the same thing a chunk of C tokens at a time. With
``G_t`` the cumulative log decay inside the chunk and ``S_0`` the state before it, unrolling the
loop gives ``exp(g_s) S_{s-1} = exp(G_s) S_0 + sum_{r<s} exp(G_s - G_r) k_r u_r^T``, so the deltas
solve one unit lower-triangular system,

    (I + A) U = beta * V - (beta * exp(G)) K S_0,    A[s, r] = beta_s exp(G_s - G_r) k_s.k_r  (r < s)

and then ``o_t = exp(G_t) S_0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s`` and
``S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s u_s^T``: a few matmuls per chunk instead of C
sequential steps. Both rules agree up to float32 rounding (tests/test_gated_delta.py).

Layout as in transformers and flash-linear-attention: q and k ``[batch, seq, num_k_heads, k_head_dim]``,
v ``[batch, seq, num_v_heads, v_head_dim]``, g and beta ``[batch, seq, num_v_heads]``, the state
``[batch, num_v_heads, k_head_dim, v_head_dim]``. Each q/k head serves ``num_v_heads // num_k_heads``
consecutive value heads. All the maths runs in float32 (the state accumulates over the whole
sequence); outputs return in the input dtype, states in float32.

Sharding: every value head (and the q/k head it reads) is independent, so TP splits the heads
and these rules need no collective; the caller passes its rank's heads.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (Qwen3-Next normalises q and k so)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, l2_normalize_qk: bool):
    """float32, heads first ([batch, heads, seq, ...]), q/k repeated per value head, q scaled."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    if l2_normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def initial_state_for(initial_state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, heads, _, k_head_dim = k.shape
    if initial_state is None:
        return k.new_zeros(batch, heads, k_head_dim, v.shape[-1])
    expected = (batch, heads, k_head_dim, v.shape[-1])
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, the inputs need {expected}")
    return initial_state.to(torch.float32)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                               l2_normalize_qk: bool = False,
                               return_all_states: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. Returns (output ``[batch, seq, num_v_heads, v_head_dim]``, states):
    the final state ``[batch, heads, k_head_dim, v_head_dim]``, or with ``return_all_states`` the
    state after every position, ``[batch, seq, heads, k_head_dim, v_head_dim]`` (state j is the
    state after tokens 0..j, what a verify commits when j drafts were accepted)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2_normalize_qk)
    state = initial_state_for(initial_state, k, v)
    out, final = run_recurrence(q, k, v, g[..., None], beta, state, return_all_states)
    return out.transpose(1, 2).to(dtype), final


def run_recurrence(q, k, v, decay, beta, state, return_all_states: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's loop (module docstring) on prepared float32 inputs, heads first: ``decay`` is
    the log decay ``[batch, heads, seq, 1]`` per head (Gated DeltaNet) or ``[..., k_head_dim]`` per
    key channel (KDA, ``kda.py``). Returns the output heads first and the final state, or the state
    after every position ``[batch, seq, heads, k_head_dim, v_head_dim]``."""
    out = torch.empty_like(v)
    states = []
    for t in range(v.shape[2]):
        state = state * decay[:, :, t, :, None].exp()
        k_t = k[:, :, t, :, None]  # [batch, heads, k_head_dim, 1]
        delta = (v[:, :, t] - (state * k_t).sum(-2)) * beta[:, :, t, None]
        state = state + k_t * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
        if return_all_states:
            states.append(state)
    if not return_all_states:
        return out, state
    if len(states) == 1:  # a decode row: a view, no copy on the hot path
        return out, states[0][:, None]
    return out, torch.stack(states, dim=1) if states else state.new_zeros(state.shape[0], 0, *state.shape[1:])


def _chunk(q, k, v, g, beta, state):
    """One chunk of the chunked rule (module docstring): its output and the state after it."""
    size = g.shape[-1]
    cum = g.cumsum(-1)  # G_t, [batch, heads, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    # exp(G_t - G_s) for s <= t; the masked entries would be exp of a positive sum, so mask first
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = lower + torch.eye(size, dtype=lower.dtype, device=lower.device)
    u_from_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    u = u_from_v - w @ state  # the deltas written at each position
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    to_end = (cum[..., -1:] - cum).exp()[..., None]  # exp(G_C - G_s)
    new_state = cum[..., -1, None, None].exp() * state + (k * to_end).transpose(-1, -2) @ u
    return out, new_state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, initial_state: torch.Tensor | None = None, chunk_size: int = 64,
                           l2_normalize_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_size`` tokens at a time (prefill). Returns (output, final state), as the recurrent
    rule does; the last chunk may be shorter (no padding needed: each chunk is solved on its own)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2_normalize_qk)
    state = initial_state_for(initial_state, k, v)
    out = torch.empty_like(v)
    for start in range(0, v.shape[2], chunk_size):
        end = start + chunk_size
        out[:, :, start:end], state = _chunk(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                             g[:, :, start:end], beta[:, :, start:end], state)
    return out.transpose(1, 2).to(dtype), state
