"""specray's small-row CPU GEMM kernel against torch, and the fallback without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specray.models import layers
from specray.models.cpu_gemm import load_small_gemm

small_gemm = load_small_gemm()
needs_kernel = pytest.mark.skipif(small_gemm is None, reason="no C compiler on this machine")


@needs_kernel
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n, k", [(64, 64), (33, 100), (1, 17), (130, 1024)])  # odd N, K off the 16-lane grid
@pytest.mark.parametrize("has_bias", [False, True])
def test_small_gemm_matches_torch(rows, n, k, has_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    # Tolerance: the kernel sums 16 lanes then the lanes (float32), BLAS in its own order;
    # for |x|, |w| ~ 1 and k <= 1024 the two agree to a few float32 ulps of sqrt(k).
    torch.testing.assert_close(small_gemm(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_small_gemm_is_bitwise_the_same_at_any_thread_count():
    # every rank computing the same replicated product must get the same bits
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 1024, generator=gen), torch.randn(1000, 1024, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm(x, w, None)
        torch.set_num_threads(2)
        two = small_gemm(x, w, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_small_gemm_rejects_too_many_rows():
    with pytest.raises(ValueError, match=r"takes 1..8 rows, not 9"):
        small_gemm(torch.randn(9, 16), torch.randn(4, 16), None)


def test_linear_falls_back_to_torch_without_the_kernel(monkeypatch):
    monkeypatch.setattr(layers, "load_small_gemm", lambda: None)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    torch.testing.assert_close(layers.linear(x, w, None, None), F.linear(x, w))


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_KERNELS", "0")
    load_small_gemm.cache_clear()
    try:
        assert load_small_gemm() is None
    finally:
        monkeypatch.delenv("SPECRAY_CPU_KERNELS")
        load_small_gemm.cache_clear()
