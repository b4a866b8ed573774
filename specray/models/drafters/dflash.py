"""``dflash``: DFlash as z-lab publishes it (``DFlashDraftModel``; formats.py reads the config).

Standalone: the drafter keeps its own pool (its page size follows the geometry agreement's
rule for standalone drafters). Per step, for a sequence of L tokens whose target KV covers
positions [0, L - 1):

1. context: the outputs of the target layers ``target_layer_ids`` at the positions verified
   since the last step, concatenated, through ``fc`` and ``hidden_norm``; every draft layer
   projects that context into its own K/V (k_proj, k_norm, RoPE at the context positions;
   no input_layernorm) and keeps them in the draft pool;
2. the query block is the target's embedding of [t_{L-1}, mask x (block_size - 1)] at
   positions L-1 .. L+block_size-2 (times ``input_embedding_scale``); each Qwen3 layer (q/k
   norm) attends its queries *without a causal mask* to the whole context (from the pool) and
   the whole block (its own K/V, computed in the step and never written: they are not kept);
3. the block's outputs at the mask positions, through the drafter's ``norm`` and the target's
   LM head (times ``output_multiplier``, soft-capped if configured), are drafts 1 ..
   block_size - 1 from one forward; the step takes the first k.

The cache is therefore valid below L - 1 only (``reuses_draft_kv`` False).

Sharding: fc and hidden_norm replicated; each layer's heads and MLP over tp as in decoder.py
(q/k/v column-parallel, o_proj and down row-parallel with their all_reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.models.attention import build_metadata, use_cpu_kernel, write_kv
from specray.models.block_attention import BLOCK_DECODE_PAGE_SIZES, TILE_TOKENS
from specray.models.cpu_kernels import kernels_for
from specray.models.decoder import CausalLM, DecoderLayer
from specray.models.drafters.common import Choose, DraftBatch, ReplicatedLinear, catch_up_rows
from specray.models.drafters.formats import DFlashFormat, check_tensors, layer_tensors
from specray.models.layers import RMSNorm, RotaryEmbedding, apply_rope, linear


def context_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                            tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                            scale: float) -> torch.Tensor:
    """q: [S * m, heads, dim], the m block slots whose outputs are wanted; k, v: the whole block's
    own [S * n, kv_heads, dim]. Every query sees its sequence's first ``context_lens[s]`` pool
    positions and all n block keys (no causal mask). The pool is read as block-decode reads it,
    in 64-token tiles of whole pages, so it shares that kernel's capability (BLOCK_DECODE_PAGE_SIZES)."""
    block_size, num_seqs = pool.shape[3], tables.shape[0]
    if block_size not in BLOCK_DECODE_PAGE_SIZES:
        raise ValueError(f"DFlash attention takes pages of {sorted(BLOCK_DECODE_PAGE_SIZES)} tokens, "
                         f"not {block_size}")
    kv_heads, dim, heads = pool.shape[2], pool.shape[4], q.shape[1]
    n, m = k.shape[0] // num_seqs, q.shape[0] // num_seqs
    kernels = use_cpu_kernel(q, pool)
    if kernels is not None:  # the pool read in place, the block's keys beside it: one C call
        query_lens = torch.full((num_seqs,), m, dtype=torch.int64)
        return kernels.block_attention(q.contiguous(), pool, tables.contiguous(), context_lens, query_lens,
                                       torch.arange(0, num_seqs * m, m), k.contiguous(), v.contiguous(), scale)
    wanted = -(-max_context // TILE_TOKENS) * (TILE_TOKENS // block_size)
    tables = tables[:, :wanted]
    if tables.shape[1] < wanted:  # the last tile may reach past every table: pad, then mask
        tables = torch.cat([tables, tables.new_zeros(num_seqs, wanted - tables.shape[1])], dim=1)
    pages = pool.index_select(0, tables.reshape(-1)).view(num_seqs, wanted, 2, kv_heads, block_size, dim)
    cached = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, num_seqs, kv_heads, wanted * block_size, dim)
    keys = torch.cat([cached[0], k.view(num_seqs, n, kv_heads, dim).transpose(1, 2)], dim=2).float()
    values = torch.cat([cached[1], v.view(num_seqs, n, kv_heads, dim).transpose(1, 2)], dim=2).float()
    slots = torch.arange(wanted * block_size, device=q.device)
    visible = torch.cat([slots[None] < context_lens[:, None],
                         torch.ones(num_seqs, n, dtype=torch.bool, device=q.device)], dim=1)
    qg = q.view(num_seqs, m, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4).float()
    scores = torch.einsum("skgnd,sktd->skgnt", qg, keys) * scale
    scores.masked_fill_(~visible[:, None, None, None], float("-inf"))
    o = torch.einsum("skgnt,sktd->skgnd", scores.softmax(-1), values)
    return o.permute(0, 3, 1, 2, 4).reshape(num_seqs * m, heads, dim).to(q.dtype)


def _rotated(attn, qkv: torch.Tensor, heads: int, cos, sin, pool: torch.Tensor | None = None,
             slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [N, heads or kv heads, dim] of a fused projection [N, (heads + 2 kv heads) * dim]
    after Qwen3's q/k norms and RoPE (``heads`` 0: a [k | v] projection, no q); with a pool,
    k and v are stored at ``slots``. Where the C kernels serve: the norms in place, then
    RoPE (and the store) in one call."""
    kv_heads, dim = attn.num_local_kv_heads, attn.head_dim
    kernels = kernels_for(qkv, cos, sin, *(() if pool is None else (pool,)))
    if kernels is not None and type(attn.k_norm) is RMSNorm:  # (not Qwen3-Next's zero-centred norm)
        if heads:
            kernels.rms_norm_heads(qkv, attn.q_norm.weight, 0, heads, dim, attn.q_norm.eps)
        kernels.rms_norm_heads(qkv, attn.k_norm.weight, heads, kv_heads, dim, attn.k_norm.eps)
        return kernels.rope_store_kv(qkv, cos, sin, heads, kv_heads, pool, slots)
    qkv = qkv.view(-1, heads + 2 * kv_heads, dim)
    k = apply_rope(attn.k_norm(qkv[:, heads:heads + kv_heads]), cos, sin)
    if pool is not None:
        write_kv(pool, k, qkv[:, heads + kv_heads:], slots)
    return apply_rope(attn.q_norm(qkv[:, :heads]), cos, sin), k


def expected_tensors(fmt: DFlashFormat) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape."""
    a = fmt.arch
    h = a.hidden_size
    out = {"fc.weight": (h, len(fmt.feature_layers) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(a.num_layers):
        out.update(layer_tensors(f"layers.{i}", a, h))
    return out


class DFlashDrafter(nn.Module):
    is_standalone = True
    reuses_draft_kv = False

    def __init__(self, fmt: DFlashFormat, target: CausalLM, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        a, dev = fmt.arch, ctx.device
        h, eps = a.hidden_size, a.rms_norm_eps
        self.fmt, self.feature_layers = fmt, fmt.feature_layers
        self.block_size, self.mask_token_id = fmt.block_size, fmt.mask_token_id
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, dev)
        self.target = [target]  # a list so the target's modules are not registered twice
        self.fc = ReplicatedLinear(len(fmt.feature_layers) * h, h, dtype, dev)
        self.hidden_norm = RMSNorm(h, eps, dtype, dev)
        self.layers = nn.ModuleList(DecoderLayer(a, i, ctx, dtype) for i in range(a.num_layers))
        self.norm = RMSNorm(h, eps, dtype, dev)
        self.kv_layout = KVLayout(a.num_layers, self.layers[0].self_attn.num_local_kv_heads, a.head_dim)

    @torch.no_grad()
    def load(self, reader) -> None:
        check_tensors(reader, expected_tensors(self.fmt), reader.dir)
        self.fc.load(reader, "fc.weight")
        self.hidden_norm.load(reader, "hidden_norm.weight")
        self.norm.load(reader, "norm.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"layers.{i}")

    @staticmethod
    def _write_context(layer: DecoderLayer, context: torch.Tensor, cos, sin, pool, slots) -> None:
        """K/V of the injected context through this layer's own k/v projections."""
        attn = layer.self_attn
        q_size = attn.qkv.out_sizes[0]
        bias = attn.qkv.bias[q_size:] if attn.qkv.bias is not None else None
        _rotated(attn, linear(context, attn.qkv.weight[q_size:], bias), 0, cos, sin, pool, slots)

    @staticmethod
    def _layer(layer: DecoderLayer, x: torch.Tensor, cos, sin, pool, tables, context_lens, max_context,
               keep: slice | None = None, is_first: bool = False):
        """One Qwen3 layer on the query block; its K/V stay in the step. ``keep``: the block slots
        whose outputs are wanted (the last layer's): every slot's K/V is still computed, but the
        queries, o_proj and MLP run on the kept rows only, as each of those is row by row.
        ``is_first``: x is the embedded block, whose rows after each sequence's first are all the
        mask token's: q/k/v are projected from two rows a sequence and repeated before RoPE (each
        row of small_gemm is computed alone, so these are the bits of all n rows)."""
        attn, num_seqs = layer.self_attn, tables.shape[0]
        heads, kv_heads, dim = attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim
        if is_first:
            n = x.shape[0] // num_seqs
            two = attn.qkv(layer.input_layernorm(x.view(num_seqs, n, -1)[:, :2].reshape(2 * num_seqs, -1)))
            two = two.view(num_seqs, 2, -1)
            qkv = torch.cat([two[:, :1], two[:, 1:].expand(-1, n - 1, -1)], dim=1).view(num_seqs * n, -1)
        else:
            qkv = attn.qkv(layer.input_layernorm(x))
        q, k = _rotated(attn, qkv, heads, cos, sin)
        if keep is not None:
            rows = torch.arange(x.shape[0], device=x.device).view(num_seqs, -1)[:, keep].reshape(-1)
            q, x = q[rows], x[rows]
        v = qkv.view(-1, heads + 2 * kv_heads, dim)[:, heads + kv_heads:]
        o = context_block_attention(q, k, v, pool, tables, context_lens, max_context, attn.scale)
        x = x + attn.o_proj(o.reshape(o.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """z-lab's compute_logits: the target's head, scaled and optionally soft-capped."""
        logits = self.target[0].logits(normed)
        if self.fmt.output_multiplier != 1.0:
            logits = logits * self.fmt.output_multiplier
        cap = self.fmt.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def _write_context_all(self, batch: DraftBatch, lens: list[int], features: torch.Tensor):
        """Every layer's K/V of the context at positions consumed + [0, lens[i]) from the target's
        features there; returns that context's metadata (its block tables serve the block)."""
        seqs = batch.seqs
        positions, meta = build_metadata([s.block_table for s in seqs], batch.block_size,
                                         [s.num_consumed for s in seqs], lens, batch.device)
        cos, sin = self.rotary(positions, max(meta.context_lens_list))
        context = self.hidden_norm(self.fc(features))
        for layer, pool in zip(self.layers, batch.pools):
            self._write_context(layer, context, cos, sin, pool, meta.slot_mapping)
        return meta

    def catch_up(self, batch: DraftBatch) -> None:
        """The context's K/V at positions [consumed, L - 2) of each sequence, drafting nothing
        (common.catch_up_rows)."""
        _, lens, _, features = catch_up_rows(batch)
        self._write_context_all(batch, lens, features)

    def block_outputs(self, batch: DraftBatch, keep: slice = slice(None)) -> torch.Tensor:
        """Writes the new context's K/V; returns the query block's normed outputs at the slots
        ``keep`` selects [S, slots kept, H] (the last layer computes no other slot's output)."""
        seqs, n, dev = batch.seqs, self.block_size, batch.device
        ctx_meta = self._write_context_all(batch, [len(s.tokens) - 1 - s.num_consumed for s in seqs],
                                           torch.cat([s.features for s in seqs]))
        starts = [len(s.tokens) - 1 for s in seqs]
        positions = torch.tensor([p for start in starts for p in range(start, start + n)], device=dev)
        cos, sin = self.rotary(positions, max(starts) + n)
        ids = torch.tensor([t for s in seqs for t in [s.tokens[-1]] + [self.mask_token_id] * (n - 1)], device=dev)
        x = self.target[0].embed_tokens(ids)
        if self.fmt.input_embedding_scale != 1.0:
            x = x * self.fmt.input_embedding_scale
        context_lens = torch.tensor(starts, device=dev)  # positions [0, L - 1) are context
        last = len(self.layers) - 1
        for i, (layer, pool) in enumerate(zip(self.layers, batch.pools)):
            x = self._layer(layer, x, cos, sin, pool, ctx_meta.block_tables, context_lens, max(starts),
                            keep if i == last else None, is_first=i == 0)
        return self.norm(x).view(len(seqs), -1, x.shape[-1])

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        k, num_seqs = batch.k, len(batch.seqs)
        masks = self.block_outputs(batch, slice(1, k + 1))  # slot 0 (t_{L-1}) drafts nothing
        logits = self.logits(masks.reshape(num_seqs * k, -1)).view(num_seqs, k, -1)
        return torch.stack([choose(logits[:, j], j) for j in range(k)], dim=1)
