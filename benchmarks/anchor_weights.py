"""The GGUF both engines of ``bench_vs_llamacpp`` load (``--weights``): the built-in model's
file as it ships (``shipped``, Q4_1 with a Q8_0 embedding) or requantized by llama.cpp itself
(``q8_0``, ``bf16``, ``q4_0``, ``q4_k_m``, ``f32``), or a random-weight preset written as llama.cpp's converter writes
it (F32) and requantized from there. Made once, under ``$SPECRAY_CACHE/anchors/``, each under a
temporary name then renamed, so an interrupted run leaves no half-written file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from specray.envs import cache_root
from specray.models.gguf import hf_to_gguf_name
from specray.models.presets import resolve_model


WEIGHTS = {"f32": "LLAMA_FTYPE_ALL_F32", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
           "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
"""``--weights`` other than ``shipped``: llama.cpp's file type each is requantized to."""


def requantize(llama_cpp, source: Path, weights: str, threads: int) -> Path:
    """``source`` requantized by llama.cpp to ``weights`` (a key of WEIGHTS), once."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r} must be one of {sorted(WEIGHTS)} to requantize")
    stem = source.name.removesuffix(".gguf").removesuffix(".F32")
    target = cache_root() / "anchors" / f"{stem}.{weights.upper()}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, WEIGHTS[weights]), True, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize could not requantize {source} to {weights}")
    os.replace(tmp, target)
    return target


def write_preset_gguf(checkpoint: Path, target: Path) -> Path:
    """A Hugging Face Llama checkpoint as an F32 GGUF as llama.cpp's converter writes it (its tensor
    names, q/k rows interleaved per head), with a filler SentencePiece vocabulary of the model's size."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("rope.dimension_count", cfg["head_dim"]), ("vocab_size", vocab)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32("llama.rope.freq_base", cfg["rope_theta"])
    # <unk> <s> </s>, the 256 byte tokens, then numbered pieces (1 normal, 2 unknown, 3 control, 6 byte)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"\u2581p{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for hf_name, tensor in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        name, w = hf_to_gguf_name(hf_name), tensor.float().numpy()
        if name.split(".")[-2] in ("attn_q", "attn_k"):  # the converter's rotary-half interleave
            n = heads if name.split(".")[-2] == "attn_q" else kv_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)
    return target


def anchor_weights(llama_cpp, model: str, threads: int, weights: str = "f32") -> tuple[Path, Path]:
    """(the GGUF both engines load, what transformers loads: that GGUF or the preset's directory)."""
    source = resolve_model(model)
    if source.suffix == ".gguf":
        path = source if weights == "shipped" else requantize(llama_cpp, source, weights, threads)
        return path, path
    if weights == "shipped":
        raise ValueError(f"--weights shipped needs a model that ships as a GGUF file; {model} is a preset "
                         f"(written as F32): pick one of {sorted(WEIGHTS)}")
    f32 = cache_root() / "anchors" / f"{source.name}.F32.gguf"
    if not f32.is_file():
        f32.parent.mkdir(parents=True, exist_ok=True)
        write_preset_gguf(source, f32)
    return (f32 if weights == "f32" else requantize(llama_cpp, f32, weights, threads)), source
