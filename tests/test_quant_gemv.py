"""The GGUF block-quantized GEMV (``csrc/quant_gemv.c``) against ``small_gemm`` on the weight
``gguf.quants.dequantize`` gives: bitwise equal, the contract (no tolerance: every
dequantization is exact in float32 but for one rounding the kernel repeats, and the kernel sums
in small_gemm's order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants
from kernel_build import built_kernels

# bytes of one block of 32 weights, and where its fp16 scales sit (d first; m second where there is one)
LAYOUTS = {QType.Q8_0: (34, 1), QType.Q4_0: (18, 1), QType.Q4_1: (20, 2), QType.Q5_0: (22, 1),
           QType.Q5_1: (24, 2)}
ROWS = [*range(1, 10), 16, 32]
# (d, m) as fp16 bits for the first block of rows 1..: d = +0 and -0, the smallest and the largest
# (negative) subnormal d, negative and subnormal m
EDGE_SCALES = [(0x0000, 0x3C00), (0x8000, 0xBC00), (0x0001, 0x8001), (0x83FF, 0xC500), (0x3555, 0x03FF)]
K_BLOCKS = [1, 3, 18, 48]  # K = 32, 96, 576 (SmolLM2's hidden size), 1536 (its MLP width)


@pytest.fixture(scope="module")
def kernels():
    """Skipped only without a C compiler; a failed build with one fails every test that uses it."""
    return built_kernels()


def random_halves(gen: np.random.Generator, count: int) -> np.ndarray:
    """fp16 scales as bits: both signs, normal exponents up to 2^5, about a fifth subnormal and a
    tenth zero (+0 and -0): the edge cases of d and m. No inf or nan (the product would be nan)."""
    sign = gen.integers(0, 2, count, dtype=np.uint16) << 15
    exponent = gen.integers(1, 21, count, dtype=np.uint16)
    kind = gen.random(count)
    exponent[kind < 0.3] = 0  # subnormal (or zero with mantissa 0 below)
    mantissa = gen.integers(0, 1024, count, dtype=np.uint16)
    mantissa[kind < 0.1] = 0  # zero
    return sign | exponent << 10 | mantissa


def random_blocks(ggml_type: QType, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks of an [n, k] weight: random scales (random_halves) and random quants, the
    first block of every row holding every nibble (and every int8 value 0..31 and -128..-97 for Q8_0)."""
    gen = np.random.default_rng(seed)
    block_bytes, num_halves = LAYOUTS[ggml_type]
    blocks = gen.integers(0, 256, (n, k // 32, block_bytes), dtype=np.uint8)
    blocks[..., : 2 * num_halves] = random_halves(gen, n * (k // 32) * num_halves).view(np.uint8).reshape(
        n, k // 32, 2 * num_halves)
    quants_at = block_bytes - (32 if ggml_type == QType.Q8_0 else 16)
    every = np.arange(32, dtype=np.uint8) if ggml_type == QType.Q8_0 else np.arange(16, dtype=np.uint8) * 17
    blocks[:, 0, quants_at:] = every  # nibbles: low and high both 0..15
    if ggml_type == QType.Q8_0:
        blocks[:, 0, quants_at:] ^= np.uint8(0x80) * (np.arange(32) % 2).astype(np.uint8)  # and -128..-97
    scales = blocks[:, 0, : 2 * num_halves].view(np.uint16)  # [n, num_halves]: the first block's d (and m)
    for row, (d, m) in enumerate(EDGE_SCALES[: n - 1], start=1):  # besides the random ones, in every weight
        scales[row, 0] = d
        if num_halves == 2:
            scales[row, 1] = m
    return blocks.reshape(n, -1)


def reference(kernels, x: torch.Tensor, blocks: np.ndarray, ggml_type: QType, bias=None) -> torch.Tensor:
    weight = torch.from_numpy(quants.dequantize(blocks, ggml_type).astype(np.float32, copy=False))
    assert torch.isfinite(weight).all()  # the test's blocks carry no inf or nan scales
    return kernels.small_gemm(x, weight.contiguous(), bias)


@pytest.mark.parametrize("ggml_type", list(LAYOUTS), ids=lambda t: t.name)
@pytest.mark.parametrize("k_blocks", K_BLOCKS)
def test_quant_gemv_is_small_gemm_on_the_dequantized_weight(ggml_type, k_blocks, kernels):
    n, k = 37, 32 * k_blocks  # odd N: the static split over threads leaves one thread an extra row
    blocks = random_blocks(ggml_type, n, k, seed=k_blocks * 10 + int(ggml_type))
    assert_gemv_is_small_gemm(kernels, blocks, ggml_type, n, k, seed=k_blocks)


def assert_gemv_is_small_gemm(kernels, blocks: np.ndarray, ggml_type: QType, n: int, k: int, seed: int) -> None:
    """The GEMV on ``blocks`` at every row count of ROWS, on 1 and 2 threads and the default
    rule: bit for bit small_gemm on gguf's dequantized weight."""
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(seed))
    w = torch.from_numpy(blocks)
    for rows in ROWS:
        x = x_all[:rows]
        expected = reference(kernels, x, blocks, ggml_type)
        for threads in (1, 2):
            got = kernels.quant.gemv(x, w, ggml_type, (n, k), threads=threads)
            assert torch.equal(got, expected), (ggml_type.name, rows, k, threads)
        assert torch.equal(kernels.quant.gemv(x, w, ggml_type, (n, k)), expected), (ggml_type.name, rows, "default")


@pytest.mark.parametrize("ggml_type", list(LAYOUTS), ids=lambda t: t.name)
def test_bias_and_a_larger_shape(ggml_type, kernels):
    n, k = 1537, 576  # more than 1.5 MiB of float32 weight: small_gemm's plans take both threads
    blocks = random_blocks(ggml_type, n, k, seed=int(ggml_type))
    gen = torch.Generator().manual_seed(int(ggml_type))
    bias = torch.randn(n, generator=gen)
    for rows in (1, 4, 9):
        x = torch.randn(rows, k, generator=gen)
        got = kernels.quant.gemv(x, torch.from_numpy(blocks), ggml_type, (n, k), bias=bias, threads=2)
        assert torch.equal(got, reference(kernels, x, blocks, ggml_type, bias)), (ggml_type.name, rows)


def test_the_edge_cases_are_in_the_blocks():
    # the blocks the bit-equality tests run on really hold what they claim to cover
    for ggml_type, (_, num_halves) in LAYOUTS.items():
        blocks = random_blocks(ggml_type, 37, 576, seed=1)
        weight = quants.dequantize(blocks, ggml_type)
        first = weight[:, :32]
        if num_halves == 1:
            assert (first[1] == 0).all() and (first[2] == 0).all()  # d = +0, -0
        else:
            assert set(first[1]) == {1.0} and set(first[2]) == {-1.0}  # d = 0: the block is m
            assert (first[4] < 0).any()  # a negative m
        if num_halves == 1:  # row 3: d * q with d the largest negative subnormal
            assert 0 < np.abs(first[3]).max() < 2.0 ** -14 * 128
        else:  # row 5: m subnormal, so the weights with q = 0 are
            assert 0 < np.abs(first[5]).min() < 2.0 ** -14
        scales = blocks.reshape(37, 18, -1)[:, :, :2].copy().view(np.float16).astype(np.float32)
        assert ((np.abs(scales) > 0) & (np.abs(scales) < 2.0 ** -14)).any()  # random subnormal scales too
        assert (scales < 0).any() and (scales == 0).any()
        quants_at = blocks.shape[1] // 18 - (32 if ggml_type == QType.Q8_0 else 16)
        nibbles = blocks[0, quants_at:quants_at + 16]
        if ggml_type != QType.Q8_0:
            assert set(nibbles & 15) == set(nibbles >> 4) == set(range(16))  # every nibble value


def random_bf16(n: int, k: int, seed: int) -> np.ndarray:
    """A BF16 [n, k] weight as GGUF stores it (2 bytes a weight): both signs, exponents from 2^-37
    to 2^32, about a tenth subnormal or zero (+0 and -0). No inf or nan."""
    gen = np.random.default_rng(seed)
    sign = gen.integers(0, 2, (n, k), dtype=np.uint16) << 15
    exponent = gen.integers(90, 160, (n, k), dtype=np.uint16)
    kind = gen.random((n, k))
    exponent[kind < 0.1] = 0  # subnormal, or zero with mantissa 0 below
    mantissa = gen.integers(0, 128, (n, k), dtype=np.uint16)
    mantissa[kind < 0.03] = 0
    return (sign | exponent << 7 | mantissa).view(np.uint8).reshape(n, 2 * k)


@pytest.mark.parametrize("k_blocks", K_BLOCKS)
def test_bf16_gemv_is_small_gemm_on_the_bf16_weight(k_blocks, kernels):
    # BF16 is the top half of a float32: the GEMV widens it exactly and sums in small_gemm's order
    n, k = 37, 32 * k_blocks
    blocks = random_bf16(n, k, seed=k_blocks)
    weight = torch.from_numpy(quants.dequantize(blocks, QType.BF16).astype(np.float32, copy=False))
    assert torch.isfinite(weight).all() and (weight == 0).any() and (weight.abs() < 2.0 ** -126).any()
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k_blocks))
    for rows in ROWS:
        x = x_all[:rows]
        expected = kernels.small_gemm(x, weight.contiguous(), None)
        for threads in (1, 2):
            got = kernels.quant.gemv(x, torch.from_numpy(blocks), QType.BF16, (n, k), threads=threads)
            assert torch.equal(got, expected), (rows, k, threads)


def test_the_format_table(kernels):
    assert kernels.quant.block_layout(QType.Q4_1) == (32, 20)
    assert kernels.quant.block_layout(QType.Q8_0) == (32, 34)
    for ggml_type, (block_bytes, _) in LAYOUTS.items():  # the C table agrees with gguf's
        assert kernels.quant.block_layout(ggml_type) == quants.GGML_QUANT_SIZES[ggml_type] == (32, block_bytes)
    assert kernels.quant.block_layout(QType.BF16) == (32, 64)  # 32 weights at a time (GGUF: 1 weight, 2 bytes)
    for ggml_type in [*K_QUANTS, QType.MXFP4]:  # super-blocks of 256; MXFP4's 1 + 16 bytes; as gguf says
        assert kernels.quant.block_layout(ggml_type) == quants.GGML_QUANT_SIZES[ggml_type]
    assert not kernels.quant.has_kernel(QType.Q5_K)


def test_bad_input_names_the_rule(kernels):
    q = kernels.quant
    blocks = torch.from_numpy(random_blocks(QType.Q4_1, 4, 64, seed=0))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="no quantized CPU kernel for Q5_K"):
        q.gemv(x, blocks, QType.Q5_K, (4, 64))
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        q.gemv(x, blocks, QType.Q4_K, (4, 64))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        q.gemv(torch.randn(1, 48), blocks, QType.Q4_1, (4, 48))
    with pytest.raises(ValueError, match="takes 160 bytes of blocks, not 80"):
        q.gemv(x, blocks[:2], QType.Q4_1, (4, 64))
    with pytest.raises(ValueError, match=r"x must be a float32 CPU tensor \[rows, 64\]"):
        q.gemv(torch.randn(1, 32), blocks, QType.Q4_1, (4, 64))
    with pytest.raises(ValueError, match="1..32 rows of x, not 33"):
        q.gemv(torch.randn(33, 64), blocks, QType.Q4_1, (4, 64))
    with pytest.raises(ValueError, match="contiguous uint8"):
        q.gemv(x, blocks.float(), QType.Q4_1, (4, 64))


# The K-quants: super-blocks of 256 weights (Q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and
# mins, 128 bytes of nibbles; Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales,
# fp16 d), taken 32 weights at a time. K = 256, 512, 1536.
K_QUANTS = {QType.Q4_K: (0, 2), QType.Q6_K: (208,)}  # where each block's fp16 scales sit


def random_k_blocks(ggml_type: QType, n: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant blocks: random bytes (every nibble, 2-bit and 6-bit value, Q6_K's int8 scales
    -128..127), random_halves' fp16 scales (zero and subnormal among them), and in row 1 the
    edge cases: d = 0 in its first block; Q6_K's scales all -128 in its second."""
    gen = np.random.default_rng(seed)
    _, block_bytes = quants.GGML_QUANT_SIZES[ggml_type]
    blocks = gen.integers(0, 256, (n, k // 256, block_bytes), dtype=np.uint8)
    for offset in K_QUANTS[ggml_type]:
        blocks[..., offset:offset + 2] = random_halves(gen, n * (k // 256)).view(np.uint8).reshape(n, k // 256, 2)
    blocks[1, 0, K_QUANTS[ggml_type][0]:K_QUANTS[ggml_type][0] + 2] = 0  # d = 0
    if ggml_type == QType.Q6_K and k >= 512:
        blocks[1, 1, 192:208] = 0x80  # every scale -128
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", list(K_QUANTS), ids=lambda t: t.name)
@pytest.mark.parametrize("k_super", [1, 2, 6])
def test_k_quant_gemv_is_small_gemm_on_the_dequantized_weight(ggml_type, k_super, kernels):
    n, k = 37, 256 * k_super
    blocks = random_k_blocks(ggml_type, n, k, seed=k_super * 10 + int(ggml_type))
    weight = quants.dequantize(blocks, ggml_type)
    assert np.isfinite(weight).all()
    dense = kernels.quant.dequantize(torch.from_numpy(blocks), ggml_type, (n, k))  # prefill's panels
    assert torch.equal(dense, torch.from_numpy(weight.astype(np.float32)))  # gguf's values exactly
    assert_gemv_is_small_gemm(kernels, blocks, ggml_type, n, k, seed=k_super)


def test_the_k_quant_edge_cases_are_in_the_blocks():
    q4 = quants.dequantize(random_k_blocks(QType.Q4_K, 4, 512, seed=1), QType.Q4_K)
    assert len(np.unique(q4[1, :32])) == 1  # d = 0: the sub-block is -dmin * m alone, one value
    q6_blocks = random_k_blocks(QType.Q6_K, 4, 512, seed=1)
    q6 = quants.dequantize(q6_blocks, QType.Q6_K)
    assert (q6[1, :256] == 0).all()  # d = 0
    assert (q6_blocks.reshape(4, 2, 210)[1, 1, 192:208].view(np.int8) == -128).all() and q6[1, 256:].any()
    scales = np.concatenate([random_k_blocks(t, 37, 1536, seed=3).reshape(37, 6, -1)[..., o:o + 2]
                             .copy().view(np.float16).ravel() for t, offs in K_QUANTS.items() for o in offs])
    assert (scales == 0).any() and ((np.abs(scales) > 0) & (np.abs(scales) < 2.0 ** -14)).any()


# MXFP4: an E8M0 exponent byte (the scale 2^(e - 128), subnormal for e < 2) and 16 bytes of 4-bit
# codes; the edge exponents, in the first block of rows 1..: both subnormal scales, the smallest
# normal one, 1 and 2, and the largest whose products (12 x 2^124) stay finite
MXFP4_EDGE_EXPONENTS = [0, 1, 2, 128, 129, 252]


def random_mxfp4_blocks(n: int, k: int, seed: int, max_exponent: int = 150) -> np.ndarray:
    """Random MXFP4 blocks: exponents up to ``max_exponent`` (past ~150 a GEMV's sums overflow to
    inf, whose NaNs compare unequal), random codes, every code in the first block of every row,
    and MXFP4_EDGE_EXPONENTS below ``max_exponent`` in rows 1.."""
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = gen.integers(0, max_exponent + 1, (n, k // 32), dtype=np.uint8)
    blocks[:, 0, 1:] = np.arange(16, dtype=np.uint8) * 17  # every code, low and high nibble
    edges = [e for e in MXFP4_EDGE_EXPONENTS if e <= max_exponent]
    blocks[1:1 + len(edges), 0, 0] = edges[: n - 1]
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("k_blocks", K_BLOCKS)
def test_mxfp4_gemv_is_small_gemm_on_the_dequantized_weight(k_blocks, kernels):
    n, k = 37, 32 * k_blocks
    blocks = random_mxfp4_blocks(n, k, seed=k_blocks)
    dense = kernels.quant.dequantize(torch.from_numpy(blocks), QType.MXFP4, (n, k))  # prefill's panels
    assert torch.equal(dense, torch.from_numpy(quants.dequantize(blocks, QType.MXFP4)))
    assert_gemv_is_small_gemm(kernels, blocks, QType.MXFP4, n, k, seed=k_blocks)


def test_mxfp4_edge_scales_dequantize_as_gguf_does(kernels):
    blocks = random_mxfp4_blocks(8, 64, seed=3, max_exponent=252)
    weight = quants.dequantize(blocks, QType.MXFP4)
    assert np.isfinite(weight).all() and weight[1, 1] != 0 and abs(weight[1, 1]) < 2.0 ** -126  # subnormal
    assert np.abs(weight[6]).max() == 12 * 2.0 ** 124  # the largest finite scale, the largest code
    got = kernels.quant.dequantize(torch.from_numpy(blocks), QType.MXFP4, (8, 64))
    assert torch.equal(got, torch.from_numpy(weight))


@pytest.mark.parametrize("ggml_type", [*LAYOUTS, *K_QUANTS, QType.MXFP4], ids=lambda t: t.name)
def test_row_lookups_are_ggufs_rows(ggml_type, kernels):
    """An embedding lookup on a weight in GGUF rows: gguf's values, in the order asked, repeats
    included; an id outside the rows is refused with its value, nothing read past the weight."""
    n, k = 37, 512
    if ggml_type == QType.MXFP4:
        blocks = random_mxfp4_blocks(n, k, seed=5)
    else:
        blocks = (random_k_blocks if ggml_type in K_QUANTS else random_blocks)(ggml_type, n, k, seed=5)
    ids = torch.tensor([0, 36, 1, 17, 1, 0])
    got = kernels.quant.rows(torch.from_numpy(blocks), ggml_type, (n, k), ids)
    assert torch.equal(got, torch.from_numpy(quants.dequantize(blocks[ids.numpy()], ggml_type)))
    assert kernels.quant.rows(torch.from_numpy(blocks), ggml_type, (n, k), ids[:0]).shape == (0, k)
    for bad in ([37], [3, -1]):
        with pytest.raises(ValueError, match=rf"row ids must be in \[0, 37\): got {bad[-1]}"):
            kernels.quant.rows(torch.from_numpy(blocks), ggml_type, (n, k), torch.tensor(bad))
