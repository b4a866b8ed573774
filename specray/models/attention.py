"""Paged attention over a KV pool (torch on CPU, any device torch runs on).

A pool layer is a tensor ``[num_blocks, 2, kv_heads, tokens_per_block, head_dim]``; token
``t`` of a sequence lives in block ``block_table[t // B]`` at offset ``t % B``. The kernel
writes the step's new K/V through ``slot_mapping`` (``block * B + offset`` per new token),
then attends each query to every cached token of its sequence up to its own position.

Callers must pass, per sequence, the number of new tokens (``query_lens``) and the total
length after this step (``context_lens``); the new tokens are the last ``query_len`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Kernel capability: the page sizes this kernel accepts. It gathers whole pages with an
# index and masks by length, so any power of two works; powers of two keep the slot
# arithmetic (t // B, t % B) to shifts and match the configured range.
PAGED_ATTENTION_PAGE_SIZES = frozenset(2**i for i in range(3, 9))


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [S] int64: tokens in the cache after this step
    query_lens: list[int]  # new tokens per sequence, summing to N
    causal: bool = True

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ([N, kv_heads, head_dim]) into their slots of one pool layer."""
    block_size = pool.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    pool[blocks, 0, :, offsets] = k
    pool[blocks, 1, :, offsets] = v


def _gather(pool_kv: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[kv_heads, length, head_dim] for one sequence from one half (K or V) of a layer."""
    pages = pool_kv[block_table]  # [blocks, kv_heads, B, head_dim]
    heads, dim = pages.shape[1], pages.shape[3]
    return pages.transpose(0, 1).reshape(heads, -1, dim)[:, :length]


def paged_attention(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim] (already rotated); returns [N, heads, head_dim]."""
    if meta.is_decode and meta.causal:
        return _decode_attention(q, pool, meta, scale)
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(meta.query_lens):
        length = int(meta.context_lens[i])
        num_blocks = -(-length // pool.shape[3])
        table = meta.block_tables[i, :num_blocks]
        k = _gather(pool[:, 0], table, length)
        v = _gather(pool[:, 1], table, length)
        qi = q[start:start + n].transpose(0, 1)  # [heads, n, dim]
        mask, is_causal = None, False
        if meta.causal and n == length:  # a whole prompt: the plain causal mask, which
            is_causal = n > 1  # lets SDPA take its fused kernel instead of the masked path
        elif meta.causal and n > 1:
            # query j sits at position length - n + j and sees keys up to it
            pos = torch.arange(length - n, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                           enable_gqa=True)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out


def _decode_attention(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One new token per sequence: gather every sequence's pages at once, mask by length."""
    num_seqs, max_blocks = meta.block_tables.shape
    block_size = pool.shape[3]
    length = int(meta.context_lens.max())
    used = -(-length // block_size)
    tables = meta.block_tables[:, :used]
    k = pool[tables, 0]  # [S, used, kv_heads, B, dim]
    v = pool[tables, 1]
    heads, dim = k.shape[2], k.shape[4]
    k = k.transpose(1, 2).reshape(num_seqs, heads, used * block_size, dim)[:, :, :length]
    v = v.transpose(1, 2).reshape(num_seqs, heads, used * block_size, dim)[:, :, :length]
    mask = torch.arange(length, device=q.device)[None, :] < meta.context_lens[:, None]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :]
