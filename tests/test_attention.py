"""The paged-attention kernel against dense attention over each sequence's contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_build import built_kernels

from specray.models import cpu_kernels
from specray.models.attention import AttentionMetadata, paged_attention, write_kv

KV_HEADS, HEADS, DIM = 2, 4, 16


def _reference(q, keys, values, query_len: int, causal: bool) -> torch.Tensor:
    """Dense attention of one sequence's last ``query_len`` queries to its ``len(keys)`` keys."""
    length = keys.shape[0]
    pos = torch.arange(length - query_len, length)
    mask = torch.arange(length)[None, :] <= pos[:, None] if causal else None
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                       attn_mask=mask, scale=0.25, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("query_lens, cached_lens", [
    ([1, 1, 1], [4, 30, 70]),  # decode
    ([4, 4], [9, 64]),  # verify rows of equal length
    ([2, 5, 1], [0, 17, 40]),  # a whole prompt next to cached sequences of uneven query lengths
    ([7, 3], [0, 0]),  # whole prompts only
])
def test_paged_attention_matches_dense(block_size, causal, query_lens, cached_lens, use_kernels, monkeypatch):
    kernels = built_kernels() if use_kernels else None  # None: the torch path that serves without them
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    _check_against_dense(block_size, causal, query_lens, cached_lens, DIM)


@pytest.mark.parametrize("dim", [16, 24, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("query_lens, cached_lens", [
    ([1, 1], [700, 33]),  # many key tiles, and a last tile the context only partly fills
    ([12, 3], [290, 1]),  # 24 queries of one kv head: more than one query block of the C kernel
])
def test_c_kernel_tiles_and_query_blocks(dim, causal, query_lens, cached_lens, monkeypatch):
    """The C kernel's edges: key tiles of 16 (a causal query sees part of a tile), blocks of
    16 queries per kv head, and head sizes that are not a multiple of its 16-float vectors."""
    kernels = built_kernels()
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    _check_against_dense(16, causal, query_lens, cached_lens, dim)


def _check_against_dense(block_size, causal, query_lens, cached_lens, dim):
    gen = torch.Generator().manual_seed(block_size + dim)
    lengths = [c + n for c, n in zip(cached_lens, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    pool = torch.zeros(num_blocks, 2, KV_HEADS, block_size, dim)
    perm = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # scattered pages, block 0 unused
    tables, keys, values = [], [], []
    for length in lengths:
        tables.append([perm.pop() for _ in range(-(-length // block_size))])
        keys.append(torch.randn(length, KV_HEADS, dim, generator=gen))
        values.append(torch.randn(length, KV_HEADS, dim, generator=gen))
    pool[0].normal_(generator=gen)  # the padding page holds finite garbage, which the mask must hide
    # cache the earlier tokens, then write this step's ones as the model does
    for table, k, v, cached in zip(tables, keys, values, cached_lens):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(cached)],
                             dtype=torch.int64)
        write_kv(pool, k[:cached], v[:cached], slots)
    width = max(len(t) for t in tables)
    new_slots = torch.tensor([table[t // block_size] * block_size + t % block_size
                              for table, c, n in zip(tables, cached_lens, query_lens) for t in range(c, c + n)])
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(slot_mapping=new_slots, block_tables=block_tables, context_lens=torch.tensor(lengths),
                             query_lens=query_lens, causal=causal)
    new_k = torch.cat([k[c:] for k, c in zip(keys, cached_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(values, cached_lens)])
    write_kv(pool, new_k, new_v, new_slots)
    q = torch.randn(sum(query_lens), HEADS, dim, generator=gen)

    out = paged_attention(q, new_k, new_v, pool, meta, 0.25)

    starts = torch.tensor([0] + query_lens).cumsum(0).tolist()
    expected = torch.cat([_reference(q[s:e], k, v, e - s, causal)
                          for s, e, k, v in zip(starts, starts[1:], keys, values)])
    # Tolerance: the batched path sums the same products in a different order (matmul, then
    # a float32 softmax) than SDPA; both are float32, so they agree to rounding (~1e-6).
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
