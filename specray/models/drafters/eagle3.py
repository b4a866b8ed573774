"""``eagle3``: EAGLE-3 as its authors, SpecForge and ``speculators`` publish it (formats.py).

One-model drafter: its single decoder layer keeps its KV as one extra layer of the target's
pool, under the target's block tables. Draft position p pairs a feature for position p with
the embedding of token p + 1 and predicts token p + 2:

    h_p = fc([a_p^1; a_p^2; a_p^3])             the target's aux hidden states (formats.py)
    x_p = [input_layernorm(embed(t_{p+1})); hidden_norm(h_p)]     width 2H, embedding first
    g_p = r_p + attn(x_p);  g_p = g_p + mlp(post_attention_layernorm(g_p))
          with r_p = h_p, or hidden_norm(h_p) when ``norm_before_residual``
    draft logits = lm_head(norm(g_p)) over ``draft_vocab_size``; target id = i + d2t[i]

Each step catches up on the positions verified since the last step (target features, then
fc), and drafts autoregressively with h = the previous g (pre-norm, without fc; with
``norm_output``, Eagle 3.1, norm(g)). The features of speculative positions are the
drafter's own, so those positions are recomputed next step (``reuses_draft_kv`` False).

Sharding (tp ranks):

| module                  | split                                  | reduce            |
|-------------------------|----------------------------------------|-------------------|
| fc                      | replicated                             | -                 |
| embed_tokens (optional) | vocab rows over tp                     | all_reduce        |
| self_attn.qkv [*, 2H]   | heads over tp, as decoder.py           | -                 |
| self_attn.o_proj, mlp   | as decoder.py                          | all_reduce        |
| lm_head [draft vocab]   | draft-vocab rows over tp               | all_gather        |
| norms, d2t              | replicated                             | -                 |
"""

from __future__ import annotations

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.models.attention import build_metadata
from specray.models.cpu_kernels import CpuKernels
from specray.models.decoder import MLP, Attention, CausalLM
from specray.models.drafters.common import (Choose, DraftBatch, ReplicatedLinear, catch_up_rows, last_rows, read_d2t,
                                            to_target_vocab)
from specray.models.drafters.formats import Eagle3Format, check_tensors, layer_tensors
from specray.models.fused_decode import add_mlp_block, layer_tables, lone_layer_kernels
from specray.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)


def expected_tensors(fmt: Eagle3Format, has_embed: bool, has_d2t: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape."""
    a, p = fmt.arch, fmt.layer_prefix
    h = a.hidden_size
    out = {"fc.weight": (h, len(fmt.feature_layers) * fmt.target_hidden_size), "norm.weight": (h,),
           "lm_head.weight": (fmt.draft_vocab_size, h), f"{p}.hidden_norm.weight": (h,),
           **layer_tensors(p, a, 2 * h)}
    if has_embed:
        out["embed_tokens.weight"] = (a.vocab_size, h)
    if has_d2t:
        out["d2t"] = (fmt.draft_vocab_size,)
    return out


class Eagle3Drafter(nn.Module):
    is_standalone = False
    reuses_draft_kv = False
    kv_successor_tokens = 1  # its KV at position p pairs with token p + 1: prefix-cache keys include it

    def __init__(self, fmt: Eagle3Format, target: CausalLM, ctx: DistContext, dtype: torch.dtype,
                 has_embed: bool):
        super().__init__()
        a, dev = fmt.arch, ctx.device
        h, eps = a.hidden_size, a.rms_norm_eps
        if not has_embed and h != target.arch.hidden_size:
            raise ValueError(f"eagle3 drafter has hidden_size {h} and no embed_tokens: it would embed with the "
                             f"target's, of width {target.arch.hidden_size}; they must be equal")
        self.fmt, self.feature_layers = fmt, fmt.feature_layers
        self.target = [target]  # a list so the target's modules are not registered twice
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, dev)
        self.fc = ReplicatedLinear(len(fmt.feature_layers) * fmt.target_hidden_size, h, dtype, dev)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, h, ctx.tp, dtype, dev) if has_embed else None
        self.input_layernorm = RMSNorm(h, eps, dtype, dev)
        self.hidden_norm = RMSNorm(h, eps, dtype, dev)
        self.self_attn = Attention(a, ctx, dtype)
        # EAGLE-3's q/k/v read [embedding; features]: 2H inputs, same heads
        self.self_attn.qkv = QKVParallelLinear(2 * h, a.num_heads, a.num_kv_heads, a.head_dim, ctx.tp,
                                               a.attention_bias, dtype, dev)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, dev)
        self.mlp = MLP(h, a.intermediate_size, ctx, dtype)
        self.norm = RMSNorm(h, eps, dtype, dev)
        self.lm_head = ParallelLMHead(fmt.draft_vocab_size, h, ctx.tp, dtype, dev)
        self.register_buffer("target_ids", None)  # draft id i -> target id i + d2t[i]; None: identity
        self.kv_layout = KVLayout(1, self.self_attn.num_local_kv_heads, a.head_dim)

    @torch.no_grad()
    def load(self, reader) -> None:
        fmt, p = self.fmt, self.fmt.layer_prefix
        has_d2t = reader.shape("d2t") is not None
        if not has_d2t and fmt.draft_vocab_size != fmt.arch.vocab_size:
            raise ValueError(f"drafter {str(reader.dir)!r} drafts over {fmt.draft_vocab_size} tokens but the "
                             f"target has {fmt.arch.vocab_size} and the checkpoint has no d2t to map them")
        check_tensors(reader, expected_tensors(fmt, self.embed_tokens is not None, has_d2t), reader.dir)
        self.fc.load(reader, "fc.weight")
        if self.embed_tokens is not None:
            self.embed_tokens.load(reader, "embed_tokens")
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(self, norm).load(reader, f"{p}.{norm}.weight")
        self.self_attn.load(reader, f"{p}.self_attn")
        self.mlp.load(reader, f"{p}.mlp")
        self.norm.load(reader, "norm.weight")
        self.lm_head.load(reader, "lm_head")
        if has_d2t:
            self.target_ids = read_d2t(reader, fmt.draft_vocab_size, fmt.arch.vocab_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.embed_tokens is not None else self.target[0].embed_tokens
        return embedding(ids)

    def layer(self, emb: torch.Tensor, h: torch.Tensor, cos, sin, pool, meta) -> torch.Tensor:
        """EAGLE-3's decoder layer: attention over [input_layernorm(emb); hidden_norm(h)]."""
        hidden = self.hidden_norm(h)
        residual = hidden if self.fmt.norm_before_residual else h
        x = residual + self.self_attn(torch.cat([self.input_layernorm(emb), hidden], dim=-1), cos, sin, pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits: draft logits placed at their target ids, -inf elsewhere."""
        return to_target_vocab(self.lm_head(self.norm(g)), self.target_ids, self.fmt.arch.vocab_size)

    def _rows(self, batch: DraftBatch, ids: torch.Tensor, h: torch.Tensor, starts: list[int],
              lens: list[int]) -> torch.Tensor:
        """g at every row, for positions ``starts[i] + [0, lens[i])``; their KV is written."""
        positions, meta = build_metadata([s.block_table for s in batch.seqs], batch.block_size, starts, lens,
                                         batch.device)
        pool, emb = batch.pools[0], self.embed(ids)
        kernels = lone_layer_kernels(self, self.fmt.arch, h, pool, meta, [self])
        if kernels is not None:
            return self._fused_layer(kernels, emb, h, positions, pool, meta)
        cos, sin = self.rotary(positions, max(meta.context_lens_list))
        return self.layer(emb, h, cos, sin, pool, meta)

    def _fused_layer(self, kernels: CpuKernels, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                     pool: torch.Tensor, meta) -> torch.Tensor:
        """``layer`` in two C calls (fused_layer.c), the two all-reduces between and after them
        as in ``layer``: the attention block over [input_layernorm(emb); hidden_norm(h)], then
        the MLP block; the same kernels as ``layer`` (silu by specray_silu_mul)."""
        attn, eps = self.self_attn, self.fmt.arch.rms_norm_eps
        row, step, shape = layer_tables(self, self.rotary, h, positions, self.input_layernorm.weight, attn,
                                        self.post_attention_layernorm.weight, self.mlp, pool, meta)
        x = h.clone(memory_format=torch.contiguous_format)  # h, then the residual stream (h is kept)
        o = kernels.eagle3_attention_block(row, shape, step, eps, attn.scale, emb.contiguous(),
                                           self.hidden_norm.weight, self.fmt.norm_before_residual, x)
        return add_mlp_block(kernels, row, shape, eps, x, o, attn, self.mlp)

    def _step(self, batch: DraftBatch, ids: torch.Tensor, h: torch.Tensor, starts: list[int],
              lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, feedback) at each sequence's last row, for positions ``starts[i] + [0, lens[i])``."""
        g = self._rows(batch, ids, h, starts, lens)[last_rows(lens, batch.device)]
        return self.logits(g), self.norm(g) if self.fmt.norm_output else g

    def catch_up(self, batch: DraftBatch) -> None:
        """The layer's KV at positions [consumed, L - 2) of each sequence, drafting nothing
        (common.catch_up_rows)."""
        starts, lens, ids, features = catch_up_rows(batch)
        self._rows(batch, ids, self.fc(features), starts, lens)

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        seqs = batch.seqs
        # catch-up: positions [consumed, L - 1) pair the target's features with tokens consumed+1 .. L-1
        starts = [s.num_consumed for s in seqs]
        lens = [len(s.tokens) - 1 - s.num_consumed for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_consumed + 1:]], device=batch.device)
        logits, g = self._step(batch, ids, self.fc(torch.cat([s.features for s in seqs])), starts, lens)
        drafts = [choose(logits, 0)]
        for j in range(1, batch.k):
            starts = [len(s.tokens) - 2 + j for s in seqs]
            logits, g = self._step(batch, drafts[-1], g, starts, [1] * len(seqs))
            drafts.append(choose(logits, j))
        return torch.stack(drafts, dim=1)
