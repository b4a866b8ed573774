"""The drafters' block-decode kernel (its C path and its tile path) against the torch path
of the paged-attention kernel, which test_attention.py checks against dense attention."""

from __future__ import annotations

import pytest
import torch
from kernel_build import built_kernels

from specray.models import cpu_kernels
from specray.models.attention import AttentionMetadata, paged_attention
from specray.models.block_attention import block_decode_attention


def _case(block_size: int, lengths: list[int], query_lens: list[int], causal: bool):
    gen = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 2, 4, 16
    blocks_per_seq = [-(-n // block_size) + 1 for n in lengths]
    pool = torch.randn(sum(blocks_per_seq) + 1, 2, kv_heads, block_size, dim, generator=gen)
    perm = torch.randperm(pool.shape[0], generator=gen).tolist()  # scattered, non-contiguous pages
    tables, used = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(lengths), query_lens=query_lens, causal=causal)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    return q, pool, meta


@pytest.mark.parametrize("use_kernels", [True, False], ids=["c-kernel", "tiles"])
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_block_decode_matches_paged_attention(block_size, causal, use_kernels, monkeypatch):
    q, pool, meta = _case(block_size, lengths=[5, 64, 130, 200], query_lens=[1, 4, 8, 3], causal=causal)
    kernels = built_kernels() if use_kernels else None  # None: the torch tiles
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    out = block_decode_attention(q, None, None, pool, meta, 0.25)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)  # the reference: torch's gather path
    meta.derived.clear()
    expected = paged_attention(q, None, None, pool, meta, 0.25)
    # Tolerance: the kernels sum in float32 in different orders (per 64-token tile and
    # rescaled, one online pass, or one softmax): they agree to float32 rounding (~1e-6),
    # far below any indexing error.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 128])
def test_block_decode_rejects_other_page_sizes(block_size):
    q, pool, meta = _case(block_size, lengths=[5], query_lens=[1], causal=True)
    with pytest.raises(ValueError, match=rf"takes pages of \[32, 64\] tokens, not {block_size}"):
        block_decode_attention(q, None, None, pool, meta, 0.25)
