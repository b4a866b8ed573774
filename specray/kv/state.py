"""State slots: the third pool kind, for hybrid linear-attention models (Qwen3-Next's Gated
DeltaNet, Kimi Linear's KDA).

A linear-attention layer keeps, per sequence and not per token, two tensors that every step
updates in place:

- the **conv window**, ``[conv_dim_on_rank, conv_kernel_size - 1]``: the last inputs of the
  depthwise causal conv1d (q, k and v channels of this rank's heads);
- the **recurrent state**, ``[heads_on_rank, k_head_dim, v_head_dim]``: the delta rule's memory.

Both are float32 whatever the pool dtype (the recurrence accumulates over the whole sequence;
transformers and vLLM keep it in float32 too). They are sharded by heads under TP, so each rank
holds its own heads' share and the shapes differ with tp_size but never between the ranks of one
job, which the fingerprint checks.

A pool of state is indexed by **state row**: ``num_slots = max_num_seqs * (1 + num_draft_tokens)``
rows. Speculation uses a snapshot scheme: each sequence slot owns ``1 + num_draft_tokens``
consecutive rows, one for the committed state and one scratch row per draft position, so a
verify of k + 1 positions can keep the state after every position and commit the accepted one
(docs/geometry.md says why snapshot rather than replay).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

STATE_DTYPE = "float32"
STATE_DTYPE_SIZE = 4


def num_state_slots(max_num_seqs: int, num_draft_tokens: int) -> int:
    """Rows of state: one committed row plus one scratch row per draft position, per sequence."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs ({max_num_seqs}) must be >= 1")
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens ({num_draft_tokens}) must be >= 0")
    return max_num_seqs * (1 + num_draft_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateLayout:
    """The state one sequence needs on one rank, per linear-attention layer."""

    num_layers: int  # linear-attention layers only; full-attention layers use the paged pool
    conv_dim: int  # on one rank
    conv_kernel_size: int
    num_heads: int  # on one rank
    k_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "conv_dim", "num_heads", "k_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"state {name} ({getattr(self, name)}) must be >= 1")
        # the window holds the kernel_size - 1 inputs before the current one, so a kernel of 1
        # (no window) is not a conv the layer would use
        if self.conv_kernel_size < 2:
            raise ValueError(f"state conv_kernel_size ({self.conv_kernel_size}) must be >= 2")

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.k_head_dim, self.v_head_dim)

    @property
    def slot_bytes(self) -> int:
        """Bytes one state row takes over all linear layers: the conv window and the recurrent state."""
        conv = self.conv_dim * (self.conv_kernel_size - 1)
        recurrent = self.num_heads * self.k_head_dim * self.v_head_dim
        return self.num_layers * (conv + recurrent) * STATE_DTYPE_SIZE


@dataclass(frozen=True, slots=True, kw_only=True)
class StateGeometry:
    """A state pool as allocated on every rank: ``num_slots`` rows of ``layout``."""

    layout: StateLayout
    num_slots: int
    kind: str = "state"
    dtype: str = STATE_DTYPE

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"state num_slots ({self.num_slots}) must be >= 1")
        if self.kind != "state" or self.dtype != STATE_DTYPE:
            raise ValueError(f"a state pool is kind 'state' in {STATE_DTYPE}, not {self.kind!r} in {self.dtype}")

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def as_dict(self) -> dict:
        return dict(asdict(self), num_bytes=self.num_bytes)

    def describe(self, name: str) -> str:
        lay = self.layout
        return (f"{name} pool: state, {self.num_slots} slots, {lay.num_layers} linear layers, "
                f"conv {list(lay.conv_shape)}, recurrent {list(lay.recurrent_shape)}, {self.dtype}, "
                f"{self.num_bytes / 2**20:.1f} MiB")


@dataclass(frozen=True, slots=True)
class StatePool:
    """The allocated state: per linear layer, ``conv[l]`` is ``[num_slots, *conv_shape]`` and
    ``recurrent[l]`` is ``[num_slots, *recurrent_shape]``."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]


def allocate_state_pool(geometry: StateGeometry, device: torch.device) -> StatePool:
    """Zeroed conv windows and recurrent states (a new sequence starts from zero state)."""
    g, lay = geometry, geometry.layout
    conv = torch.zeros(lay.num_layers, g.num_slots, *lay.conv_shape, dtype=torch.float32, device=device)
    recurrent = torch.zeros(lay.num_layers, g.num_slots, *lay.recurrent_shape, dtype=torch.float32, device=device)
    return StatePool(conv=list(conv.unbind(0)), recurrent=list(recurrent.unbind(0)))


def state_fingerprint(pool: StatePool) -> dict:
    """What was really allocated, read from the tensors: shapes and dtypes of both parts."""
    conv, recurrent = pool.conv[0], pool.recurrent[0]
    return dict(kind="state", num_slots=conv.shape[0], num_layers=len(pool.conv),
                conv_shape=tuple(conv.shape[1:]), conv_dtype=str(conv.dtype).removeprefix("torch."),
                recurrent_shape=tuple(recurrent.shape[1:]),
                recurrent_dtype=str(recurrent.dtype).removeprefix("torch."),
                num_bytes=sum(t.numel() * t.element_size() for t in (*pool.conv, *pool.recurrent)))


def reserve_state_bytes(budget_bytes: int, state: StateGeometry | None) -> int:
    """The budget left for pages once the state slots are reserved (they come first: a sequence
    cannot run without its slot, and pages can shrink, slots cannot)."""
    if state is None:
        return budget_bytes
    if state.num_bytes > budget_bytes:
        raise ValueError(f"the KV budget ({budget_bytes} bytes) cannot hold the state slots: {state.num_slots} "
                         f"slots x {state.slot_bytes} bytes = {state.num_bytes} bytes needed; raise "
                         f"kv.memory_fraction or kv.cpu_max_bytes, or lower max_num_seqs or num_draft_tokens")
    return budget_bytes - state.num_bytes
