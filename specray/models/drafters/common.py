"""What every drafter shares: the batch it drafts for, the replicated small projections,
and the drafter contract (``attention.build_metadata`` gives metadata for any positions).

A drafter is built on every rank and sharded like the target (its decoder layers take
``ctx.tp``). Each step, before the target verifies, the runner calls
``drafter.propose(batch, choose)``:

- ``batch.seqs[i].tokens`` are sequence i's tokens (length L; token L-1 is fed to the
  target in this step), ``num_consumed`` how many positions the drafter has already cached,
  ``features`` the target features of positions ``[num_consumed, L - 1)`` (concatenated
  over ``feature_layers``) for drafters conditioned on the target;
- the drafter writes its KV into ``batch.pools`` through ``batch.block_tables`` (its own
  pool for a standalone drafter, the target's pool and block tables for a one-model one),
  only at positions below ``L + k``: the scheduler allocated exactly those pages;
- ``choose(logits [S, V], j)`` turns round j's logits into draft tokens ([S]) and records
  what rejection sampling needs; ``propose`` returns the drafts [S, k].

After verification the runner keeps the drafter's cache valid for positions below
``min(consumed, verified)``, where ``consumed = L + k - 1`` for drafters whose KV of an
accepted draft equals the KV of the real token (``reuses_draft_kv``) and ``L - 1`` for
drafters whose speculative positions carry their own features or mask tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specray.models.layers import linear

FINAL_HIDDEN = -1  # in ``feature_layers``: the target's output after its final norm

Choose = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(slots=True)
class DraftSeq:
    tokens: list[int]
    num_consumed: int
    features: torch.Tensor | None  # [L - 1 - num_consumed, F] or None
    block_table: list[int]


@dataclass(slots=True)
class DraftBatch:
    seqs: list[DraftSeq]
    k: int
    pools: list[torch.Tensor]  # the drafter's layers, in order
    block_size: int
    device: torch.device
    confidence_threshold: float | None = None  # this step's early stop (dspark), over the drafter's own


def catch_up_rows(batch: DraftBatch) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """(starts, lengths, token ids, target features) of a feature-conditioned drafter's catch-up
    without drafting: positions [consumed, L - 2), each paired with its feature and token p + 1.
    Position L - 2 is left for the next draft, whose first forward starts from it (a drafter's
    catch-up and first draft are one forward; every row's bits are its own, so splitting the
    rows between two forwards changes no draft)."""
    seqs = batch.seqs
    starts = [s.num_consumed for s in seqs]
    lens = [len(s.tokens) - 2 - s.num_consumed for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_consumed + 1:-1]], device=batch.device)
    features = torch.cat([s.features[:n] for s, n in zip(seqs, lens)])
    return starts, lens, ids, features


def last_rows(query_lens: list[int], device: torch.device) -> torch.Tensor:
    """Index of each sequence's last row in a flattened batch."""
    return torch.tensor(query_lens, device=device).cumsum(0) - 1


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole (fusing features is cheap next to the
    decoder layer, and replicating it keeps the drafter's collectives to its layer's)."""

    def __init__(self, in_size: int, out_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_size, in_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None)  # the CPU kernels' GEMV plans where they apply, as every layer

    def load(self, reader, name: str) -> None:
        self.weight.copy_(reader.read(name))


def read_d2t(reader, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """Target id of each draft id (``i + d2t[i]``, EAGLE-3's and speculators' mapping), checked."""
    ids = torch.arange(draft_vocab_size, device=reader.device) + reader.read_exact("d2t").long()
    if ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"drafter {str(reader.dir)!r}: d2t maps draft ids outside the target's "
                         f"vocabulary [0, {vocab_size}) or onto one target id twice")
    return ids


def to_target_vocab(draft_logits: torch.Tensor, target_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits placed at their target ids, -inf elsewhere (None: already the target's)."""
    if target_ids is None:
        return draft_logits
    full = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    full[:, target_ids] = draft_logits
    return full
