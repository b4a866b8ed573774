"""The fused decode/verify path (models/fused_decode.py) against the module-by-module torch
path on the same weights and the same pool contents: logits within a stated tolerance, every
page size, decode and verify rows; and the engine's greedy tokens at TP 1 and 3."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_build import built_kernels

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.comm.context import DistContext
from specray.models import cpu_kernels, decoder, fused_decode
from specray.models.decoder import side_by_side
from specray.models.attention import build_metadata
from specray.models.loader import load_model
from specray.models.presets import resolve_model

PAGE_SIZES = [16, 32, 64, 128]


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2-135m"])
def model(request, kernels):
    return load_model(resolve_model(request.param), DistContext.single(), "float32")


def _step(model, pools, tables, block_size, starts, query_lens, ids, *, fused: bool) -> torch.Tensor:
    positions, meta = build_metadata(tables, block_size, starts, query_lens, torch.device("cpu"))
    model.is_fused = fused
    try:
        with torch.inference_mode():
            return model.logits(model(ids, positions, pools, meta))
    finally:
        model.is_fused = True


def test_a_verify_row_gets_the_decode_steps_bits(model, kernels, monkeypatch):
    # the engine accepts a draft by comparing verify rows with what decoding would give:
    # the fused step's first verify row must be the decode step's row, bit for bit, at any
    # row count (small_gemm's plans differ with the rows; the summation order must not)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    arch, gen, block_size = model.arch, torch.Generator().manual_seed(5), 16
    prompt_len, tables = 40, [[1, 2, 3, 4]]
    pools = [torch.zeros(6, 2, model.num_local_kv_heads, block_size, arch.head_dim) for _ in range(arch.num_layers)]
    prompt = torch.randint(0, arch.vocab_size, (prompt_len,), generator=gen)
    _step(model, pools, tables, block_size, [0], [prompt_len], prompt, fused=False)  # prefill: SDPA path
    calls = []
    real = fused_decode.fused_layers
    monkeypatch.setattr(decoder, "fused_layers", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, arch.vocab_size, (8,), generator=gen)
    decode = _step(model, [p.clone() for p in pools], tables, block_size, [prompt_len], [1], ids[:1], fused=True)
    for rows in (2, 4, 6, 8):
        verify = _step(model, [p.clone() for p in pools], tables, block_size, [prompt_len], [rows], ids[:rows],
                       fused=True)
        assert torch.equal(verify[:1], decode), rows
    assert len(calls) == 5  # every step took the fused path


@pytest.mark.parametrize("block_size", PAGE_SIZES)
def test_fused_steps_match_the_torch_path(model, block_size, kernels, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    arch, gen = model.arch, torch.Generator().manual_seed(block_size)
    prompt_lens, num_blocks = [37, 150, 5], 16
    pages = [-(-(n + 8) // block_size) for n in prompt_lens]
    firsts = [1 + sum(pages[:i]) for i in range(len(pages))]
    tables = [list(range(f, f + p)) for f, p in zip(firsts, pages)]
    pools = [torch.zeros(sum(pages) + num_blocks, 2, model.num_local_kv_heads, block_size, arch.head_dim)
             for _ in range(arch.num_layers)]
    prompts = torch.randint(0, arch.vocab_size, (sum(prompt_lens),), generator=gen)
    _step(model, pools, tables, block_size, [0, 0, 0], prompt_lens, prompts, fused=False)  # prefill: SDPA path
    calls = []
    real = fused_decode.fused_layers
    monkeypatch.setattr(fused_decode, "fused_layers", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(decoder, "fused_layers", fused_decode.fused_layers)
    for query_lens in ([1, 1, 1], [4, 1, 6]):  # decode; verify rows (k + 1) of differing k
        ids = torch.randint(0, arch.vocab_size, (sum(query_lens),), generator=gen)
        snapshot = [p.clone() for p in pools]
        reference = _step(model, snapshot, tables, block_size, prompt_lens, query_lens, ids, fused=False)
        fused = _step(model, pools, tables, block_size, prompt_lens, query_lens, ids, fused=True)
        # Tolerance: the fused path runs the same float32 kernels as the module path but
        # computes silu with its own polynomial exp (specray_silu_mul), and sums the
        # residual adds in place; the logits agree to ~1e-5 relative over 30 layers.
        torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
        assert torch.equal(fused.argmax(-1), reference.argmax(-1))
        for a, b in zip(pools, snapshot):  # the same K/V stored
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        prompt_lens = [n + q for n, q in zip(prompt_lens, query_lens)]
    assert len(calls) == 2  # both steps took the fused path


def _greedy(model: str, tp: int, block_size: int, fused: bool, monkeypatch) -> list[list[int]]:
    monkeypatch.setenv("SPECRAY_CPU_FUSED_LAYERS", "1" if fused else "0")
    parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local")
    config = EngineConfig(model=model, parallel=parallel, kv=KVConfig(tokens_per_block=block_size))
    prompts = [[1, 2, 3, 4, 5], [7] * 40, list(range(10, 30))]
    with LLM(config) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]


@pytest.mark.parametrize("model_name, tp, block_size", [("tiny-llama", 1, 16), ("tiny-llama", 2, 64),
                                                        ("smollm2-135m", 1, 32), ("smollm2-135m", 3, 128)])
def test_fused_greedy_tokens_equal_the_torch_path(model_name, tp, block_size, kernels, monkeypatch):
    assert _greedy(model_name, tp, block_size, True, monkeypatch) == _greedy(model_name, tp, block_size, False,
                                                                               monkeypatch)


class _IdentityGroup:
    """A 'group' of two whose all-reduce returns its input: on one rank holding the whole model,
    the fused path's per-layer loop (the one sharded ranks take) then computes the full model."""
    size = 2

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("is_increasing", [False, True], ids=["out-of-order", "increasing"])
@pytest.mark.parametrize("is_per_layer", [False, True], ids=["one-call", "per-layer"])
def test_fused_steps_capture_the_torch_paths_features(model, kernels, monkeypatch, is_per_layer, is_increasing):
    # EAGLE-3 and DFlash verify with capture_layers: the fused path must hand them the same
    # residual streams as the module path (same tolerance and reason as the logits above);
    # increasing layers in one call come back as one stacked tensor, indexed as the list
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    if is_per_layer:
        monkeypatch.setattr(model.layers[0].self_attn.o_proj, "group", _IdentityGroup())
    arch, gen, block_size = model.arch, torch.Generator().manual_seed(11), 32
    layers = (arch.num_layers - 1, 0, arch.num_layers // 2)  # out of order: returned in this order
    if is_increasing:
        layers = tuple(sorted(layers))
    tables, prompt_len = [[1, 2, 3]], 50
    pools = [torch.zeros(5, 2, model.num_local_kv_heads, block_size, arch.head_dim) for _ in range(arch.num_layers)]
    prompt = torch.randint(0, arch.vocab_size, (prompt_len,), generator=gen)
    _step(model, pools, tables, block_size, [0], [prompt_len], prompt, fused=False)
    ids = torch.randint(0, arch.vocab_size, (4,), generator=gen)
    positions, meta = build_metadata(tables, block_size, [prompt_len], [4], torch.device("cpu"))
    calls, real = [], fused_decode.fused_layers
    monkeypatch.setattr(decoder, "fused_layers", lambda *a: calls.append(1) or real(*a))
    outs = []
    for fused in (False, True):
        model.is_fused = fused
        try:
            with torch.inference_mode():
                outs.append(model(ids, positions, [p.clone() for p in pools], meta, capture_layers=layers))
        finally:
            model.is_fused = True
    (hidden, captured), (fused_hidden, fused_captured) = outs
    assert len(calls) == 1 and len(fused_captured) == len(layers)
    torch.testing.assert_close(fused_hidden, hidden, rtol=1e-4, atol=1e-4)
    for a, b in zip(fused_captured, captured):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a drafter's features, side by side per row in capture order, from either form
    assert isinstance(fused_captured, torch.Tensor) == (is_increasing and not is_per_layer)
    torch.testing.assert_close(side_by_side(fused_captured), torch.cat(captured, dim=-1), rtol=1e-4, atol=1e-4)


def test_a_capture_layer_past_the_model_is_refused(model, kernels, monkeypatch):
    # the one fused call copies a capture out as it passes its layer: one it never passes would
    # leave its rows unwritten, so it is refused before the call, naming the layers there are
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    arch, block_size = model.arch, 32
    pools = [torch.zeros(2, 2, model.num_local_kv_heads, block_size, arch.head_dim) for _ in range(arch.num_layers)]
    positions, meta = build_metadata([[1]], block_size, [3], [1], torch.device("cpu"))
    ids = torch.zeros(1, dtype=torch.int64)
    rule = rf"must be among the model's layers 0\.\.{arch.num_layers - 1}"
    with torch.inference_mode(), pytest.raises(ValueError, match=rule):
        model(ids, positions, pools, meta, capture_layers=(0, arch.num_layers))


def test_a_partial_rotary_takes_the_torch_path(kernels, monkeypatch):
    # the fused kernel rotates whole heads from RoPE tables of head_dim columns: a model rotating
    # part of each head must not reach it (it would read rows of the wrong width)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    model = load_model(resolve_model("tiny-llama"), DistContext.single(), "float32")
    arch, block_size = model.arch, 16
    pools = [torch.zeros(2, 2, model.num_local_kv_heads, block_size, arch.head_dim) for _ in range(arch.num_layers)]
    _, meta = build_metadata([[1]], block_size, [3], [1], torch.device("cpu"))
    x = torch.zeros(1, arch.hidden_size)
    assert fused_decode.fused_kernels(model, x, pools, meta) is kernels
    model.arch = dataclasses.replace(arch, rotary_dim=arch.head_dim // 2)
    assert fused_decode.fused_kernels(model, x, pools, meta) is None
