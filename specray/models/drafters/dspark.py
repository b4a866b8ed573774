"""``dspark``: DSpark as ``speculators`` defines it (``speculators/models/dspark/``): the DFlash
backbone (dflash.py: context K/V in the drafter's own pool, one non-causal block forward)
plus a Markov logit-bias head and a confidence head.

Per step, on the block's normed outputs o_s (slot s at position L-1+s):

- draft j comes from slot j (``sample_from_anchor``, DSpark's default: the anchor t_{L-1}
  drafts too, up to block_size drafts) or slot j + 1 (up to block_size - 1, as DFlash);
- its logits over the draft vocabulary are ``lm_head(o) + W2(W1[prev])`` ("vanilla") or
  ``lm_head(o) + W2(sigmoid(gate_proj([o; W1[prev]])) * W1[prev])`` ("gated"), where prev is
  the token before the drafted one: t_{L-1} for the first draft, then the previous draft, so
  drafts are chosen one after another from one forward; draft id i is target id i + d2t[i];
- the confidence head predicts each draft's acceptance, c_j = sigmoid(proj([o_j; W1[prev]])).
  With ``SpecConfig.dspark_confidence_threshold`` τ (off by default), a sequence proposes
  draft j only while c_0 * ... * c_j >= τ: the product is the predicted probability that
  drafts 0..j are all accepted (speculators trains c_j on the acceptance rate 1 - d_TV of
  each position), so drafting stops where a further draft is predicted not to be reached.
  Under adaptive speculation without a fixed τ, rank 0 sends τ = λ c_verify in each step plan
  (``verify_threshold``, executor/adaptive.py): a draft is verified only while the tokens it
  is expected to add pay for its verify row at the step's modelled goodput λ.
  Sequences stop independently (per-sequence draft lengths; zero makes a plain decode row);
  once every sequence has stopped, no further draft is chosen (the head is read once for all
  k positions up front: one read costs what one position's would at small batch).

Without a draft vocabulary (draft_vocab_size = the target's) the head is the target's.

Sharding: as dflash.py; W1 vocab rows over tp (all_reduce); W2 and lm_head draft-vocab rows
over tp (all_gather); gate_proj, confidence head and d2t replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.context import DistContext
from specray.models.decoder import CausalLM
from specray.models.drafters.common import Choose, DraftBatch, read_d2t, to_target_vocab
from specray.models.drafters.dflash import DFlashDrafter
from specray.models.drafters.dflash import expected_tensors as dflash_tensors
from specray.models.drafters.formats import DFlashFormat, check_tensors
from specray.models.layers import ParallelLMHead, VocabParallelEmbedding


def expected_tensors(fmt: DFlashFormat) -> dict[str, tuple[int, ...]]:
    h, r, vocab, draft_vocab = fmt.arch.hidden_size, fmt.markov_rank, fmt.arch.vocab_size, fmt.draft_vocab_size
    out = dflash_tensors(fmt)
    if draft_vocab != vocab:
        out.update({"lm_head.weight": (draft_vocab, h), "d2t": (draft_vocab,)})
    if r:
        out.update({"markov_head.markov_w1.weight": (vocab, r), "markov_head.markov_w2.weight": (draft_vocab, r)})
    if r and fmt.markov_head_type == "gated":
        out.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    if fmt.has_confidence_head:
        width = h + (r if fmt.confidence_with_markov else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


def _replicated(*shape: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DSparkDrafter(DFlashDrafter):
    confidence_threshold: float | None = None  # set by the loader from SpecConfig: early stop when not None

    def __init__(self, fmt: DFlashFormat, target: CausalLM, ctx: DistContext, dtype: torch.dtype):
        super().__init__(fmt, target, ctx, dtype)
        h, r, dev, tp = fmt.arch.hidden_size, fmt.markov_rank, ctx.device, ctx.tp
        self.lm_head = None if fmt.draft_vocab_size == fmt.arch.vocab_size else (
            ParallelLMHead(fmt.draft_vocab_size, h, tp, dtype, dev))
        self.register_buffer("target_ids", None)
        self.markov_w1 = VocabParallelEmbedding(fmt.arch.vocab_size, r, tp, dtype, dev) if r else None
        self.markov_w2 = ParallelLMHead(fmt.draft_vocab_size, r, tp, dtype, dev) if r else None
        gated = r and fmt.markov_head_type == "gated"
        self.gate_weight = _replicated(r, h + r, dtype=dtype, device=dev) if gated else None
        self.gate_bias = _replicated(r, dtype=dtype, device=dev) if gated else None
        width = h + (r if fmt.confidence_with_markov else 0)
        self.conf_weight = _replicated(1, width, dtype=dtype, device=dev) if fmt.has_confidence_head else None
        self.conf_bias = _replicated(1, dtype=dtype, device=dev) if fmt.has_confidence_head else None

    @torch.no_grad()
    def load(self, reader) -> None:
        check_tensors(reader, expected_tensors(self.fmt), reader.dir)
        super().load(reader)
        if self.lm_head is not None:
            self.lm_head.load(reader, "lm_head")
            self.target_ids = read_d2t(reader, self.fmt.draft_vocab_size, self.fmt.arch.vocab_size)
        if self.markov_w1 is not None:
            self.markov_w1.load(reader, "markov_head.markov_w1")
            self.markov_w2.load(reader, "markov_head.markov_w2")
        for param, name in ((self.gate_weight, "markov_head.gate_proj.weight"),
                            (self.gate_bias, "markov_head.gate_proj.bias"),
                            (self.conf_weight, "confidence_head.proj.weight"),
                            (self.conf_bias, "confidence_head.proj.bias")):
            if param is not None:
                param.copy_(reader.read(name))

    @property
    def has_confidence_head(self) -> bool:
        return self.conf_weight is not None

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The backbone's logits over the draft vocabulary (the target's head when there is none)."""
        return self.logits(normed) if self.lm_head is None else self.lm_head(normed)

    def markov_bias(self, prev: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """[S, draft vocab]: the logit bias of the token before each drafted one."""
        emb = self.markov_w1(prev)
        if self.gate_weight is not None:
            emb = torch.sigmoid(F.linear(torch.cat([normed, emb], dim=-1), self.gate_weight, self.gate_bias)) * emb
        return self.markov_w2(emb)

    def confidence(self, prev: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """[S]: the confidence head's predicted acceptance probability of each drafted token."""
        features = torch.cat([normed, self.markov_w1(prev)], dim=-1) if self.fmt.confidence_with_markov else normed
        return torch.sigmoid(F.linear(features, self.conf_weight, self.conf_bias)[:, 0])

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor | list[list[int]]:
        first = 0 if self.fmt.sample_from_anchor else 1
        normed = self.block_outputs(batch, slice(first, first + batch.k))  # [S, k, H]
        prev = torch.tensor([s.tokens[-1] for s in batch.seqs], device=batch.device)
        threshold = self.confidence_threshold if batch.confidence_threshold is None else batch.confidence_threshold
        reach = torch.ones(len(batch.seqs), device=batch.device)  # predicted P(every draft so far accepted)
        lengths = torch.full((len(batch.seqs),), batch.k, device=batch.device)
        num_seqs, k = normed.shape[0], batch.k
        # one read of the head for every position (each row's logits do not depend on the others)
        head = self.draft_logits(normed.reshape(num_seqs * k, -1)).view(num_seqs, k, -1)
        drafts = []
        for j in range(batch.k):
            if threshold is not None:
                reach = reach * self.confidence(prev, normed[:, j])
                lengths = torch.where((reach < threshold) & (lengths == batch.k), j, lengths)
                if bool((lengths <= j).all()):
                    break  # every sequence has stopped: draft j and later are not chosen
            logits = head[:, j]
            if self.markov_w1 is not None:
                logits = logits + self.markov_bias(prev, normed[:, j])
            prev = choose(to_target_vocab(logits, self.target_ids, self.fmt.arch.vocab_size), j)
            drafts.append(prev)
        if threshold is None:
            return torch.stack(drafts, dim=1)
        rows = torch.stack(drafts, dim=1).tolist() if drafts else [[] for _ in batch.seqs]
        return [row[:n] for row, n in zip(rows, lengths.tolist())]
