"""SmolLM2 from its shipped Q4_1 file with the weights kept in their GGUF blocks (the default on
CPU ranks) against the same file dequantized at load (``SPECRAY_CPU_QUANT=0``): the same bits.

No tolerance anywhere: every GGUF dequantization is exact in float32 but for one rounding the
block GEMV repeats, and the GEMV sums in small_gemm's order (tests/test_quant_gemv.py), so the
two models compute the same float32 operations in the same order. Also here: what a rank holds
(the file's bytes for its shard, not 5x them) and the float32 fallback of a type without a kernel.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants
from gguf_files import write_gguf
from kernel_build import built_kernels
from test_quant_gemv import LAYOUTS, random_bf16, random_blocks
from test_smollm2 import QUESTIONS
from test_weight_memory import RankOf, held_bytes

from checkpoints import make_checkpoint
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.comm.context import DistContext
from specray.launch.procs import RankFailure
from specray.models import cpu_kernels, decoder, fused_decode
from specray.models.attention import PAGED_ATTENTION_PAGE_SIZES, build_metadata
from specray.models.gguf import open_gguf
from specray.models.loader import load_model
from specray.models.presets import resolve_model
from specray.models.quant_weight import FusedQuantWeight, QuantWeight, quant_mode, quantized_weights

NEW_TOKENS = 64
BOUND = 1.1


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


def _load(path, quant: str, monkeypatch, ctx=None):
    monkeypatch.setenv("SPECRAY_CPU_QUANT", quant)
    return load_model(path, ctx or DistContext.single(), "float32")


@pytest.fixture(scope="module")
def models(kernels):
    """(blocks, float32) models of the shipped file, one rank."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
        path = resolve_model("smollm2-135m")
        return _load(path, "exact", mp), _load(path, "0", mp)


def _step(model, pools, tables, block_size, starts, query_lens, ids) -> torch.Tensor:
    positions, meta = build_metadata(tables, block_size, starts, query_lens, torch.device("cpu"))
    with torch.inference_mode():
        return model.logits(model(ids, positions, pools, meta))


LAYERS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # GGUF names


def _assert_prefill_and_decode_equal(quant, dense) -> None:
    """A prompt of 5 tokens (the module path), then a decode step (the fused path): the logits of
    the model with blocks equal the float32 model's, bit for bit."""
    ids, block_size = torch.tensor([3, 14, 15, 92, 65, 35]), 16
    outs = []
    for model in (quant, dense):
        pools = [torch.zeros(2, 2, 2, block_size, 64) for _ in range(2)]
        outs.append([_step(model, pools, [[1]], block_size, [0], [5], ids[:5]),
                     _step(model, pools, [[1]], block_size, [5], [1], ids[5:])])
    for ours, theirs in zip(*outs):
        assert torch.equal(ours, theirs)


def _assert_blocks_are_the_shard_but_down(quant, dense) -> None:
    """Every layer's qkv, o and gate/up kept blocks that dequantize to the float32 rank's shard;
    down (whose K shard splits the kernels' blocks) is that shard in float32."""
    for ours, theirs in zip(quant.layers, dense.layers):
        for name in ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up"):
            weight = ours.get_submodule(name).weight
            assert isinstance(weight, QuantWeight) and torch.equal(weight.dequantize(),
                                                                   theirs.get_submodule(name).weight), name
        assert torch.equal(ours.mlp.down.weight, theirs.mlp.down.weight)


def test_the_shipped_file_stays_in_its_blocks(models):
    quant, dense = models
    weights = quantized_weights(quant)
    # 30 layers x (qkv, o, gate_up, down) in Q4_1, and the Q8_0 embedding the tied head serves from
    assert sorted(w.type_name for w in weights) == ["Q4_1"] * 120 + ["Q8_0"]
    assert quant.lm_head.weight is quant.embed_tokens.weight
    assert quantized_weights(dense) == [] and quant_mode() == "exact"


@pytest.mark.parametrize("block_size", sorted(PAGED_ATTENTION_PAGE_SIZES))  # every page size the kernels take
def test_logits_equal_the_float32_path(models, kernels, block_size, monkeypatch):
    # prefill (SDPA, the head's 40+ rows: panels dequantized), then decode and verify steps of
    # the fused C path, then the same steps module by module: every logit, bit for bit
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    calls = []
    real = fused_decode.fused_layers
    monkeypatch.setattr(decoder, "fused_layers", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(block_size)
    prompt_lens = [45, 70]
    pages = [-(-(n + 16) // block_size) for n in prompt_lens]
    tables = [list(range(1, 1 + pages[0])), list(range(1 + pages[0], 1 + sum(pages)))]
    steps, starts = [], [0, 0]
    for query_lens in (prompt_lens, [1, 1], [4, 6], [1, 3]):  # a prefill, a decode step, two verify steps
        steps.append((list(starts), query_lens, torch.randint(0, 49152, (sum(query_lens),), generator=gen)))
        starts = [s + n for s, n in zip(starts, query_lens)]
    for is_fused in (True, False):
        results = []
        for model in models:
            model.is_fused = is_fused
            pools = [torch.zeros(1 + sum(pages), 2, model.num_local_kv_heads, block_size, model.arch.head_dim)
                     for _ in range(model.arch.num_layers)]
            results.append([_step(model, pools, tables, block_size, *step) for step in steps])
            model.is_fused = True
        for i, (ours, theirs) in enumerate(zip(*results)):
            assert ours.abs().max() > 10 and torch.equal(ours, theirs), (is_fused, i)
    assert len(calls) == 2 * 3  # the decode and verify steps took the fused path on both models


def assert_verify_rows_get_the_decode_steps_bits(model):
    """After a 40-token prompt, verify steps of 2-8 rows: row 0's logits are the decode step's
    for the same token, bit for bit, and so are the decode step's on one thread (torch's default
    here is two). Returns a function that reruns that decode step."""
    gen, block_size, tables, vocab = torch.Generator().manual_seed(3), 16, [[1, 2, 3, 4]], model.arch.vocab_size
    pools = [torch.zeros(6, 2, model.num_local_kv_heads, block_size, model.arch.head_dim)
             for _ in range(model.arch.num_layers)]
    _step(model, pools, tables, block_size, [0], [40], torch.randint(0, vocab, (40,), generator=gen))
    ids = torch.randint(0, vocab, (8,), generator=gen)

    def step(rows: int) -> torch.Tensor:
        return _step(model, [p.clone() for p in pools], tables, block_size, [40], [rows], ids[:rows])

    decode = step(1)
    for rows in (2, 4, 6, 8):
        assert torch.equal(step(rows)[:1], decode), rows
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = step(1)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one_thread, decode)
    return lambda: step(1)


def test_a_verify_row_gets_the_decode_steps_bits(models, kernels, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    assert_verify_rows_get_the_decode_steps_bits(models[0])


def test_the_head_reads_the_embeddings_blocks(models, kernels, monkeypatch):
    # mutation check: were the head served from a float32 copy, changing the embedding's blocks
    # would leave the logits as they are
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    head = models[0].lm_head
    hidden = torch.randn(1, 576, generator=torch.Generator().manual_seed(0))
    before = head(hidden)
    token = int(before.argmax())
    saved = head.weight.blocks[token].clone()
    try:
        head.weight.blocks[token, 2:34] = 0  # the first block's int8 quants
        after = head(hidden)
    finally:
        head.weight.blocks[token] = saved
    assert after[0, token] != before[0, token]
    assert torch.equal(after[0, :token], before[0, :token]) and torch.equal(head(hidden), before)


def _file_shard_bytes(path, tp: int) -> int:
    """The file's tensor bytes one rank of tp holds: every matrix split tp ways (SmolLM2's 3 kv
    heads and 49152 tokens split evenly at tp 3), the norms whole."""
    return sum(t.n_bytes // tp if len(t.shape) == 2 else t.n_bytes for t in open_gguf(path).tensors)


@pytest.mark.parametrize("tp", [1, 3])
def test_a_rank_holds_the_files_bytes_for_its_shard(kernels, tp, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    path = resolve_model("smollm2-135m")
    expected = _file_shard_bytes(path, tp)
    for rank in range(tp):
        group = RankOf(tp, rank)
        ctx = DistContext.single() if tp == 1 else DistContext(tp=group, moe_tp=group)
        model = _load(path, "exact", monkeypatch, ctx)
        held = held_bytes(model)
        assert expected <= held <= BOUND * expected, (
            f"rank {rank}/{tp} holds {held / 2**20:.1f} MiB for {expected / 2**20:.1f} MiB of the file")
        del model
    assert 90 * 2**20 < _file_shard_bytes(path, 1) < 110 * 2**20  # the shipped file: about 101 MiB at tp 1


def _generate(tp: int, block_size: int, quant: str, monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_QUANT", quant)  # the mp launcher forwards SPECRAY_* to its ranks
    parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local")
    config = EngineConfig(model="smollm2-135m", parallel=parallel,
                          kv=KVConfig(tokens_per_block=block_size, capacity_tokens=4096))
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=5, prompt_logprobs=2)
    with LLM(config) as llm:
        outs = llm.generate(QUESTIONS[:4], params)
    return [(o.token_ids, [(e.token_id, e.logprob, e.top) for e in o.logprobs],
             [(e.token_id, e.logprob, e.top) for e in o.prompt_logprobs[1:]]) for o in outs]


@pytest.mark.parametrize("tp, block_size", [(1, 16), (1, 64), (3, 8), (3, 16), (3, 64), (3, 256)])
def test_greedy_tokens_and_logprobs_equal_the_float32_path(tp, block_size, monkeypatch):
    # the engine end to end, TP 3 included (each rank's shard of blocks, the all-reduces between):
    # 64 greedy tokens and the log-probabilities of every prompt and output position, exactly
    quant = _generate(tp, block_size, "exact", monkeypatch)
    dense = _generate(tp, block_size, "0", monkeypatch)
    assert any(len(tokens) == NEW_TOKENS for tokens, _, _ in dense)
    assert quant == dense


def tiny_llama(tmp_path) -> Path:
    """The tiny Llama checkpoint the mixed-type tests quantize: 2 layers, 256 wide, MLP 512,
    4 heads of 64 over 2 KV heads (every shape a multiple of the K-quants' 256)."""
    return make_checkpoint("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def write_tiny_gguf(tmp_path, types: dict[str, QType]) -> Path:
    """tiny_llama written as GGUF, the tensors of ``types`` (GGUF names) quantized to their type."""
    return write_gguf(tiny_llama(tmp_path), tmp_path / "m.gguf", types=types)


def test_a_type_without_a_kernel_falls_back_to_float32_and_mixed_parts_stay_in_blocks(kernels, tmp_path, caplog,
                                                                                      monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    types = {f"blk.{i}.ffn_down.weight": QType.Q5_K for i in range(2)}  # no quantized kernel (yet)
    types.update({"blk.0.ffn_up.weight": QType.Q8_0, "blk.0.ffn_gate.weight": QType.Q8_0,
                  "blk.1.attn_output.weight": QType.Q4_1, "token_embd.weight": QType.Q4_0,
                  "output.weight": QType.Q8_0, "blk.1.attn_q.weight": QType.Q4_1, "blk.1.attn_k.weight": QType.Q4_1,
                  "blk.1.attn_v.weight": QType.Q8_0})  # q/k/v of two types: each part in its own blocks
    path = write_tiny_gguf(tmp_path, types)
    with caplog.at_level(logging.INFO, logger="specray.models.gguf"):
        quant = _load(path, "exact", monkeypatch)
    assert [r.getMessage() for r in caplog.records] == [
        "no quantized CPU kernel for Q5_K: its tensors are dequantized to float32 at load"]
    qkv = quant.layers[1].self_attn.qkv.weight
    assert isinstance(qkv, FusedQuantWeight) and [p.type_name for p in qkv.parts] == ["Q4_1", "Q4_1", "Q8_0"]
    assert isinstance(quant.layers[0].mlp.down.weight, torch.Tensor)
    assert isinstance(quant.layers[0].mlp.gate_up.weight, QuantWeight)
    assert isinstance(quant.layers[1].self_attn.o_proj.weight, QuantWeight)
    assert quant.embed_tokens.weight.type_name == "Q4_0" and quant.lm_head.weight.type_name == "Q8_0"
    dense = _load(path, "0", monkeypatch)
    _assert_prefill_and_decode_equal(quant, dense)


def write_k_quant_mix(tmp_path) -> Path:
    """A tiny Llama GGUF in a Q4_K_M-style mix: Q4_K layers; Q6_K down, one layer's v, the other's
    up and the embedding (so q/k/v and gate/up are fused weights of mixed types)."""
    types = {f"blk.{i}.{name}.weight": QType.Q4_K for i in range(2) for name in LAYERS if name != "ffn_down"}
    types.update({f"blk.{i}.ffn_down.weight": QType.Q6_K for i in range(2)})
    types.update({name: QType.Q6_K for name in ("token_embd.weight", "blk.0.attn_v.weight", "blk.1.ffn_up.weight")})
    return write_tiny_gguf(tmp_path, types)


def test_k_quant_weights_stay_in_their_blocks_and_give_the_float32_paths_logits(kernels, tmp_path, monkeypatch):
    # every weight of the mix kept in its super-blocks, prefill (the panels) and the fused decode
    # step bit for bit the dequantized model's
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    path = write_k_quant_mix(tmp_path)
    quant = _load(path, "exact", monkeypatch)
    held = {w.type_name for w in quantized_weights(quant)}
    assert held == {"Q4_K", "Q6_K"} and len(quantized_weights(quant)) == 2 * 4 + 1 + 3  # + the mixed parts
    assert isinstance(quant.layers[0].self_attn.qkv.weight, FusedQuantWeight)  # v apart, as llama.cpp's Q4_K_M
    assert isinstance(quant.layers[1].mlp.gate_up.weight, FusedQuantWeight)
    _assert_prefill_and_decode_equal(quant, _load(path, "0", monkeypatch))


def test_mxfp4_weights_stay_in_their_blocks_and_give_the_float32_paths_logits(kernels, tmp_path, monkeypatch):
    # MXFP4 (gpt-oss quantizes its experts so): the MLP matrices in E8M0-scaled E2M1 blocks,
    # Q8_0 around them; exact mode bit for bit the dequantized model's; fast mode keeps MXFP4 on
    # its exact kernel (no int8 one), as BF16
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    types = {f"blk.{i}.{name}.weight": QType.MXFP4 if name.startswith("ffn") else QType.Q8_0
             for i in range(2) for name in LAYERS}
    path = write_tiny_gguf(tmp_path, types)
    quant = _load(path, "exact", monkeypatch)
    assert {w.type_name for w in quantized_weights(quant)} == {"MXFP4", "Q8_0"}
    assert quant.layers[0].mlp.down.weight.type_name == "MXFP4"
    _assert_prefill_and_decode_equal(quant, _load(path, "0", monkeypatch))
    fast = _load(path, "fast", monkeypatch)
    assert not fast.layers[0].mlp.down.weight.is_fast and fast.layers[0].self_attn.o_proj.weight.is_fast


def test_safetensors_bf16_weights_stay_bf16_and_give_the_float32_paths_logits(kernels, tmp_path, monkeypatch):
    # item 1's last sentence: a Hugging Face checkpoint stored in BF16 keeps its matrices in BF16
    # on a float32 CPU rank (the BF16 kernels widen them exactly), at half the bytes
    from safetensors.torch import load_file, save_file
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    hf_dir = tiny_llama(tmp_path)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(hf_dir / "model.safetensors"))
    quant, dense = _load(hf_dir, "exact", monkeypatch), _load(hf_dir, "0", monkeypatch)
    kept = quantized_weights(quant)
    assert {w.type_name for w in kept} == {"BF16"} and len(kept) >= 2 * 4 + 1  # every layer matrix, the embedding
    assert quantized_weights(dense) == [] and held_bytes(quant) < 0.6 * held_bytes(dense)
    _assert_prefill_and_decode_equal(quant, dense)


def test_a_bad_quant_mode_is_refused(monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_QUANT", "int8")
    with pytest.raises(ValueError, match=r"SPECRAY_CPU_QUANT must be one of \('exact', 'fast', '0'\).*'int8'"):
        quant_mode()


def test_the_mode_reaches_the_ranks(monkeypatch):
    # the TP 3 comparison above means something only if the ranks the mp launcher starts read the
    # driver's SPECRAY_CPU_QUANT: a bad value there must stop start-up with the mode's error
    monkeypatch.setenv("SPECRAY_CPU_QUANT", "bogus")
    config = EngineConfig(model="smollm2-135m", parallel=ParallelConfig(tp_size=3, launcher="mp"),
                          kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))
    rule = r"rank \d \(pid \d+\) died.*reported ValueError: SPECRAY_CPU_QUANT must be one of"
    with pytest.raises(RankFailure, match=rule):
        LLM(config)


def test_each_ranks_blocks_are_its_float32_shard(kernels, tmp_path, caplog, monkeypatch):
    # TP 2 by hand (loading runs no collective): q/k/v by heads (q/k un-permuted on rows of
    # blocks), gate/up by rows, o by whole blocks of K; down's K shard (96 / 2 = 48) would split
    # blocks of 32, so down is float32 with one log line
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    hf_dir = make_checkpoint("llama", tmp_path / "hf", hidden_size=256, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    path = write_gguf(hf_dir, tmp_path / "m.gguf", types={
        f"blk.{i}.{name}.weight": QType.Q8_0 for i in range(2) for name in LAYERS})
    for rank in range(2):
        ctx = DistContext(tp=RankOf(2, rank), moe_tp=RankOf(2, rank))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specray.models.gguf"):
            quant = _load(path, "exact", monkeypatch, ctx)
        assert [r.getMessage() for r in caplog.records] == ["Q8_0 row-parallel shards of 48 columns split blocks "
                                                            "of 32: those weights are dequantized to float32 at load"]
        dense = _load(path, "0", monkeypatch, ctx)
        _assert_blocks_are_the_shard_but_down(quant, dense)


def test_bf16_weights_stay_bf16_and_give_the_float32_paths_logits(kernels, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    types = {f"blk.{i}.{name}.weight": QType.BF16 for i in range(2) for name in LAYERS}
    types.update({"token_embd.weight": QType.BF16, "output.weight": QType.BF16})
    path = write_tiny_gguf(tmp_path, types)
    quant = _load(path, "exact", monkeypatch)
    held = quantized_weights(quant)
    assert len(held) == 2 * 4 + 2 and {w.type_name for w in held} == {"BF16"}  # qkv, o, gate_up, down; embedding, head
    dense = _load(path, "0", monkeypatch)
    _assert_prefill_and_decode_equal(quant, dense)


def test_a_bf16_shard_of_partial_blocks_is_float32(kernels, tmp_path, caplog, monkeypatch):
    # TP 2: down's K shard (96 / 2 = 48) is not whole 32-weight blocks of the kernels: float32,
    # one log line; the other BF16 weights keep their bytes (each rank's shard of them)
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: kernels)
    hf_dir = make_checkpoint("llama", tmp_path / "hf", hidden_size=256, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    path = write_gguf(hf_dir, tmp_path / "m.gguf",
                      types={f"blk.{i}.{name}.weight": QType.BF16 for i in range(2) for name in LAYERS})
    ctx = DistContext(tp=RankOf(2, 1), moe_tp=RankOf(2, 1))
    with caplog.at_level(logging.INFO, logger="specray.models.gguf"):
        quant = _load(path, "exact", monkeypatch, ctx)
    assert [r.getMessage() for r in caplog.records] == [
        "BF16 weights of 48 columns are not whole blocks of the kernels' 32 weights: those weights are "
        "dequantized to float32 at load"]
    dense = _load(path, "0", monkeypatch, ctx)
    _assert_blocks_are_the_shard_but_down(quant, dense)


@pytest.mark.parametrize("ggml_type", [*LAYOUTS, QType.BF16], ids=lambda t: t.name)
def test_the_panel_dequantizer_gives_the_gguf_packages_values(kernels, ggml_type):
    # prefill dequantizes panels with the GEMV's own dequantizer: it must be gguf.quants.dequantize,
    # bit for bit, on the GEMV test's blocks (every nibble, zero, subnormal and negative scales;
    # BF16: subnormals and both zeros)
    for n, k in ((1, 32), (7, 96), (33, 576)):
        blocks = random_bf16(n, k, seed=n) if ggml_type == QType.BF16 else random_blocks(ggml_type, n, k, seed=n)
        ours = kernels.quant.dequantize(torch.from_numpy(blocks.reshape(n, -1)), int(ggml_type), (n, k))
        theirs = torch.from_numpy(quants.dequantize(blocks.reshape(n, -1), ggml_type).astype(np.float32))
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (n, k)  # -0.0 too


def test_without_the_kernels_the_file_is_dequantized_at_load(monkeypatch):
    # no C compiler (or SPECRAY_CPU_KERNELS=0): torch's ops serve, on float32 weights
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)
    model = _load(resolve_model("smollm2-135m"), "exact", monkeypatch)
    assert quantized_weights(model) == [] and model.layers[0].mlp.down.weight.dtype == torch.float32
