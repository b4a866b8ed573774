"""Reading checkpoints: Hugging Face directories (``config.json`` plus one or more
``*.safetensors`` files; sharded checkpoints carry ``model.safetensors.index.json``) and GGUF
files (``gguf.py``). ``read_model_arch`` and ``open_checkpoint`` pick the format from the path.

Tensors are read slice by slice through safetensors' lazy slices, so a rank reads only
its shard of a sharded layer and never holds the full weight.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from specray.models.arch import ModelArch, read_arch
from specray.models.attention import paged_attention
from specray.models.decoder import CausalLM
from specray.models.gguf import GGUFReader, arch_from_gguf, is_gguf
from specray.models.quant_weight import KERNEL_BLOCK_WEIGHTS, QuantWeight, kernel_types, quant_mode, to_fast_layout

log = logging.getLogger(__name__)


def read_model_arch(path: str | Path) -> ModelArch:
    """The architecture of a checkpoint directory or a GGUF file."""
    return arch_from_gguf(path) if is_gguf(path) else read_arch(path)


def open_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device,
                    kernel_types: frozenset[int] = frozenset()):
    """A reader with ``arch``, ``has``, ``read(name, dim, start, end)`` and ``close``, in Hugging Face
    tensor names whatever the format; both keep the weights of ``kernel_types`` as they are stored
    (``read_blocks``: a GGUF file's blocks, a safetensors checkpoint's BF16)."""
    if is_gguf(path):
        return GGUFReader(path, dtype, device, kernel_types)
    return CheckpointReader(path, dtype, device, kernel_types)


def stored_types(path: str | Path, dtype: torch.dtype, device: torch.device) -> frozenset[int]:
    """The GGML types whose weights a rank keeps as stored (``quant_weight.kernel_types``): every
    one with a kernel for a GGUF file; BF16 for a safetensors checkpoint of a dense attention
    model (MLA, linear-attention and MoE layers read their weights as float tensors)."""
    types = kernel_types(dtype, device)
    if is_gguf(path) or not types:
        return types
    arch = read_arch(path)
    if arch.mla is not None or arch.linear is not None or arch.mixers or arch.moe_layers:
        return frozenset()
    return types & {int(GGMLQuantizationType.BF16)}


class CheckpointReader:
    def __init__(self, checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device,
                 kernel_types: frozenset[int] = frozenset()):
        self.dir = Path(checkpoint_dir)
        self.dtype, self.device = dtype, device
        self.keeps_bf16 = int(GGMLQuantizationType.BF16) in kernel_types
        self._logged: set[str] = set()
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ValueError(f"checkpoint directory {str(self.dir)!r} has no *.safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(f, "pt") as handle:
                    weight_map.update({name: f.name for name in handle.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    @property
    def arch(self) -> ModelArch:
        """The target architecture of ``config.json`` (a drafter directory has its own format)."""
        return read_arch(self.dir)

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            self._handles[file_name] = safe_open(self.dir / file_name, "pt")
        return self._handles[file_name]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of ``name``, or None when the checkpoint has no such tensor."""
        if name not in self.weight_map:
            return None
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def read_exact(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype (index tensors such as EAGLE-3's ``d2t``)."""
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {str(self.dir)!r} has no tensor {name!r}")
        return self._handle(self.weight_map[name]).get_tensor(name).to(self.device)

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The tensor ``name``, or its slice [start, end) along ``dim``, cast to the model dtype."""
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {str(self.dir)!r} has no tensor {name!r}")
        lazy = self._handle(self.weight_map[name]).get_slice(name)
        if dim is None:
            t = lazy[:]
        else:
            index = [slice(None)] * len(lazy.get_shape())
            index[dim] = slice(start, end)
            t = lazy[tuple(index)]
        return t.to(device=self.device, dtype=self.dtype)

    def read_blocks(self, name: str, dim: int | None = None, start: int = 0,
                    end: int | None = None) -> QuantWeight | None:
        """The 2-D BF16 weight ``name`` (or its rows / columns [start, end)) kept in BF16, for the
        BF16 kernels; None where this rank does not keep BF16, the tensor is stored in another
        dtype, or its columns are not a multiple of the kernels' 32 weights."""
        if not self.keeps_bf16 or name not in self.weight_map:
            return None
        lazy = self._handle(self.weight_map[name]).get_slice(name)
        if lazy.get_dtype() != "BF16" or len(lazy.get_shape()) != 2:
            return None
        index = [slice(None), slice(None)]
        if dim is not None:
            index[dim] = slice(start, end)
        t = lazy[tuple(index)].contiguous()
        if t.shape[1] % KERNEL_BLOCK_WEIGHTS:
            reason = (f"BF16 weights of {t.shape[1]} columns are not whole blocks of the kernels' "
                      f"{KERNEL_BLOCK_WEIGHTS} weights: those weights are converted to {self.dtype} at load")
            if reason not in self._logged:
                self._logged.add(reason)
                log.info("%s", reason)
            return None
        return QuantWeight(blocks=t.view(torch.uint8), ggml_type=int(GGMLQuantizationType.BF16),
                           shape=(t.shape[0], t.shape[1]))

    def close(self) -> None:
        self._handles.clear()


def load_model(path: str | Path, ctx, dtype: str, kernel=paged_attention, keep_blocks: bool = True) -> CausalLM:
    """This rank's shards of the model at ``path`` (a checkpoint directory or a GGUF file).
    ``keep_blocks``: GGUF weights stay in their blocks, and a dense model's safetensors BF16
    weights in BF16, where this rank has kernels for them (``stored_types``); False converts
    every tensor to ``dtype`` (training needs float32)."""
    torch_dtype = getattr(torch, dtype)
    types = stored_types(path, torch_dtype, ctx.device) if keep_blocks else frozenset()
    reader = open_checkpoint(path, torch_dtype, ctx.device, types)
    model = CausalLM(reader.arch, ctx, torch_dtype, kernel)
    model.load(reader)
    reader.close()
    if types and quant_mode() == "fast":
        to_fast_layout(model)
    return model.eval()
