"""``draft_model``: a small causal LM with the target's vocabulary, drafting autoregressively.

Standalone: its KV lives in its own pool (page size agreed separately, 32 or 64 tokens, the
block-decode kernel's capability). Each step it first catches up on the tokens it has not
cached (the tokens accepted in the last step and the bonus token, or the whole sequence
after a (re)computed prompt), which yields draft 1, then feeds each draft to get the next.
The KV of an accepted draft is exactly the KV of that token, so it is kept.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.models.loader import load_model, read_model_arch
from specray.models.block_attention import block_decode_attention
from specray.models.decoder import CausalLM
from specray.models.arch import ModelArch
from specray.models.attention import build_metadata
from specray.models.drafters.common import Choose, DraftBatch, last_rows


class DraftModelDrafter(nn.Module):
    is_standalone = True
    reuses_draft_kv = True
    feature_layers: tuple[int, ...] = ()

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.kv_layout = model.kv_layout  # K/V rows per kv head, or latent rows for an MLA draft model

    @classmethod
    def load(cls, path, ctx: DistContext, dtype: str, target: CausalLM) -> DraftModelDrafter:
        check_vocabulary(path, target.arch)
        arch = read_model_arch(path)
        if arch.linear_layers:
            raise ValueError(f"draft model {str(path)!r} has linear-attention layers {list(arch.linear_layers)}: a "
                             f"draft model keeps its KV in a paged pool and has no state slots; use a draft model "
                             f"of full-attention layers (a hybrid target's own early-exit preset keeps one)")
        return cls(load_model(path, ctx, dtype, kernel=block_decode_attention))

    def _forward(self, batch: DraftBatch, ids: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
        tables = [s.block_table for s in batch.seqs]
        positions, meta = build_metadata(tables, batch.block_size, starts, lens, batch.device)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=batch.device)
        hidden = self.model(ids_t, positions, batch.pools, meta)
        return self.model.logits(hidden[last_rows(lens, batch.device)])

    def catch_up(self, batch: DraftBatch) -> None:
        """The draft model's KV at positions [consumed, L - 2) of each sequence (the tokens
        there), drafting nothing: the next draft's first forward starts at L - 2, as after a
        catch-up in common.catch_up_rows."""
        seqs = batch.seqs
        starts = [s.num_consumed for s in seqs]
        lens = [len(s.tokens) - 2 - s.num_consumed for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_consumed:-2]], dtype=torch.int64,
                           device=batch.device)
        positions, meta = build_metadata([s.block_table for s in seqs], batch.block_size, starts, lens, batch.device)
        self.model(ids, positions, batch.pools, meta)

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        seqs = batch.seqs
        starts = [s.num_consumed for s in seqs]
        lens = [len(s.tokens) - s.num_consumed for s in seqs]
        ids = [t for s in seqs for t in s.tokens[s.num_consumed:]]
        drafts = [choose(self._forward(batch, ids, starts, lens), 0)]
        for j in range(1, batch.k):
            starts = [len(s.tokens) - 1 + j for s in seqs]
            drafts.append(choose(self._forward(batch, drafts[-1].tolist(), starts, [1] * len(seqs)), j))
        return torch.stack(drafts, dim=1)


def check_vocabulary(path, target: ModelArch) -> None:
    """A draft model proposes target token ids: it must share the target's vocabulary."""
    vocab_size = read_model_arch(path).vocab_size
    if vocab_size != target.vocab_size:
        raise ValueError(f"draft model {str(path)!r} has vocab_size {vocab_size} but the target has "
                         f"{target.vocab_size}; a draft model must share the target's vocabulary")
