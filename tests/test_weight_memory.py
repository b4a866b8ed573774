"""A CPU rank holds one copy of each weight: its tensors stay within 1.1x of the bytes its
shard of the checkpoint implies (issue 18; specray used to keep a oneDNN-packed second copy).
GGUF weights kept in their blocks count as the bytes of those blocks (issue 28;
tests/test_quant_model.py holds them against the file's own tensor bytes)."""

from __future__ import annotations

import pytest
import torch

from specray.comm.context import DistContext
from specray.comm.group import Group
from specray.models import loader
from specray.models.presets import resolve_model
from specray.models.quant_weight import quantized_weights

BOUND = 1.1


class RankOf(Group):
    """Rank ``rank`` of a tp group of ``size``, for loading only: loading runs no collective."""

    def __init__(self, size: int, rank: int):
        self.ranks, self.rank_in_group = tuple(range(size)), rank


def held_bytes(model) -> int:
    """Bytes of every tensor the model holds, each storage once: parameters, buffers, plain
    tensor attributes of modules (where a packed copy would hide) and the RoPE tables."""
    tensors = [*model.parameters(), *model.buffers(), model.rotary.cos, model.rotary.sin, model.rotary.inv_freq]
    for module in model.modules():
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    tensors += [w.blocks for w in quantized_weights(model)]
    storages = {}
    for t in tensors:
        if t.layout == torch.strided:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:  # oneDNN's packed tensors have no storage to share
            storages[id(t)] = t.numel() * t.element_size()
    return sum(storages.values())


def shard_bytes_and_model(path, tp: int, rank: int, monkeypatch):
    """(bytes this rank reads from the checkpoint in the engine dtype or in GGUF blocks, the loaded model)."""
    read = []
    real = loader.open_checkpoint

    def counting(*args):
        reader = real(*args)
        original = reader.read

        def read_counted(*a, **k):
            t = original(*a, **k)
            read.append(t.numel() * t.element_size())
            return t
        reader.read = read_counted
        if hasattr(reader, "read_blocks"):  # GGUF: the blocks a rank keeps, in their bytes
            original_blocks = reader.read_blocks

            def read_blocks_counted(*a, **k):
                w = original_blocks(*a, **k)
                read.append(w.nbytes if w is not None else 0)
                return w
            reader.read_blocks = read_blocks_counted
        return reader

    monkeypatch.setattr(loader, "open_checkpoint", counting)
    group = RankOf(tp, rank)
    ctx = DistContext.single() if tp == 1 else DistContext(tp=group, moe_tp=group)
    model = loader.load_model(path, ctx, "float32")
    return sum(read), model


@pytest.mark.parametrize("model_name, tp", [("tiny-llama", 1), ("tiny-qwen3", 2), ("smollm2-135m", 1),
                                            ("smollm2-135m", 3)])
def test_a_rank_holds_one_copy_of_its_weights(model_name, tp, monkeypatch):
    path = resolve_model(model_name)
    for rank in range(tp):
        shard, model = shard_bytes_and_model(path, tp, rank, monkeypatch)
        held = held_bytes(model)
        assert shard > 0 and held <= BOUND * shard, (
            f"{model_name} rank {rank}/{tp}: holds {held / 2**20:.1f} MiB for a {shard / 2**20:.1f} MiB shard "
            f"(> {BOUND}x)")
        del model
