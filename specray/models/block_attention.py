"""Block-decode attention: the kernel the standalone drafters run.

It attends a block of queries (one draft token, or DFlash's [last token, mask x k]) to a
sequence's K/V. Where specray's C kernels serve (float32 on CPU), it is the target's paged
attention (pages read in place, whole prompts through SDPA). Elsewhere torch ops work in fixed
64-token tiles, flash-decoding style: each tile computes its own max, sum and weighted
values, and the tiles are combined at the end. A tile is one or two whole pages, so the
pool's page size must be 32 or 64 (see the capability below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.models.attention import AttentionMetadata, paged_attention, query_layout, use_cpu_kernel

TILE_TOKENS = 64
# Kernel capability: the tile path views whole pages as 64-token tiles, so a page must divide
# 64 (pages over 64 would split across tiles, which the tile view does not do). It declares
# 32 and 64, the sizes it is tested at: below 32 a tile needs four or more page lookups,
# and the drafter falls back to 32-token pages instead (kv/page_size.py). The C path would
# take any page, but whether it serves depends on the rank (a compiler, the dtype), and the
# pages are agreed across ranks, so the capability is the tile path's.
BLOCK_DECODE_PAGE_SIZES = frozenset({32, 64})


def block_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim]; pool: [blocks, 2, kv_heads, B, head_dim]; returns [N, heads, head_dim].
    Reads every key from the pool (``k``/``v``, the step's new ones, are already there).
    All sequences run in one batch: tiles past a sequence's length are masked out."""
    block_size = pool.shape[3]
    if block_size not in BLOCK_DECODE_PAGE_SIZES:
        raise ValueError(f"block-decode attention takes pages of {sorted(BLOCK_DECODE_PAGE_SIZES)} tokens, "
                         f"not {block_size}")
    if use_cpu_kernel(q, pool) is not None:  # the C kernel for cached rows, SDPA for whole prompts
        return paged_attention(q, k, v, pool, meta, scale)
    plan = meta.derived.get(("tiles", block_size))
    if plan is None:
        plan = meta.derived[("tiles", block_size)] = _TilePlan.build(meta, block_size, q.device)
    num_seqs, n, num_tiles = plan.num_seqs, plan.n, plan.num_tiles
    kv_heads, dim, heads = pool.shape[2], pool.shape[4], q.shape[1]
    group = heads // kv_heads
    pages = pool.index_select(0, plan.index)  # [S * tiles * pages_per_tile, 2, kv_heads, B, dim]
    kv = pages.view(num_seqs, -1, 2, kv_heads, block_size, dim).permute(2, 0, 3, 1, 4, 5)
    kv = kv.reshape(2, num_seqs, kv_heads, num_tiles, TILE_TOKENS, dim).float()
    if plan.padded is None:
        qp = q.view(num_seqs, n, heads, dim)
    else:
        qp = q.new_zeros(num_seqs, n, heads, dim)
        qp[plan.padded] = q
    qg = qp.view(num_seqs, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).float()  # [S, kv, g, n, dim]
    scores = torch.einsum("skgnd,sktjd->skgntj", qg, kv[0]) * scale
    scores.masked_fill_(plan.hidden[:, None, None], float("-inf"))  # [S, kv, g, n, tiles, 64]
    # each tile: its own max, sum and weighted values; a tile with no visible key adds nothing
    tile_max = scores.amax(-1)  # [S, kv, g, n, tiles]
    overall = tile_max.amax(-1, keepdim=True)  # every query sees at least one key: finite
    tile_max = torch.where(torch.isfinite(tile_max), tile_max, overall)
    p = torch.exp(scores - tile_max[..., None])
    tile_out = torch.einsum("skgntj,sktjd->skgntd", p, kv[1])
    # combine the tiles: rescale each by exp(its max - the overall max)
    weight = torch.exp(tile_max - overall)
    o = (tile_out * weight[..., None]).sum(-2) / (p.sum(-1) * weight).sum(-1, keepdim=True)
    o = o.permute(0, 3, 1, 2, 4).reshape(num_seqs, n, heads, dim).to(q.dtype)
    return o.reshape(-1, heads, dim) if plan.padded is None else o[plan.padded]


@dataclass(slots=True)
class _TilePlan:
    """The step's tiles: which pages to load and which keys each query sees (built once per
    step, shared by the layers)."""

    index: torch.Tensor  # [S * tiles * pages_per_tile] pages, padded with page 0 past a table
    num_seqs: int
    n: int  # queries per sequence, padded to the longest
    num_tiles: int
    padded: tuple[torch.Tensor, torch.Tensor] | None  # (sequence, row) of each real query
    hidden: torch.Tensor  # [S, 1 or n, tiles, 64]: keys a query must not see

    @staticmethod
    def build(meta: AttentionMetadata, block_size: int, device: torch.device) -> _TilePlan:
        lens, ctx = meta.query_lens, meta.context_lens_list
        num_seqs, n = len(lens), max(lens)
        num_tiles = -(-max(ctx) // TILE_TOKENS)
        wanted = num_tiles * (TILE_TOKENS // block_size)
        tables = meta.block_tables[:, :wanted]
        if tables.shape[1] < wanted:  # the last tile may reach past every table: pad, then mask
            tables = torch.cat([tables, tables.new_zeros(num_seqs, wanted - tables.shape[1])], dim=1)
        padded, visible = query_layout(lens, ctx, meta.causal, num_tiles * TILE_TOKENS, device)
        hidden = ~visible.view(num_seqs, -1, num_tiles, TILE_TOKENS)
        return _TilePlan(tables.reshape(-1), num_seqs, n, num_tiles, padded, hidden)
