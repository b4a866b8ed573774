"""How a step's sequences use a linear-attention layer's state rows (``kv/state.py``), the same
for every linear mixer (Gated DeltaNet, KDA) and every layer of one step.

A sequence reads and writes its **committed row** (``meta.state_rows``). Three kinds of rows:

- a **decode** row (one new token after a cached context) goes through the recurrent rule with
  the other decode rows; its committed row is updated in place;
- a **verify** row (the last fed token plus m >= 1 drafts, ``meta.num_drafts``) goes through the
  recurrent rule too, keeping the state after every position (the snapshot scheme): the state
  after position j < m goes to the slot's scratch row ``committed + 1 + j``, the state after the
  last position m to the committed row itself. Once acceptance is known, ``commit_accepted``
  copies scratch row ``1 + n`` over the committed row where n < m drafts were accepted, so the
  committed row holds the state after exactly the verified tokens and nothing of a rejected
  position survives; n = m needs no copy. Scratch rows are only ever read by that commit, in
  the same step that wrote them;
- every other sequence (a prompt, or a chunk of one) goes alone through the chunked rule.

A verify row must not be a prefill: the scheduler drafts only for sequences that decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.models.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class LayerState:
    """One linear layer's slice of the state pool: ``conv [rows, conv_dim, K - 1]``,
    ``recurrent [rows, heads, k_head_dim, v_head_dim]``."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(frozen=True, slots=True)
class RecurrentGroup:
    """Sequences fed the same number of tokens (L) through the recurrent rule together: decode rows
    (L = 1) or verify rows of L - 1 drafts. ``tokens [S, L]`` are their token rows in the step,
    ``rows [S]`` their committed state rows, ``scratch [S, L - 1]`` where the states after their
    first L - 1 positions go."""

    tokens: torch.Tensor
    rows: torch.Tensor
    scratch: torch.Tensor

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True, slots=True)
class LinearPlan:
    recurrent: list[RecurrentGroup]
    prefills: list[tuple[int, int, int, bool]]  # (first token, end token, state row, has state before)

    @staticmethod
    def build(meta: AttentionMetadata, device: torch.device) -> LinearPlan:
        if len(meta.state_rows) != len(meta.query_lens):
            raise RuntimeError(f"a step over linear-attention layers needs a state row per sequence: "
                               f"{len(meta.state_rows)} rows for {len(meta.query_lens)} sequences")
        num_drafts = meta.num_drafts or [0] * len(meta.query_lens)
        by_length: dict[int, list[tuple[int, int]]] = {}
        prefills, start = [], 0
        for n, ctx, row, m in zip(meta.query_lens, meta.context_lens_list, meta.state_rows, num_drafts):
            if m and n != m + 1:
                raise RuntimeError(f"a verify row feeds its last token and its {m} drafts, not {n} tokens")
            if m and ctx <= n:  # the chunked rule keeps no per-position state: a rejection could not roll back
                raise RuntimeError(f"a verify row with {m} drafts needs a verified token before them (context {ctx})")
            if n == m + 1 and ctx > n:
                by_length.setdefault(n, []).append((start, row))
            else:
                prefills.append((start, start + n, row, ctx > n))
            start += n
        groups = []
        for length, seqs in sorted(by_length.items()):
            first = torch.tensor([s for s, _ in seqs], dtype=torch.int64, device=device)
            rows = torch.tensor([r for _, r in seqs], dtype=torch.int64, device=device)
            steps = torch.arange(length, dtype=torch.int64, device=device)
            groups.append(RecurrentGroup(first[:, None] + steps, rows, rows[:, None] + 1 + steps[:-1]))
        return LinearPlan(groups, prefills)


def linear_plan(meta: AttentionMetadata, device: torch.device) -> LinearPlan:
    """The step's plan, built by its first linear layer and reused by the others."""
    plan = meta.derived.get("linear")
    if plan is None:
        plan = meta.derived["linear"] = LinearPlan.build(meta, device)
    return plan


def store_snapshots(target: torch.Tensor, group: RecurrentGroup, after_each: torch.Tensor) -> None:
    """Write a group's state after each of its positions (``after_each [S, L, ...]``): the last to
    the committed rows, the others to the scratch rows (module docstring)."""
    target[group.rows] = after_each[:, -1].to(target.dtype)
    if group.length > 1:
        target[group.scratch.reshape(-1)] = after_each[:, :-1].reshape(-1, *target.shape[1:]).to(target.dtype)


def commit_accepted(states: list[LayerState], committed_rows: list[int], num_drafts: list[int],
                    num_accepted: list[int]) -> None:
    """After a verify, make each sequence's committed row the state after its accepted drafts, in
    every linear layer: scratch row ``committed + 1 + n`` where n < m drafts were accepted."""
    moves = [(row + 1 + n, row) for row, m, n in zip(committed_rows, num_drafts, num_accepted) if n < m]
    if not moves:
        return
    device = states[0].conv.device
    source = torch.tensor([s for s, _ in moves], dtype=torch.int64, device=device)
    dest = torch.tensor([d for _, d in moves], dtype=torch.int64, device=device)
    for state in states:
        state.conv.index_copy_(0, dest, state.conv.index_select(0, source))
        state.recurrent.index_copy_(0, dest, state.recurrent.index_select(0, source))
