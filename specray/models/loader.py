"""Reading checkpoints: Hugging Face directories (``config.json`` plus one or more
``*.safetensors`` files; sharded checkpoints carry ``model.safetensors.index.json``) and GGUF
files (``gguf.py``). ``read_model_arch`` and ``open_checkpoint`` pick the format from the path.

Tensors are read slice by slice through safetensors' lazy slices, so a rank reads only
its shard of a sharded layer and never holds the full weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specray.models.arch import ModelArch, read_arch
from specray.models.attention import paged_attention
from specray.models.decoder import CausalLM
from specray.models.gguf import GGUFReader, arch_from_gguf, is_gguf
from specray.models.quant_weight import kernel_types, quant_mode, to_fast_layout


def read_model_arch(path: str | Path) -> ModelArch:
    """The architecture of a checkpoint directory or a GGUF file."""
    return arch_from_gguf(path) if is_gguf(path) else read_arch(path)


def open_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device,
                    kernel_types: frozenset[int] = frozenset()):
    """A reader with ``arch``, ``has``, ``read(name, dim, start, end)`` and ``close``, in Hugging Face
    tensor names whatever the format; a GGUF reader also keeps the blocks of ``kernel_types``
    (``read_blocks``)."""
    if is_gguf(path):
        return GGUFReader(path, dtype, device, kernel_types)
    return CheckpointReader(path, dtype, device)


class CheckpointReader:
    def __init__(self, checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device):
        self.dir = Path(checkpoint_dir)
        self.dtype, self.device = dtype, device
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

    def close(self) -> None:
        self._handles.clear()


def load_model(path: str | Path, ctx, dtype: str, kernel=paged_attention, keep_blocks: bool = True) -> CausalLM:
    """This rank's shards of the model at ``path`` (a checkpoint directory or a GGUF file).
    ``keep_blocks``: GGUF weights stay in their blocks where this rank has kernels for them
    (``quant_weight.kernel_types``); False dequantizes every tensor (training needs float32)."""
    torch_dtype = getattr(torch, dtype)
    types = kernel_types(torch_dtype, ctx.device) if keep_blocks and is_gguf(path) else frozenset()
    reader = open_checkpoint(path, torch_dtype, ctx.device, types)
    model = CausalLM(reader.arch, ctx, torch_dtype, kernel)
    model.load(reader)
    reader.close()
    if types and quant_mode() == "fast":
        to_fast_layout(model)
    return model.eval()
