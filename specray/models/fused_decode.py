"""The decode and verify step of a dense model on a CPU rank in as few calls as possible.

Python runs once per step: it checks the step can take this path, lays out the step's
metadata and each layer's tensors as address tables, then either makes one C call over every
layer (a tensor-parallel group of one) or, per layer, two C calls with the two all-reduces of
the layer between them, visible here as in the torch path:

| call                   | computes (csrc/fused_layer.c)                              | then          |
|------------------------|------------------------------------------------------------|---------------|
| attention block        | x += delta; norm; qkv; RoPE + K/V store; paged attention; o | all_reduce(tp) |
| MLP block              | x += o (+ o bias); norm; gate_up; silu * up; down          | all_reduce(tp) |

Each layer's four weights are float32 or GGUF blocks (``quant_weight.py``), each with its type in
the layer table; fused_layer.c runs small_gemm or the block GEMV on it, the same bits.

The path serves float32 CPU steps where specray's kernels are built, every layer is dense
(no MoE), has no q/k norm and rotates whole heads, and no sequence in the step is a whole
prompt (prompts go to SDPA); rows up to small_gemm's limit. Captured layers (the features of
drafters conditioned on the target) are copied between runs of layers. Everything else takes
the module-by-module torch path, which stays the reference.

A one-model drafter's lone layer (EAGLE-3's, an MTP module's dense block) takes the same two
blocks, each step checked by ``lone_layer_kernels``; EAGLE-3's attention block builds its
2H-wide q/k/v input in C (specray_eagle3_attention_block).
"""

from __future__ import annotations

import os

import torch

from specray.models.attention import AttentionMetadata, step_plan
from specray.models.cpu_kernels import CpuKernels, kernels_for
from specray.models.quant_weight import FusedQuantWeight, QuantWeight

# the order of fused_layer.c's layer enum: 9 addresses, 4 weights' GGML types, then the further
# parts of a fused q/k/v or gate/up whose parts have different types (FusedQuantWeight)
NUM_LAYER_PTRS = 22
# fused_layer.c's step enum: the RoPE tables, positions, slots and the paged-attention tables
NUM_STEP_PTRS = 8


def fused_layers_enabled() -> bool:
    """False where ``SPECRAY_CPU_FUSED_LAYERS=0`` asks for the module-by-module path."""
    return os.environ.get("SPECRAY_CPU_FUSED_LAYERS", "1").strip() != "0"


def _addr(t: torch.Tensor | QuantWeight | FusedQuantWeight | None) -> int:
    if isinstance(t, FusedQuantWeight):
        t = t.parts[0]
    if isinstance(t, QuantWeight):
        return t.blocks.data_ptr()
    return t.data_ptr() if t is not None else 0


def _ggml_type(weight: torch.Tensor | QuantWeight | FusedQuantWeight) -> int:
    """fused_layer.c's weight type: 0 (GGML's F32) for a float32 tensor, else the blocks' type
    (marked when repacked for SPECRAY_CPU_QUANT=fast); a fused weight's first part's."""
    if isinstance(weight, FusedQuantWeight):
        weight = weight.parts[0]
    return weight.kernel_type if isinstance(weight, QuantWeight) else 0


def _more_parts(weight, count: int) -> list[int]:
    """fused_layer.c's columns for the parts after the first of a fused weight of ``count``
    parts at most: the rows of each part but the last, then each further part's address and
    type; zeros where the weight is one part."""
    if not isinstance(weight, FusedQuantWeight):
        return [0] * (3 * count - 3)
    parts = list(weight.parts)
    rows = [p.shape[0] for p in parts[:-1]]
    return rows + [v for p in parts[1:] for v in (_addr(p), _ggml_type(p))]


def _is_served(kernels: CpuKernels, weight: torch.Tensor | QuantWeight | FusedQuantWeight) -> bool:
    if isinstance(weight, FusedQuantWeight):
        return all(_is_served(kernels, p) for p in weight.parts)
    if isinstance(weight, QuantWeight):
        return kernels.quant.has_fast_kernel(weight.ggml_type) if weight.is_fast else kernels.quant.has_kernel(
            weight.ggml_type)
    return kernels_for(weight) is not None


def layer_row(input_norm: torch.Tensor, attn, post_norm: torch.Tensor, mlp, pool: torch.Tensor) -> list[int]:
    """One layer's row of fused_layer.c's layer table: its norms, attention and MLP weights, pool."""
    weights = (attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down.weight)
    return [_addr(input_norm), _addr(attn.qkv.weight), _addr(attn.qkv.bias), _addr(attn.o_proj.weight),
            _addr(attn.o_proj.bias), _addr(post_norm), _addr(mlp.gate_up.weight), _addr(mlp.down.weight), _addr(pool),
            *map(_ggml_type, weights), *_more_parts(attn.qkv.weight, 3), *_more_parts(mlp.gate_up.weight, 2)]


def _layer_table(model, pools: list[torch.Tensor]) -> torch.Tensor:
    """[num_layers, NUM_LAYER_PTRS] int64 addresses, in fused_layer.c's order; built once per
    set of pools (weights are loaded in place and never move; pools are allocated once)."""
    key = tuple(p.data_ptr() for p in pools)
    cached = getattr(model, "_fused_layer_table", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = [layer_row(layer.input_layernorm.weight, layer.self_attn, layer.post_attention_layernorm.weight, layer.mlp,
                      pool) for layer, pool in zip(model.layers, pools)]
    table = torch.tensor(rows, dtype=torch.int64)
    model._fused_layer_table = (key, table)
    return table


def step_args(rotary, x: torch.Tensor, positions: torch.Tensor, attn, mlp, pool: torch.Tensor,
              meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, shape): fused_layer.c's step table and the step's shape, two views of one tensor
    (a tensor costs ~7 us in a step). ``positions`` must be contiguous int64 and outlive the
    calls that read the tables; cos and sin are the rotary's own tables (the kernel reads row
    positions[r])."""
    tables, context_lens, query_lens, q_starts = step_plan(meta, x, pool).kernel_args
    cos, sin = rotary.tables(max(meta.context_lens_list))
    args = torch.tensor([_addr(t) for t in (cos, sin, positions, meta.slot_mapping, tables, context_lens, query_lens,
                                            q_starts)]
                        + [x.shape[0], x.shape[1], attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim,
                           mlp.down.in_shard, pool.shape[3], tables.shape[0], tables.shape[1], int(meta.causal)],
                        dtype=torch.int64)
    return args[:NUM_STEP_PTRS], args[NUM_STEP_PTRS:]


def layer_tables(owner, rotary, x: torch.Tensor, positions: torch.Tensor, input_norm: torch.Tensor, attn,
                 post_norm: torch.Tensor, mlp, pool: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, step, shape) of a lone layer (a one-model drafter's): its layer-table row, built once
    per pool and kept on ``owner``, and the step's tables (``step_args``)."""
    cached = getattr(owner, "_fused_row", None)
    if cached is None or cached[0] != pool.data_ptr():
        cached = owner._fused_row = (pool.data_ptr(), torch.tensor(layer_row(input_norm, attn, post_norm, mlp, pool),
                                                                   dtype=torch.int64))
    return (cached[1], *step_args(rotary, x, positions, attn, mlp, pool, meta))


def add_mlp_block(kernels: CpuKernels, row: torch.Tensor, shape: torch.Tensor, eps: float, x: torch.Tensor,
                  o: torch.Tensor, attn, mlp) -> torch.Tensor:
    """The rest of a lone layer after its attention block gave ``o`` (this rank's partial sum): x
    += all_reduce(o) (+ o_proj's bias), then the MLP block and x += its all_reduce; x in place."""
    m = kernels.mlp_block(row, shape, eps, x, attn.o_proj.group.all_reduce(o), attn.o_proj.bias)
    x += mlp.down.group.all_reduce(m)
    return x


def lone_layer_kernels(owner, arch, x: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata,
                       layers) -> CpuKernels | None:
    """specray's kernels where a lone layer (a one-model drafter's: ``layers``, their modules) can
    take fused_layer.c's blocks this step, else None (also where SPECRAY_CPU_FUSED_LAYERS=0)."""
    if not fused_layers_enabled():
        return None
    kernels = step_kernels(arch, x, pool, meta)
    return kernels if kernels is not None and weights_served(owner, kernels, layers) else None


def step_kernels(arch, x: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata) -> CpuKernels | None:
    """specray's kernels where a step of these rows and this architecture's layers fits
    fused_layer.c (before its pools and weights are checked), else None."""
    if arch.moe_layers or arch.family.has_qk_norm or arch.rope_dim != arch.head_dim:
        return None  # the kernel rotates whole heads (a partial rotary takes the torch path)
    kernels = kernels_for(x, pool)
    if kernels is None or x.shape[0] > kernels.max_rows or arch.head_dim > kernels.max_head_dim:
        return None
    if any(meta.causal and n == c for n, c in zip(meta.query_lens, meta.context_lens_list)):
        return None  # a whole prompt: SDPA serves it
    return kernels


def fused_kernels(model, x: torch.Tensor, pools: list[torch.Tensor], meta: AttentionMetadata) -> CpuKernels | None:
    """specray's kernels when this step can take the fused path, else None."""
    arch = model.arch
    if len(pools) < arch.num_layers:
        return None
    kernels = step_kernels(arch, x, pools[0], meta)
    if kernels is None or not _pools_served(model, pools[: arch.num_layers]):
        return None
    return kernels if weights_served(model, kernels, model.layers) else None


def _pools_served(model, pools: list[torch.Tensor]) -> bool:
    """Every layer's pool is a contiguous float32 CPU tensor (checked once per set of pools, as
    ``_layer_table``: a check per layer and step cost ~3 us each, 0.1 ms of a SmolLM2 step)."""
    key = tuple(p.data_ptr() for p in pools)
    cached = getattr(model, "_fused_pools_served", None)
    if cached is None or cached[0] != key:
        cached = model._fused_pools_served = (key, all(kernels_for(p) is not None for p in pools))
    return cached[1]


def weights_served(owner, kernels: CpuKernels, layers) -> bool:
    """Every layer's four weights are float32 tensors or blocks of a type with a kernel (checked
    once per owner, a model or a drafter: weights never change after load)."""
    cached = getattr(owner, "_fused_weights_served", None)
    if cached is None:
        cached = owner._fused_weights_served = all(
            _is_served(kernels, w) for layer in layers
            for w in (layer.self_attn.qkv.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up.weight,
                      layer.mlp.down.weight))
    return cached


def fused_layers(model, kernels: CpuKernels, x: torch.Tensor, positions: torch.Tensor,
                 pools: list[torch.Tensor], meta: AttentionMetadata,
                 capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor] | torch.Tensor]:
    """(the residual stream after the last layer, updated in place in x; a copy of it after each
    layer of ``capture_layers``, in that order: a drafter's features; a list, or where the layers
    are increasing and one C call ran, one [captures, rows, hidden] tensor)."""
    arch, first = model.arch, model.layers[0]
    pools = pools[: arch.num_layers]
    positions = positions.to(torch.int64).contiguous()  # held here while the kernels read its address
    attn = first.self_attn
    step, shape = step_args(model.rotary, x, positions, attn, first.mlp, pools[0], meta)
    table = _layer_table(model, pools)
    eps, scale = arch.rms_norm_eps, attn.scale
    group = attn.o_proj.group
    captured: dict[int, torch.Tensor] = {}
    if group.size == 1:  # one C call, which copies the captures out as it passes them
        stops = sorted(set(capture_layers))
        if stops and not 0 <= stops[0] <= stops[-1] < arch.num_layers:
            raise ValueError(f"capture_layers {capture_layers} must be among the model's layers "
                             f"0..{arch.num_layers - 1}")
        out = kernels.dense_layers(table, shape, step, eps, scale, x, torch.empty(2, *x.shape),
                                   torch.tensor(stops, dtype=torch.int64) if stops else None)
        if stops and stops == list(capture_layers):
            # [captures, rows, hidden] indexes as the list would; a drafter's features come out of it
            # in one copy (spec_step._forward), where unbinding it and concatenating the parts again
            # cost ~50 us of a 6 ms one-row step (12-07)
            return x, out
        captured.update(zip(stops, out if stops else ()))
        return x, [captured[i] for i in capture_layers]
    delta = None
    for i in range(arch.num_layers):
        layer = table[i]
        o = kernels.attention_block(layer, shape, step, eps, scale, x, delta, None)
        o = group.all_reduce(o)
        m = kernels.mlp_block(layer, shape, eps, x, o, model.layers[i].self_attn.o_proj.bias)
        delta = group.all_reduce(m)
        if i in capture_layers:  # x holds the residual before this layer's MLP output is added
            captured[i] = x + delta
    x += delta
    return x, [captured[i] for i in capture_layers]
