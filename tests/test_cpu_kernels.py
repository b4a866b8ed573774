"""specray's CPU kernels against torch, and the fallbacks without them."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from kernel_build import built_kernels, no_compiler_reason

from specray.models import cpu_kernels, layers
from specray.models.cpu_kernels import load_cpu_kernels, prune_stale_builds


@pytest.fixture(scope="module")
def kernels():
    """Skipped only without a C compiler; a failed build with one fails every test that uses it."""
    return built_kernels()


ODD_SHAPES = [(64, 64), (33, 100), (1, 17), (130, 1024), (7, 15), (67, 577)]  # N, K off the vector widths


@pytest.mark.parametrize("rows", [*range(1, 10), 16, 17, 31, 32])
@pytest.mark.parametrize("n, k", ODD_SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_small_gemm_matches_torch(rows, n, k, has_bias, kernels):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    # Tolerance: the kernel sums 16 lanes then the lanes (float32), BLAS in its own order;
    # for |x|, |w| ~ 1 and k <= 1024 the two agree to a few float32 ulps of sqrt(k).
    torch.testing.assert_close(kernels.small_gemm(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n, k", ODD_SHAPES + [(49152 // 3, 576)])  # and SmolLM2's LM head shard
def test_the_batch_1_gemv_matches_torch_mv(n, k, kernels):
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(k, generator=gen), torch.randn(n, k, generator=gen)
    # Tolerance: as above, two float32 summation orders of k products
    torch.testing.assert_close(kernels.small_gemm(x[None], w, None)[0], torch.mv(w, x), rtol=1e-5, atol=1e-4)


def test_a_row_gets_the_same_bits_alone_as_in_a_batch(kernels):
    # every row count sums each output in the same order: batching never changes a greedy token
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(kernels.max_rows, 577, generator=gen), torch.randn(131, 577, generator=gen)
    batched = kernels.small_gemm(x, w, None)
    for rows in (1, 3, 5, 8, 9, kernels.max_rows):
        assert torch.equal(kernels.small_gemm(x[:rows], w, None), batched[:rows]), rows


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 33, 128])  # around the 6-row passes
@pytest.mark.parametrize("n, k", ODD_SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_panel_gemm_matches_torch(rows, n, k, has_bias, kernels):
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    # Tolerance: the kernel sums the k products in order, BLAS in blocks: float32, as above
    torch.testing.assert_close(kernels.panel_gemm(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 8, 32, 33, 128])
def test_linear_takes_the_kernels_at_every_row_count(rows, monkeypatch, kernels):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    calls = []
    for name in ("small_gemm", "panel_gemm"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert calls == ["small_gemm" if rows <= kernels.max_rows else "panel_gemm"]


# 8 rows; one row above and below the 1.5 MiB under which the batch-1 GEMV keeps to one thread
@pytest.mark.parametrize("rows, n, k", [(8, 1000, 1024), (1, 700, 577), (1, 131, 577)])
def test_small_gemm_is_bitwise_the_same_at_any_thread_count(rows, n, k, kernels):
    # every rank computing the same replicated product must get the same bits
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.small_gemm(x, w, None)
        torch.set_num_threads(2)
        two = kernels.small_gemm(x, w, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


# rows of w per pass, software prefetch (0 none, 1 into L1, 2 into L2), 8-float halves (2: in chunks of K)
PLANS = [(c, pf, 0) for c in (1, 2, 4) for pf in (0, 1, 2)] + [(1, pf, h) for pf in (0, 1, 2) for h in (1, 2)]


@pytest.mark.parametrize("n, k", [(1, 17), (67, 577), (130, 1024), (49152 // 3, 576)])
@pytest.mark.parametrize("rows_of_w, prefetch, halves", PLANS)
def test_every_gemv_plan_matches_torch_mv(n, k, rows_of_w, prefetch, halves, kernels):
    gen = torch.Generator().manual_seed(n * 3 + k)
    x, w = torch.randn(k, generator=gen), torch.randn(n, k, generator=gen)
    y = kernels.small_gemm_plan(x[None], w, None, rows_of_w, prefetch, 2, halves)[0]
    # Tolerance: two float32 summation orders of k products, as above
    torch.testing.assert_close(y, torch.mv(w, x), rtol=1e-5, atol=1e-4)


def test_every_plan_thread_count_and_row_count_gives_the_same_bits(kernels):
    # the plan is a per-shape speed choice: it must never change a bit (verify = decode)
    gen = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(9, 579, generator=gen), torch.randn(133, 579, generator=gen), torch.randn(133, generator=gen)
    reference = kernels.small_gemm(x[:1], w, b)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for plan in PLANS:
                for rows in (1, 2, 4, 6, 8, 9):
                    y = kernels.small_gemm_plan(x[:rows], w, b, *plan[:2], t, plan[2])
                    assert torch.equal(y[:1], reference), (t, plan, rows)
                    assert torch.equal(y, kernels.small_gemm(x[:rows], w, b)), (t, plan, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("plans", ["first", "before verify work"])
def test_the_old_plans_give_the_same_bits(plans, kernels):
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(8, 1536, generator=gen), torch.randn(577, 1536, generator=gen)
    new = [kernels.small_gemm(x[:rows], w, None) for rows in (1, 4, 6, 8)]
    kernels.use_gemv_plans(plans)
    try:
        old = [kernels.small_gemm(x[:rows], w, None) for rows in (1, 4, 6, 8)]
    finally:
        kernels.use_gemv_plans("tuned")
    assert all(torch.equal(a, b) for a, b in zip(new, old))
    assert all(torch.equal(a[:1], new[0]) for a in new)  # a verify row = the decode step's row


def test_unknown_gemv_plans_are_rejected(kernels):
    with pytest.raises(ValueError, match="gemv plans must be one of .*'tuned'.*, not 'fast'"):
        kernels.use_gemv_plans("fast")


@pytest.mark.parametrize("rows_of_w, prefetch, threads, halves", [(3, 0, 1, 0), (0, 0, 1, 0), (1, 0, 0, 0),
                                                                  (1, 3, 1, 0), (2, 0, 1, 1), (1, 0, 1, 3)])
def test_a_bad_gemv_plan_is_rejected(rows_of_w, prefetch, threads, halves, kernels):
    with pytest.raises(ValueError, match=f"not {rows_of_w}, {prefetch}, {threads} and {halves}"):
        kernels.small_gemm_plan(torch.randn(1, 16), torch.randn(4, 16), None, rows_of_w, prefetch, threads, halves)


def test_small_gemm_rejects_too_many_rows(kernels):
    with pytest.raises(ValueError, match=rf"takes 1..{kernels.max_rows} rows, not {kernels.max_rows + 1}"):
        kernels.small_gemm(torch.randn(kernels.max_rows + 1, 16), torch.randn(4, 16), None)


@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 1024), (3, 100)])
def test_rms_norm_matches_the_torch_formula(rows, dim, monkeypatch, kernels):
    gen = torch.Generator().manual_seed(dim)
    x, weight = torch.randn(rows, dim, generator=gen), torch.randn(dim, generator=gen)
    norm = layers.RMSNorm(dim, 1e-6, torch.float32, torch.device("cpu"))
    norm.weight.data.copy_(weight)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)  # the layer takes the C path
    fused = norm(x)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)
    # Tolerance: the kernel sums squares in 16 lanes and uses 1/sqrtf, torch reduces in its
    # own order and uses rsqrt; both are float32 and agree to a few ulps.
    torch.testing.assert_close(fused, norm(x), rtol=1e-6, atol=1e-6)


def test_linear_falls_back_to_torch_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    torch.testing.assert_close(layers.linear(x, w, None), F.linear(x, w))


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_KERNELS", "0")
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
    finally:
        monkeypatch.delenv("SPECRAY_CPU_KERNELS")
        load_cpu_kernels.cache_clear()


def test_rope_store_kv_matches_the_torch_path_bit_for_bit(kernels):
    from specray.models.attention import write_kv

    gen = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim, block_size = 5, 4, 2, 16, 8
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    rotary = layers.RotaryEmbedding(dim, 10000.0, torch.device("cpu"))
    cos, sin = rotary(torch.tensor([0, 3, 7, 8, 30]), 31)
    slots = torch.tensor([1, 9, 17, 18, 40])
    pool_c, pool_t = torch.zeros(6, 2, kv_heads, block_size, dim), torch.zeros(6, 2, kv_heads, block_size, dim)

    q_c, k_c = kernels.rope_store_kv(qkv, cos, sin, heads, kv_heads, pool_c, slots)

    view = qkv.view(rows, heads + 2 * kv_heads, dim)
    q_t, k_t = layers.apply_rope(view[:, : heads + kv_heads], cos, sin).split([heads, kv_heads], dim=1)
    write_kv(pool_t, k_t, view[:, heads + kv_heads:], slots)
    # the kernel rounds the two products and their sum separately, as torch does: exact
    assert torch.equal(q_c, q_t) and torch.equal(k_c, k_t) and torch.equal(pool_c, pool_t)


def test_linear_with_mismatched_shapes_raises_torch_error():
    # the kernel must never read past a weight: a mismatch goes to torch, which names it
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        layers.linear(torch.randn(3, 8), torch.randn(4, 16), None)


def test_a_new_build_prunes_builds_unused_for_a_month(tmp_path):
    def build(name: str, age_days: float):
        library = tmp_path / name / "libspecray_cpu.so"
        library.parent.mkdir()
        library.write_bytes(b"")
        when = time.time() - age_days * 86400
        os.utime(library, (when, when))
        return library.parent

    old, current = build("old", 45), build("current", 60)
    build("recent", 3)
    in_progress = tmp_path / "in-progress"
    in_progress.mkdir()  # a build another process has not finished: no library yet
    assert prune_stale_builds(tmp_path, keep=current) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "in-progress", "recent"]


BROKEN_SOURCES = {
    "syntax error": "int specray_small_gemm(const float *x {\n",  # the compiler rejects it
    "missing entry points": "int unrelated(void) { return 0; }\n",  # builds, but the library lacks the API
}


@pytest.mark.parametrize("source", BROKEN_SOURCES.values(), ids=BROKEN_SOURCES.keys())
def test_a_failed_build_with_a_compiler_fails_the_kernel_tests(source, tmp_path, monkeypatch):
    """The helper the kernel tests build through: a broken kernel source must fail them, not skip them."""
    if cpu_kernels.find_compiler() is None:
        pytest.skip(no_compiler_reason())
    broken = tmp_path / "broken.c"
    broken.write_text(source)
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path / "cache"))  # not the real build's cache
    with pytest.raises(pytest.fail.Exception, match="has a C compiler, but specray's CPU kernels failed to build"):
        built_kernels()
    # a user's job is not stopped by it: the layers fall back to torch's ops
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()


def test_without_a_compiler_the_kernel_tests_skip_and_say_why(monkeypatch):
    monkeypatch.setenv("CC", "specray-test-no-such-compiler")
    with pytest.raises(pytest.skip.Exception, match="no C compiler on this machine .*'specray-test-no-such-compiler'"):
        built_kernels()


@pytest.mark.parametrize("inter", [1, 16, 37, 1536])
def test_silu_mul_matches_torch(inter, kernels):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=gen) * 4
    gate_up[0, : min(inter, 4)] = torch.tensor([-200.0, -88.5, 90.0, 0.0])[: min(inter, 4)]  # past exp's range, 0
    act = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # Tolerance: a degree-6 polynomial exp (relative error ~2e-7) against torch's exp
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert torch.equal(kernels.silu_mul(gate_up[2:3]), act[2:3])  # a row alone: the same bits


def test_paged_attention_bits_do_not_depend_on_threads_or_blocking(kernels):
    # one sequence's 6 verify rows over 3 kv heads: at 2 threads its queries are split into
    # smaller blocks than at 1; each query's bits must stay the same (and a row alone's too)
    gen = torch.Generator().manual_seed(21)
    heads, kv_heads, dim, block_size, ctx, rows = 9, 3, 64, 16, 134, 6
    pool = torch.randn(10, 2, kv_heads, block_size, dim, generator=gen)
    tables = torch.arange(1, 10, dtype=torch.int64)[None]
    q = torch.randn(rows, heads, dim, generator=gen)

    def attend(queries, context, threads):
        torch.set_num_threads(threads)
        lens = torch.tensor([context], dtype=torch.int64)
        return kernels.paged_attention(queries, pool, tables, lens, torch.tensor([queries.shape[0]]),
                                       torch.tensor([0]), True, 0.125)
    saved = torch.get_num_threads()
    try:
        one, two = attend(q, ctx, 1), attend(q, ctx, 2)
        alone = attend(q[:1].contiguous(), ctx - rows + 1, 2)  # the first row as a decode step sees it
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)
    assert torch.equal(alone, two[:1])


def test_rms_norm_heads_is_rms_norm_on_each_head_in_place(kernels):
    # DFlash's q/k norms on a fused projection: heads [first, first + count) of every row, the
    # bits of rms_norm on those heads alone; the other heads (v) untouched
    gen = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, dim = 5, 4, 2, 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    normed = qkv.clone()
    kernels.rms_norm_heads(normed, weight, heads, kv_heads, dim, 1e-6)
    view, out = qkv.view(rows, -1, dim), normed.view(rows, -1, dim)
    expected = kernels.rms_norm(view[:, heads:heads + kv_heads].contiguous(), weight, 1e-6)
    assert torch.equal(out[:, heads:heads + kv_heads], expected)
    assert torch.equal(out[:, :heads], view[:, :heads])
    assert torch.equal(out[:, heads + kv_heads:], view[:, heads + kv_heads:])


def test_rope_without_a_pool_rotates_as_with_one(kernels):
    gen = torch.Generator().manual_seed(6)
    rows, heads, kv_heads, dim = 4, 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = layers.RotaryEmbedding(dim, 10000.0, torch.device("cpu"))(torch.tensor([2, 5, 6, 9]), 10)
    pool = torch.zeros(2, 2, kv_heads, 8, dim)
    stored = kernels.rope_store_kv(qkv, cos, sin, heads, kv_heads, pool, torch.tensor([0, 1, 2, 3]))
    alone = kernels.rope_store_kv(qkv, cos, sin, heads, kv_heads, None, None)
    assert torch.equal(stored[0], alone[0]) and torch.equal(stored[1], alone[1])


@pytest.mark.parametrize("context_lens, block_size", [([100, 5, 190], 64), ([0, 33, 64], 32)])
def test_block_attention_matches_the_torch_path(context_lens, block_size, kernels, monkeypatch):
    # DFlash's query block: m kept queries per sequence over its context in the pool plus all n
    # of the block's own keys, no causal mask; the torch path gathers pages and takes a softmax
    from specray.models.drafters import dflash

    gen = torch.Generator().manual_seed(7)
    seqs, n, m, kv_heads, heads, dim = 3, 16, 3, 2, 8, 64
    pool = torch.randn(20, 2, kv_heads, block_size, dim, generator=gen)
    tables = torch.stack([torch.randperm(20, generator=gen)[:8] for _ in range(seqs)])
    q = torch.randn(seqs * m, heads, dim, generator=gen)
    k, v = torch.randn(seqs * n, kv_heads, dim, generator=gen), torch.randn(seqs * n, kv_heads, dim, generator=gen)
    lens = torch.tensor(context_lens)
    args = (q, k, v, pool, tables, lens, max(context_lens), 0.125)
    fast = dflash.context_block_attention(*args)
    monkeypatch.setattr(dflash, "use_cpu_kernel", lambda q, pool: None)
    # Tolerance: an online softmax over 16-key tiles against one softmax over every key (float32)
    torch.testing.assert_close(fast, dflash.context_block_attention(*args), rtol=1e-5, atol=1e-5)
    # a mutation check: the block's own keys must be attended (dropping them moves the output)
    monkeypatch.undo()
    without_block = kernels.block_attention(q, pool, tables, lens, torch.full((seqs,), m), torch.arange(0, seqs * m, m),
                                            k[:0], v[:0], 0.125)
    assert not torch.allclose(without_block, fast, atol=1e-3)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 33, 1000, 49152 + 3])
def test_argmax_rows_is_torchs_argmax(n, kernels):
    # greedy sampling and verification take these indices, so they must be torch's exactly: the
    # first of equal maxima (-0.0 equals +0.0) and the first NaN, wherever it sits (the 16 lanes,
    # the vector part, the tail)
    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen), torch.full((n,), float("-inf")), torch.zeros(n)]
    tied = torch.randn(n, generator=gen)
    tied[torch.randperm(n, generator=gen)[: max(1, n // 7)]] = 9.0  # many equal maxima, the first wins
    rows.append(tied)
    signed_zero = torch.full((n,), -1.0)
    signed_zero[n // 2:] = 0.0
    signed_zero[n // 3] = -0.0
    rows.append(signed_zero)
    for at in {0, n // 2, n - 1, min(n - 1, 20)}:  # a NaN (and one later) outranks every number
        with_nan = torch.randn(n, generator=gen)
        with_nan[at] = float("nan")
        if at + n // 3 + 1 < n:
            with_nan[at + n // 3 + 1] = float("nan")
        rows.append(with_nan)
    logits = torch.stack(rows)
    assert kernels.argmax_rows(logits) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"contiguous float32 \[rows, n >= 1\] logits, not torch.float32 \(2, 0\)"):
        kernels.argmax_rows(torch.zeros(2, 0))
    if n > 16:  # where lanes matter: the maximum in each lane position and in the tail
        for at in range(max(0, n - 20), n):
            row = torch.zeros(1, n)
            row[0, at] = 1.0
            assert kernels.argmax_rows(row) == [at]


def test_sampling_takes_the_kernels_argmax(kernels, monkeypatch):
    from specray.workers import sampling
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    calls = []
    monkeypatch.setattr(type(kernels), "argmax_rows", lambda self, x: calls.append(x.shape) or x.argmax(-1).tolist())
    logits = torch.randn(3, 100)
    assert sampling.argmax_rows(logits) == logits.argmax(-1).tolist() and calls == [(3, 100)]
    assert sampling.argmax_rows(logits.t()[:3]) == logits.t()[:3].argmax(-1).tolist()  # not contiguous: torch's
    assert calls == [(3, 100)]
