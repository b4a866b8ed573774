"""Tiny GGUF files written offline with ``gguf.GGUFWriter``, the way llama.cpp's converter
writes a Hugging Face checkpoint: llama.cpp names, q/k rows of Llama permuted per head, and
any tensor quantized to a chosen type.

Types that ``gguf.quants`` can quantize (Q8_0, Q4_0, Q4_1, BF16, ...) are quantized from the
weights; the k-quants have no quantizer in the gguf package, so their blocks are random bytes
with sane float16 scales (``random_blocks``): a valid encoding whose values only
``gguf.quants.dequantize`` defines, which is all a dequantization test needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, GGUFWriter, quants
from safetensors.torch import load_file

from specray.models.gguf import hf_to_gguf_name

# Byte offsets of the float16 scales in one block of each k-quant (ggml-common.h's layouts).
K_QUANT_HALF_OFFSETS = {QType.Q4_K: (0, 2), QType.Q6_K: (208,), QType.Q5_K: (0, 2), QType.Q2_K: (80, 82),
                        QType.Q3_K: (108,)}
ARCH_NAMES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotary halves of every head's rows."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(rows: int, cols: int, qtype: QType, seed: int = 0) -> np.ndarray:
    """A valid [rows, bytes] encoding of a k-quant: random bytes, float16 scales of ~1e-2."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = (rng.uniform(0.002, 0.02, size=(rows, cols // block)).astype(np.float16)).view(np.uint8)
    for offset in K_QUANT_HALF_OFFSETS[qtype]:
        raw[:, :, offset:offset + 2] = halves.reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def encode(w: np.ndarray, qtype: QType, seed: int = 0) -> np.ndarray:
    if qtype == QType.F32:
        return w.astype(np.float32)
    if qtype == QType.F16:
        return w.astype(np.float16)
    if qtype in K_QUANT_HALF_OFFSETS:
        return random_blocks(w.shape[0], w.shape[1], qtype, seed)
    return quants.quantize(w.astype(np.float32), qtype)


def write_gguf(checkpoint: Path, path: Path, types: dict[str, QType] | None = None, arch_name: str | None = None,
               skip_keys: tuple[str, ...] = ()) -> Path:
    """``checkpoint`` (a tiny Hugging Face directory) as a GGUF file. ``types`` maps GGUF tensor
    names to a quantization type (default F32); ``arch_name`` overrides general.architecture;
    ``skip_keys`` leaves metadata keys out (for bad-input tests)."""
    import json

    cfg = json.loads((checkpoint / "config.json").read_text())
    name = arch_name or ARCH_NAMES[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = GGUFWriter(str(path), name)
    metadata = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
        "vocab_size": cfg["vocab_size"], "rope.dimension_count": cfg["head_dim"],
    }
    for key, value in metadata.items():
        if key not in skip_keys:
            writer.add_uint32(f"{name}.{key}", value)
    if "attention.layer_norm_rms_epsilon" not in skip_keys:
        writer.add_float32(f"{name}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{name}.rope.freq_base", cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    weights = load_file(str(checkpoint / "model.safetensors"))
    types = types or {}
    for i, (hf_name, tensor) in enumerate(sorted(weights.items())):
        gguf_name = hf_to_gguf_name(hf_name)
        w = tensor.float().numpy()
        if name == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
            w = permute_rows(w, heads if gguf_name.split(".")[-2] == "attn_q" else kv_heads)
        qtype = types.get(gguf_name, QType.F32)
        data = encode(w, qtype, seed=i)
        writer.add_tensor(gguf_name, data, raw_shape=data.shape if qtype not in (QType.F32, QType.F16) else None,
                          raw_dtype=qtype if qtype not in (QType.F32, QType.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(path: Path, gguf_name: str) -> torch.Tensor:
    """A tensor of a GGUF file as the gguf package's reader and dequantizer give it."""
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == gguf_name)
    return torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
