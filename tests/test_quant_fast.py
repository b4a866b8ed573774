"""``SPECRAY_CPU_QUANT=fast`` (``csrc/quant_fast.c``): int8 activations and VNNI on weights
repacked 16 rows at a time. Not the float32 path's bits, so the kernel is held to its own rule:

- against a float64 numpy reference of the rule (the same int8 activations and scales, sums
  without rounding), within the float32 rounding the kernel adds (``rule_bound``);
- against the exact kernel, within what rounding the activations to int8 can move a sum
  (``quantization_bound``);
- deterministic where it matters for speculative decoding: a row's bits do not depend on the
  other rows or the thread count, so a verify row equals its decode row, and greedy speculative
  decoding equals plain decoding in this mode too.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants
from kernel_build import built_kernels
from test_quant_gemv import random_blocks, random_k_blocks
from test_quant_model import assert_verify_rows_get_the_decode_steps_bits
from test_weight_memory import held_bytes

from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.comm.context import DistContext
from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray.models.presets import resolve_model
from specray.models.quant_weight import QuantWeight, quantized_weights

FAST = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q6_K]
K_QUANTS = (QType.Q4_K, QType.Q6_K)  # super-blocks of 256: K a multiple of 256
U = 2.0 ** -24  # float32's unit roundoff
ETA = 2.0 ** -150  # and its absolute rounding error in the subnormal range
ROWS = [*range(1, 10), 16, 33]  # 33: past the exact kernel's 32 rows, which this one has no limit at


@pytest.fixture(scope="module")
def kernels():
    k = built_kernels()
    if not k.quant.has_fast:
        pytest.skip("this CPU has no AVX-512 VNNI: SPECRAY_CPU_QUANT=fast runs the exact kernels here")
    return k


def int8_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule's activations in float32 as the kernel computes them: per block of 32, q =
    rint(x * (127 / amax)) and da = amax / 127 (q = 0 and da = 0 where amax <= 2^-120)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    amax = np.where(amax > np.float32(2.0 ** -120), amax, np.float32(0))  # tiny blocks quantize to 0
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
    return q, (amax / np.float32(127)).astype(np.float32)


def half(b: np.ndarray) -> np.ndarray:
    """fp16 bytes [..., 2] as float64 [...]."""
    return b.copy().view(np.float16)[..., 0].astype(np.float64)


def rule_weights(blocks: np.ndarray, ggml_type: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule's weights per block of 32 (a K-quant's sub-block), float64 and exact: dw and mw
    [n, blocks], and the integers the dot product takes [n, blocks, 32] (Q6_K's already times the
    int8 scale of their half, so that its dot is the rule's sc_lo (..) + sc_hi (..))."""
    n = blocks.shape[0]
    if ggml_type == QType.Q4_K:
        b = blocks.reshape(-1, 144)
        sc, m = quants.Q4_K.get_scale_min(b[:, 4:16])  # [super-blocks, 8] each
        dw, mw = half(b[:, 0:2])[:, None] * sc, -(half(b[:, 2:4])[:, None] * m)
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
        return dw.reshape(n, -1), mw.reshape(n, -1), (qs & 15).reshape(n, -1, 32).astype(np.float64)
    if ggml_type == QType.Q6_K:
        b = blocks.reshape(-1, 210)
        ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        q6 = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).astype(np.float64) - 32  # gguf's order
        wq = q6.reshape(-1, 16, 16) * b[:, 192:208].view(np.int8)[..., None]
        dw = np.repeat(half(b[:, 208:210]), 8)
        return dw.reshape(n, -1), 0 * dw.reshape(n, -1), wq.reshape(n, -1, 32)
    b = blocks.reshape(n, -1, FORMATS_BYTES[ggml_type])
    d = half(b[..., :2])
    has_m = ggml_type in (QType.Q4_1, QType.Q5_1)
    m = half(b[..., 2:4]) if has_m else 0 * d
    if ggml_type == QType.Q8_0:
        return d, m, b[..., 2:].view(np.int8).astype(np.float64)
    nib = b[..., -16:]
    q = np.concatenate([nib & 15, nib >> 4], -1).astype(np.int64)
    if ggml_type in (QType.Q5_0, QType.Q5_1):  # the fifth bit of weight j: bit j of qh (little-endian)
        qh = b[..., -20:-16].copy().view("<u4").astype(np.int64)  # [n, blocks, 1]
        q |= ((qh >> np.arange(32)) & 1) << 4
    return d, m, q.astype(np.float64) - {QType.Q4_0: 8, QType.Q5_0: 16}.get(ggml_type, 0)


FORMATS_BYTES = {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q4_1: 20, QType.Q5_0: 22, QType.Q5_1: 24}


def rule_terms(x: np.ndarray, blocks: np.ndarray, ggml_type: QType) -> np.ndarray:
    """[rows, n, blocks, 2] float64: each block's two terms of the rule, dw da dot and mw da sq
    (0 but for Q4_1, Q5_1 and Q4_K), from the blocks' own scales and quants, unrounded; and [rows, n]
    the sum of |dot| + |mw| over blocks (rule_bound's subnormal part)."""
    q, da = int8_activations(x)
    d, m, wq = rule_weights(blocks, ggml_type)
    dot = np.einsum("nbi,rbi->rnb", wq, q)
    sq = q.sum(-1)  # [rows, blocks]
    terms = np.stack([d * da[:, None, :] * dot, m * (da * sq)[:, None, :]], -1)
    # what an absolute rounding error (a subnormal result) of dw * da and of da * sq is multiplied by
    subnormal_gain = (np.abs(dot) + np.abs(m)).sum(-1)
    return terms, subnormal_gain


def rule_bound(terms: np.ndarray, subnormal_gain: np.ndarray) -> np.ndarray:
    """float32 roundings of the kernel: the scale product, Q4_1's da * sq, and one rounding per
    fused multiply-add into the sum (two per block), each within u of its result or, where the
    result is subnormal, ETA absolute: (2 blocks + 4) u times the sum of |terms|, plus ETA times
    what the scale roundings are multiplied by and once per fused multiply-add."""
    roundings = 2 * terms.shape[-2] + 4
    return roundings * (U * np.abs(terms).sum((-1, -2)) + ETA) + ETA * subnormal_gain


def quantization_bound(x: np.ndarray, blocks: np.ndarray, ggml_type: QType) -> np.ndarray:
    """|fast - exact| <= sum over blocks of (da / 2 + 4 u amax) * sum |w|: rounding x * 127 / amax to
    an integer moves each activation by at most da / 2, and the float32 scale and reciprocal
    add a few u of amax (a block the rule drops, amax <= 2^-120, moves by amax); plus both
    kernels' float32 sums (K u sum |w x| for the exact one)."""
    _, da = int8_activations(x)
    w = np.abs(quants.dequantize(blocks, ggml_type).astype(np.float64))
    n, k = w.shape
    amax = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1)
    per_block = w.reshape(n, k // 32, 32).sum(-1)  # [n, blocks]
    moved = np.where(da > 0, da / 2 + 4 * U * amax, amax)  # a block below 2^-120 is dropped whole
    rounding = moved @ per_block.T
    return rounding + k * (U * (np.abs(x) @ w.T) + ETA) * 2


def activations(k: int, rows: int, seed: int) -> torch.Tensor:
    """Random rows, one all zero (amax = 0), one of ties (x * 127 / amax = j + 1/2 exactly), one
    whose blocks span 2^-20 to 2^20 and one of blocks near and below the rule's 2^-120."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    if rows > 2:
        x[1] = 0
        ties = (torch.arange(k) % 32 - 16).float() + 0.5
        ties[::32] = 127.0  # amax 127: the scale is 1, so x * 1 lands on halves
        x[2] = ties
    if rows > 3:
        x[3] *= 2.0 ** ((torch.arange(k) // 32) % 41 - 20).float()
    if rows > 4:  # blocks of subnormals and of values just around 2^-120: 127 / amax must not overflow
        x[4] *= torch.where(torch.arange(k) // 32 % 2 == 0, 2.0 ** -140, 2.0 ** -119.5)
    return x


def weight_blocks(ggml_type: QType, n: int, k: int, seed: int) -> np.ndarray:
    """random_blocks, or random_k_blocks for the K-quants (with their edge cases)."""
    return (random_k_blocks if ggml_type in K_QUANTS else random_blocks)(ggml_type, n, k, seed=seed)


CASES = [(t, 32 * b) for t in FAST if t not in K_QUANTS for b in (1, 3, 18, 48)]
CASES += [(t, 256 * b) for t in K_QUANTS for b in (1, 2, 6)]


@pytest.mark.parametrize("ggml_type,k", CASES, ids=lambda c: getattr(c, "name", c))
def test_fast_gemv_follows_its_rule(ggml_type, k, kernels):
    n = 48
    blocks = weight_blocks(ggml_type, n, k, seed=k * 7 + int(ggml_type))
    packed = kernels.quant.fast_repack(torch.from_numpy(blocks), ggml_type, (n, k))
    x = activations(k, max(ROWS), seed=k)
    terms, subnormal_gain = rule_terms(x.numpy(), blocks, ggml_type)
    expected, bound = terms.sum((-1, -2)), rule_bound(terms, subnormal_gain)
    exact = kernels.quant.gemv(x[:32], torch.from_numpy(blocks), ggml_type, (n, k)).numpy()
    q_bound = quantization_bound(x[:32].numpy(), blocks, ggml_type)
    alone = torch.cat([kernels.quant.fast_gemv(x[i:i + 1], packed, ggml_type, (n, k), threads=1)
                       for i in range(x.shape[0])])
    for rows in ROWS:
        for threads in (1, 2):
            got = kernels.quant.fast_gemv(x[:rows], packed, ggml_type, (n, k), threads=threads)
            assert torch.equal(got, alone[:rows]), (ggml_type.name, rows, threads)  # a row's bits are its own
    err = np.abs(alone.numpy().astype(np.float64) - expected)
    assert (err <= bound).all(), (ggml_type.name, float((err - bound).max()))
    assert (np.abs(alone[:32].numpy() - exact) <= q_bound).all()
    assert (alone[1] == 0).all() and (alone[0] != 0).any()  # amax = 0 gives 0, not nan
    assert torch.isfinite(alone).all()


def test_the_quantization_bound_is_tight_enough_to_mean_something(kernels):
    # the bound against the exact kernel must not be so loose that any answer passes: the real
    # difference uses a good part of it, and a kernel that skipped a block would break it
    n, k, t = 48, 576, QType.Q4_1
    blocks = random_blocks(t, n, k, seed=5)
    packed = kernels.quant.fast_repack(torch.from_numpy(blocks), t, (n, k))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(5))
    got = kernels.quant.fast_gemv(x, packed, t, (n, k)).numpy()
    exact = kernels.quant.gemv(x, torch.from_numpy(blocks), t, (n, k)).numpy()
    bound = quantization_bound(x.numpy(), blocks, t)
    assert np.abs(got - exact).max() > 0.01 * bound.max()
    dropped = x.clone()
    dropped[:, :32] = 0  # the first block's contribution missing
    skipped = kernels.quant.gemv(dropped, torch.from_numpy(blocks), t, (n, k)).numpy()
    assert (np.abs(skipped - exact) > bound).any()


@pytest.mark.parametrize("ggml_type", FAST, ids=lambda t: t.name)
def test_bias_and_the_repacked_rows(ggml_type, kernels):
    n, k = 1536, 768 if ggml_type in K_QUANTS else 576  # past the one-thread size: both threads split the groups
    blocks = weight_blocks(ggml_type, n, k, seed=int(ggml_type))
    w = torch.from_numpy(blocks)
    packed = kernels.quant.fast_repack(w, ggml_type, (n, k))
    assert packed.shape == w.shape and not torch.equal(packed, w)
    if ggml_type != QType.Q8_0:  # the same bytes, reordered (Q8_0's quants also get +128)
        assert torch.equal(packed.flatten().sort().values, w.flatten().sort().values)
    ids = torch.tensor([0, 15, 16, 1535, 700, 0])
    assert torch.equal(kernels.quant.fast_rows(packed, ggml_type, (n, k), ids),
                       torch.from_numpy(quants.dequantize(blocks[ids.numpy()], ggml_type)))
    gen = torch.Generator().manual_seed(1)
    bias, x = torch.randn(n, generator=gen), torch.randn(3, k, generator=gen)
    plain = kernels.quant.fast_gemv(x, packed, ggml_type, (n, k))
    assert torch.equal(kernels.quant.fast_gemv(x, packed, ggml_type, (n, k), bias=bias), plain + bias)


def test_shapes_and_types_without_a_fast_layout_are_refused(kernels):
    blocks = torch.from_numpy(random_blocks(QType.Q4_1, 40, 64, seed=0))
    with pytest.raises(ValueError, match=r"no fast layout for Q4_1 \(40, 64\).*multiple of 16"):
        kernels.quant.fast_repack(blocks, QType.Q4_1, (40, 64))
    bf16 = torch.zeros(16, 2 * 64, dtype=torch.uint8)  # BF16 keeps its exact kernel in fast mode
    takes = r"it takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K"
    with pytest.raises(ValueError, match=r"no fast layout for BF16 .* " + takes):
        kernels.quant.fast_repack(bf16, QType.BF16, (16, 64))
    assert not kernels.quant.has_fast_kernel(QType.BF16) and kernels.quant.has_fast_kernel(QType.Q8_0)
    packed = kernels.quant.fast_repack(torch.from_numpy(random_blocks(QType.Q4_1, 16, 64, seed=0)), QType.Q4_1, (16, 64))
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 \[16\]"):
        kernels.quant.fast_gemv(torch.randn(1, 64), packed, QType.Q4_1, (16, 64), bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"x must be a float32 CPU tensor \[rows >= 1, 64\]"):
        kernels.quant.fast_gemv(torch.randn(0, 64), packed, QType.Q4_1, (16, 64))
    for bad in ([16], [0, -1]):  # a lookup outside the rows is refused, not read past the weight
        with pytest.raises(ValueError, match=rf"row ids must be in \[0, 16\): got {bad[-1]}"):
            kernels.quant.fast_rows(packed, QType.Q4_1, (16, 64), torch.tensor(bad))


@pytest.fixture(scope="module")
def fast_model(kernels):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
        mp.setenv("SPECRAY_CPU_QUANT", "fast")
        return load_model(resolve_model("smollm2-135m"), DistContext.single(), "float32")


def test_the_shipped_file_is_repacked_in_place(fast_model, kernels, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    monkeypatch.setenv("SPECRAY_CPU_QUANT", "exact")
    exact = load_model(resolve_model("smollm2-135m"), DistContext.single(), "float32")
    weights = quantized_weights(fast_model)
    assert len(weights) == 121 and all(w.is_fast for w in weights)  # 120 Q4_1 layer weights, the Q8_0 embedding
    assert fast_model.lm_head.weight is fast_model.embed_tokens.weight  # the tied head: one repacked copy
    assert held_bytes(fast_model) == held_bytes(exact)  # the same bytes, reordered
    ids = torch.tensor([[0, 7, 49151]])
    assert torch.equal(fast_model.embed_tokens(ids), exact.embed_tokens(ids))  # lookups stay exact
    hidden = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    fast, ref = fast_model.lm_head(hidden), exact.lm_head(hidden)  # the head on the fast kernel, within its bound
    bound = quantization_bound(hidden.numpy(), exact.lm_head.weight.blocks.numpy(), QType.Q8_0)
    assert not torch.equal(fast, ref) and (np.abs((fast - ref).numpy()) <= bound).all()


def test_a_verify_row_gets_the_decode_steps_bits_in_fast_mode(fast_model, kernels, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    assert_verify_rows_get_the_decode_steps_bits(fast_model)  # and one thread's bits are two's


def test_speculative_decoding_is_lossless_in_fast_mode(monkeypatch):
    # verification compares the target's own greedy choice at each row, and each row's bits are
    # the decode step's: n-gram drafting gives plain decoding's tokens, with drafts accepted
    monkeypatch.setenv("SPECRAY_CPU_QUANT", "fast")
    prompts = ["def fibonacci(n):", "List three colours: red, green, blue. Again: red, green,"]
    params = SamplingParams(max_tokens=40)
    kv = KVConfig(tokens_per_block=16, capacity_tokens=2048)
    with LLM(EngineConfig(model="smollm2-135m", kv=kv)) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    spec = SpecConfig(method="ngram", num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    with LLM(EngineConfig(model="smollm2-135m", kv=kv, spec=spec)) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert max(o.metrics["acceptance_length"] for o in outs) > 1.2


def test_types_without_a_fast_kernel_keep_the_exact_ones(kernels, tmp_path, caplog, monkeypatch):
    from test_quant_model import write_tiny_gguf
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    types = {f"blk.{i}.ffn_down.weight": QType.BF16 for i in range(2)}
    types.update({f"blk.{i}.ffn_{p}.weight": QType.Q4_0 for i in range(2) for p in ("gate", "up")})
    path = write_tiny_gguf(tmp_path, types)
    monkeypatch.setenv("SPECRAY_CPU_QUANT", "fast")
    with caplog.at_level(logging.INFO, logger="specray.models.quant_weight"):
        model = load_model(path, DistContext.single(), "float32")
    assert [r.getMessage() for r in caplog.records] == [
        "SPECRAY_CPU_QUANT=fast: 2 weights run the exact kernels: "
        "the fast kernels take Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K, not BF16"]
    assert isinstance(model.layers[0].mlp.gate_up.weight, QuantWeight) and model.layers[0].mlp.gate_up.weight.is_fast
    assert not model.layers[1].mlp.down.weight.is_fast
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = model.layers[0].mlp(x)
    assert torch.isfinite(y).all() and y.abs().max() > 0


def test_q5_weights_run_on_the_fast_kernels(kernels, tmp_path, monkeypatch):
    # Q5_0 gate/up and Q5_1 down are repacked at load and run on their fast kernels; an MLP whose
    # fifth bits were wired wrong would decorrelate from the exact kernels' (cosine far below 1)
    from test_quant_model import write_tiny_gguf
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    types = {f"blk.{i}.ffn_down.weight": QType.Q5_1 for i in range(2)}
    types.update({f"blk.{i}.ffn_{p}.weight": QType.Q5_0 for i in range(2) for p in ("gate", "up")})
    path = write_tiny_gguf(tmp_path, types)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("exact", "fast"):
        monkeypatch.setenv("SPECRAY_CPU_QUANT", mode)
        model = load_model(path, DistContext.single(), "float32")
        mlp = model.layers[1].mlp
        assert {mlp.gate_up.weight.type_name, mlp.down.weight.type_name} == {"Q5_0", "Q5_1"}
        assert mlp.gate_up.weight.is_fast == mlp.down.weight.is_fast == (mode == "fast")
        with torch.inference_mode():
            out[mode] = mlp(x).flatten()
    assert not torch.equal(out["fast"], out["exact"])
    assert float(torch.cosine_similarity(out["fast"], out["exact"], dim=0)) > 0.99


def test_a_k_quant_mix_runs_on_the_fast_kernels(kernels, tmp_path, monkeypatch):
    # a Q4_K_M-style mix (Q4_K layers, Q6_K down, one v, one up and the embedding): every weight
    # repacked, including the parts of mixed fused weights; a verify row keeps the decode step's
    # bits. The kernels' error is held to its bound above; here a layout wired to the wrong rows
    # or sub-blocks would decorrelate the logits from the exact kernels' (cosine far below 1).
    from test_quant_model import write_k_quant_mix
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    path = write_k_quant_mix(tmp_path)
    models = {}
    for mode in ("exact", "fast"):
        monkeypatch.setenv("SPECRAY_CPU_QUANT", mode)
        models[mode] = load_model(path, DistContext.single(), "float32")
    weights = quantized_weights(models["fast"])
    assert {w.type_name for w in weights} == {"Q4_K", "Q6_K"} and all(w.is_fast for w in weights)
    assert held_bytes(models["fast"]) == held_bytes(models["exact"])
    decode_step = assert_verify_rows_get_the_decode_steps_bits(models["fast"])
    fast = decode_step().flatten()
    exact = assert_verify_rows_get_the_decode_steps_bits(models["exact"])().flatten()
    assert not torch.equal(fast, exact) and float(torch.cosine_similarity(fast, exact, dim=0)) > 0.99


def test_a_long_repacked_row_is_looked_up_too(kernels):
    # rows past the lookup's stack buffer (4096 bytes: here 128 Q8_0 blocks, 4352) take the heap
    n, k = 32, 4096
    blocks = random_blocks(QType.Q8_0, n, k, seed=3)
    packed = kernels.quant.fast_repack(torch.from_numpy(blocks), QType.Q8_0, (n, k))
    ids = torch.tensor([31, 0, 17])
    assert torch.equal(kernels.quant.fast_rows(packed, QType.Q8_0, (n, k), ids),
                       torch.from_numpy(quants.dequantize(blocks[ids.numpy()], QType.Q8_0)))
