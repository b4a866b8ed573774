"""Block-decode attention: the kernel the standalone drafters run.

It attends a block of queries (one draft token, or DFlash's [last token, mask x k]) to a
sequence's cached K/V in fixed 64-token tiles, flash-decoding style: each tile computes its
own max, sum and weighted values, and the tiles are combined at the end. A tile is loaded
from at most two pages, so the pool's page size must be 32 or 64.
"""

from __future__ import annotations

import torch

from specray.models.attention import AttentionMetadata

TILE_TOKENS = 64
# Kernel capability: a 64-token tile must be one page or two whole pages. Pages under 32
# would need more page-table lookups per tile than the kernel holds; pages over 64 would
# split a page across tiles, which its offset arithmetic does not do.
BLOCK_DECODE_PAGE_SIZES = frozenset({32, 64})


def block_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim]; pool: [blocks, 2, kv_heads, B, head_dim]; returns [N, heads, head_dim].
    Reads every key from the pool (``k``/``v``, the step's new ones, are already there)."""
    block_size = pool.shape[3]
    if block_size not in BLOCK_DECODE_PAGE_SIZES:
        raise ValueError(f"block-decode attention takes pages of {sorted(BLOCK_DECODE_PAGE_SIZES)} tokens, "
                         f"not {block_size}")
    pages_per_tile = TILE_TOKENS // block_size
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(meta.query_lens):
        length = int(meta.context_lens[i])
        num_tiles = -(-length // TILE_TOKENS)
        table = meta.block_tables[i]
        wanted = num_tiles * pages_per_tile
        if table.numel() < wanted:  # the last tile may reach past the table: pad, then mask
            table = torch.cat([table, table.new_zeros(wanted - table.numel())])
        out[start:start + n] = _attend_tiles(q[start:start + n], pool, table[:wanted], length, n, meta.causal, scale)
        start += n
    return out


def _attend_tiles(q, pool, table, length: int, n: int, causal: bool, scale: float) -> torch.Tensor:
    kv_heads, dim = pool.shape[2], pool.shape[4]
    heads = q.shape[1]
    group = heads // kv_heads
    pages = pool[table]  # [tiles * pages_per_tile, 2, kv_heads, B, dim]
    kv = pages.transpose(0, 2).reshape(kv_heads, 2, -1, TILE_TOKENS, dim)  # [kv_heads, 2, tiles, 64, dim]
    k, v = kv[:, 0], kv[:, 1]
    qg = q.transpose(0, 1).reshape(kv_heads, group, n, dim).float()
    scores = torch.einsum("hgnd,htkd->hgntk", qg, k.float()) * scale
    key_pos = torch.arange(k.shape[1] * TILE_TOKENS, device=q.device).view(-1, TILE_TOKENS)
    visible = key_pos < length  # [tiles, 64]
    if causal:
        query_pos = torch.arange(length - n, length, device=q.device)
        visible = visible[None] & (key_pos[None] <= query_pos[:, None, None])  # [n, tiles, 64]
    scores = scores.masked_fill(~visible, float("-inf"))
    tile_max = scores.amax(-1, keepdim=True)
    tile_max = torch.where(torch.isfinite(tile_max), tile_max, torch.zeros_like(tile_max))
    p = torch.exp(scores - tile_max)
    tile_sum = p.sum(-1)  # [h, g, n, tiles]
    tile_out = torch.einsum("hgntk,htkd->hgntd", p, v.float())
    # combine tiles: rescale each by exp(its max - the overall max)
    overall = tile_max.squeeze(-1).amax(-1, keepdim=True)
    weight = torch.exp(tile_max.squeeze(-1) - overall)
    o = (tile_out * weight[..., None]).sum(-2) / (tile_sum * weight).sum(-1, keepdim=True)
    return o.reshape(heads, n, dim).transpose(0, 1).to(q.dtype)
