"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` package and dequantized to
the engine dtype.

A GGUF file holds the architecture as metadata (``llama.block_count``, ...) and every tensor
under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ...), most of them quantized in
blocks along each row. ``GGUFReader`` below answers the same ``read(name, dim, start, end)``
calls as the safetensors reader, in Hugging Face names, so the layers load their shards
without knowing the format:

- a row slice dequantizes only those rows (the file is memory-mapped, rows are whole blocks);
- a column slice dequantizes ``ROW_CHUNK`` rows at a time and keeps the slice's columns,
  so no rank holds a whole sharded layer in full precision;
- llama.cpp's converter interleaves the two rotary halves of each q and k head of Llama
  checkpoints (its ``permute``); reading undoes it per head, so q/k shards must be whole heads.

With ``kernel_types`` (CPU ranks in float32, ``quant_weight.py``), ``read_blocks`` gives a
tensor's shard in its GGUF blocks instead (rows of blocks, or whole blocks of every row),
un-permuted the same way; it answers None where the layer must take float32 from ``read``, and
logs why once per reason.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader as _StockReader
from gguf import quants

from specray.models.arch import ModelArch
from specray.models.quant_weight import KERNEL_BLOCK_WEIGHTS, QuantWeight

log = logging.getLogger(__name__)

ROW_CHUNK = 256  # rows dequantized at a time for a column slice

# What llama.cpp's converters and quantizers write for dense models, each dequantized by the
# gguf package's own code (llama.cpp's reference): float, the legacy 32-block and the k-quants.
SUPPORTED_TYPES = frozenset({
    QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4,
})

# general.architecture -> (the family's Hugging Face class, q/k rows permuted by the converter)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


class _FileReader(_StockReader):
    """gguf's reader, parsing from a plain ndarray view of its memory map.

    The stock reader slices its ``np.memmap`` once per metadata item, and memmap slicing costs
    microseconds in Python; SmolLM2's 49152 tokens and 48900 merges took 4.2 s to parse, 0.9 s
    this way. Only the buffer differs: tests/test_gguf.py checks that both readers return the
    same fields and tensors."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str | Path):
    """The file's ``gguf.GGUFReader``; a missing, truncated or corrupt file is a ValueError."""
    if not Path(path).is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        return _FileReader(str(path))
    except (ValueError, IndexError, OSError, KeyError, TypeError) as err:
        size = Path(path).stat().st_size
        raise ValueError(f"{str(path)!r} ({size} bytes) is not a readable GGUF file: {err}. A truncated or "
                         f"corrupt download fails this way; fetch the file again") from err


def metadata(reader, key: str, default=None, *, source: str = "GGUF file"):
    """One metadata value (a scalar, a string or a list); ``default`` when absent, or a
    ValueError naming the key when there is no default."""
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"{source} has no metadata key {key!r}, which specray needs to build the model")
        return default
    return field.contents()


def hf_to_gguf_name(name: str) -> str:
    """A Hugging Face tensor name in llama.cpp's naming (``model.layers.3.mlp.up_proj.weight``
    -> ``blk.3.ffn_up.weight``); a name with no GGUF counterpart is a ValueError."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"tensor {name!r} has no GGUF counterpart that specray knows")


def arch_from_gguf(path: str | Path, reader=None) -> ModelArch:
    """The ModelArch a GGUF file's metadata describes; errors name the key or value at fault."""
    reader = reader or open_gguf(path)
    source = f"GGUF file {str(path)!r}"
    name = metadata(reader, "general.architecture", source=source)
    if name not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture {name!r} is not supported; supported GGUF architectures: "
                         f"{sorted(ARCHITECTURES)}")

    def key(suffix: str, default=None):
        return metadata(reader, f"{name}.{suffix}", default, source=source)

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and key("rope.scaling.factor", 1.0) != 1.0):
        raise ValueError(f"{source}: rope scaling {scaling!r} is not supported; only plain RoPE is")
    if key("expert_count", 0):
        raise ValueError(f"{source}: {name} with experts (expert_count {key('expert_count')}) is not supported "
                         f"from GGUF; use its Hugging Face checkpoint directory")
    tensors = {t.name: t for t in reader.tensors}
    for t in tensors.values():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"{source}: tensor {t.name!r} is quantized as {t.tensor_type.name}, which specray "
                             f"cannot dequantize; supported: {sorted(q.name for q in SUPPORTED_TYPES)}")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{source} has no tensor 'token_embd.weight'")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{source}: rope.dimension_count ({key('rope.dimension_count')}) differs from the head "
                         f"size ({head_dim}); partial rotary embeddings are not supported")
    eos = metadata(reader, "tokenizer.ggml.eos_token_id", -1)
    return ModelArch(
        architecture=ARCHITECTURES[name][0],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        eos_token_ids=(int(eos),) if eos >= 0 else (),
    )


def dequantize(tensor, dim: int | None = None, start: int = 0, end: int | None = None) -> np.ndarray:
    """float32 values of a GGUF tensor (numpy's row-major shape), or its slice [start, end)
    along ``dim`` (0: rows, 1: columns of a matrix)."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} is quantized as {qtype.name}, which specray cannot dequantize; "
                         f"supported: {sorted(t.name for t in SUPPORTED_TYPES)}")
    data = tensor.data
    if qtype == QType.F32:
        unpack = lambda block: np.array(block, dtype=np.float32)  # noqa: E731 (a copy: the file is read-only)
    else:
        unpack = lambda block: quants.dequantize(block, qtype)  # noqa: E731
    if dim is None:
        return unpack(data)
    if dim == 0:
        return unpack(data[start:end])
    rows = data.shape[0]
    end = end if end is not None else int(tensor.shape[0])
    out = np.empty((rows, end - start), dtype=np.float32)
    for first in range(0, rows, ROW_CHUNK):
        out[first:first + ROW_CHUNK] = unpack(data[first:first + ROW_CHUNK])[:, start:end]
    return out


def unpermute_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves: within each head, GGUF row
    2i + j holds Hugging Face row j * head_dim / 2 + i (j in {0, 1})."""
    heads = rows.shape[0] // head_dim
    rest = rows.shape[1:]
    return rows.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


class GGUFReader:
    """Tensors of a GGUF file in Hugging Face names, sliced and cast like ``CheckpointReader``."""

    def __init__(self, path: str | Path, dtype: torch.dtype, device: torch.device,
                 kernel_types: frozenset[int] = frozenset()):
        """``kernel_types``: the GGML types whose blocks ``read_blocks`` keeps (those with a
        quantized CPU kernel here; empty: every tensor is dequantized at load)."""
        self.path = Path(path)
        self.kernel_types = kernel_types
        self._logged: set[str] = set()
        self.dtype, self.device = dtype, device
        self._reader = open_gguf(path)
        self.arch = arch_from_gguf(path, self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._is_permuted = ARCHITECTURES[metadata(self._reader, "general.architecture")][1]

    def has(self, name: str) -> bool:
        try:
            return hf_to_gguf_name(name) in self._tensors
        except ValueError:
            return False

    def _tensor(self, name: str):
        gguf_name = hf_to_gguf_name(name)
        tensor = self._tensors.get(gguf_name)
        if tensor is None:
            raise ValueError(f"GGUF file {str(self.path)!r} has no tensor {gguf_name!r} (for {name!r})")
        return tensor

    def _unpermuted(self, name: str, tensor, rows: np.ndarray, dim: int | None, start: int, end) -> np.ndarray:
        if self._is_permuted and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            head_dim = self.arch.head_dim
            if dim == 0 and (start % head_dim or rows.shape[0] % head_dim):
                raise ValueError(f"{name}: rows [{start}, {end}) are not whole heads of {head_dim}")
            return unpermute_rows(rows, head_dim)
        return rows

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        tensor = self._tensor(name)
        values = self._unpermuted(name, tensor, dequantize(tensor, dim, start, end), dim, start, end)
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype)

    def log_once(self, reason: str) -> None:
        """Log ``reason`` (why a weight is float32 after all) once per load."""
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("%s", reason)

    def read_blocks(self, name: str, dim: int | None = None, start: int = 0,
                    end: int | None = None) -> QuantWeight | None:
        """The 2-D weight ``name`` (or its rows / columns [start, end)) in its GGUF blocks; None
        where it is float in the file, its type has no kernel, or the slice would split blocks."""
        tensor = self._tensor(name)
        qtype = tensor.tensor_type
        if qtype in (QType.F32, QType.F16) or len(tensor.shape) != 2 or not self.kernel_types:
            return None
        if int(qtype) not in self.kernel_types:
            self.log_once(f"no quantized CPU kernel for {qtype.name}: its tensors are dequantized to float32 at load")
            return None
        size, nbytes = GGML_QUANT_SIZES[qtype]
        data, k = tensor.data, int(tensor.shape[0])
        if dim == 1:
            end = k if end is None else end
            if start % size or end % size:
                self.log_once(f"{qtype.name} row-parallel shards of {end - start} columns split blocks of {size}: "
                               f"those weights are dequantized to float32 at load")
                return None
            data, k = data[:, start // size * nbytes:end // size * nbytes], end - start
        elif dim == 0:
            data = data[start:end]
        if k % KERNEL_BLOCK_WEIGHTS:  # BF16 (one weight a block in GGUF): the kernels take 32 at a time
            self.log_once(f"{qtype.name} weights of {k} columns are not whole blocks of the kernels' "
                           f"{KERNEL_BLOCK_WEIGHTS} weights: those weights are dequantized to float32 at load")
            return None
        blocks = self._unpermuted(name, tensor, np.ascontiguousarray(data), dim, start, end)
        return QuantWeight(blocks=torch.from_numpy(np.array(blocks, dtype=np.uint8)), ggml_type=int(qtype),
                           shape=(blocks.shape[0], k))

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None

