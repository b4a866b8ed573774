"""Paged attention over a KV pool (torch on CPU, any device torch runs on).

A pool layer is a tensor ``[num_blocks, 2, kv_heads, tokens_per_block, head_dim]``; token
``t`` of a sequence lives in block ``block_table[t // B]`` at offset ``t % B``. The caller
writes the step's new K/V through ``slot_mapping`` (``block * B + offset`` per new token)
with ``write_kv``, then calls a kernel, which attends each query to every cached token of
its sequence up to its own position.

Callers must pass, per sequence, the number of new tokens (``query_lens``) and the total
length after this step (``context_lens``); the new tokens are the last ``query_len`` ones.
Kernels take ``(q, k, v, pool, meta, scale)``: ``k`` and ``v`` are the step's new keys and
values, already in the pool; a kernel may read them instead of the pool where a sequence
has nothing cached before this step (a whole prompt).

The pool is zeroed when allocated, so slots past a sequence's length always hold finite
values (zeros or stale K/V of a finished sequence): batched kernels read whole pages and
mask by length, and a masked finite value contributes exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    context_lens_list: list[int] = field(default_factory=list)  # context_lens as ints (filled if empty)

    def __post_init__(self) -> None:
        if not self.context_lens_list:
            self.context_lens_list = self.context_lens.tolist()

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ([N, kv_heads, head_dim]) into their slots of one pool layer."""
    block_size = pool.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    pool[blocks, 0, :, offsets] = k
    pool[blocks, 1, :, offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim] (already rotated); returns [N, heads, head_dim].

    Whole prompts (causal, nothing cached before them) attend to their own fresh k/v with
    SDPA's causal kernel, one call per prompt; every other sequence (decode, verify,
    a dflash block) is served by one batched call over pages gathered from the pool."""
    lens, ctx = meta.query_lens, meta.context_lens_list
    is_prompt = [meta.causal and n == c for n, c in zip(lens, ctx)]
    if not any(is_prompt):
        return _attend_cached(q, pool, meta.block_tables, ctx, lens, meta.causal, scale)
    out = torch.empty_like(q)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    cached = [i for i, p in enumerate(is_prompt) if not p]
    for i in (i for i, p in enumerate(is_prompt) if p):
        s, e = starts[i], starts[i + 1]
        out[s:e] = _attend_fresh(q[s:e], k[s:e], v[s:e], scale)
    if cached:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in cached]).to(q.device)
        out[rows] = _attend_cached(q[rows], pool, meta.block_tables[cached], [ctx[i] for i in cached],
                                   [lens[i] for i in cached], True, scale)
    return out


def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One whole prompt, causal, from its own k/v ([n, heads or kv_heads, dim])."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=q.shape[0] > 1, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _attend_cached(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, context_lens: list[int],
                   query_lens: list[int], causal: bool, scale: float) -> torch.Tensor:
    """Every sequence at once: gather the pages of all of them (one index_select per K and V),
    pad the queries to the longest, mask by length (and position when causal)."""
    num_seqs, n, length = len(query_lens), max(query_lens), max(context_lens)
    kv_heads, block_size, dim = pool.shape[2], pool.shape[3], pool.shape[4]
    heads = q.shape[1]
    group = heads // kv_heads
    used = -(-length // block_size)
    index = block_tables[:, :used].reshape(-1)
    keys = used * block_size

    def gather(half: int) -> torch.Tensor:  # [S, kv_heads, used * B, dim]
        pages = pool[:, half].index_select(0, index).view(num_seqs, used, kv_heads, block_size, dim)
        return pages.transpose(1, 2).reshape(num_seqs, kv_heads, keys, dim)

    k, v = gather(0), gather(1)
    is_uniform = all(m == n for m in query_lens)
    if is_uniform:
        qp = q.view(num_seqs, n, heads, dim)
    else:
        qp = q.new_zeros(num_seqs, n, heads, dim)
        qp[_padded_rows(query_lens, n, q.device)] = q
    # query i of sequence s sits at position ctx_s - n_s + i (padded rows: at or past ctx_s)
    dev = q.device
    ctx = torch.tensor(context_lens, device=dev)
    key_pos = torch.arange(keys, device=dev)
    mask = key_pos[None, None, :] < ctx[:, None, None]  # [S, 1, keys]
    if causal:
        query_pos = ctx[:, None] - torch.tensor(query_lens, device=dev)[:, None] + torch.arange(n, device=dev)
        mask = mask & (key_pos[None, None, :] <= query_pos[:, :, None])  # [S, n, keys]
    # GQA without repeating K/V: the group's queries of one kv head are rows of one matmul
    qg = qp.view(num_seqs, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, group * n, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(num_seqs, kv_heads, group, n, keys)
    scores = scores.float().mul_(scale).masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_seqs, kv_heads, group * n, keys)
    o = torch.matmul(probs, v).view(num_seqs, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_seqs, n, heads, dim)
    return o.reshape(-1, heads, dim) if is_uniform else o[_padded_rows(query_lens, n, q.device)]


def _padded_rows(query_lens: list[int], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row) of every real query in a [S, n] padded layout."""
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=device), torch.tensor(query_lens, device=device))
    row = torch.cat([torch.arange(m, device=device) for m in query_lens])
    return seq, row
