"""The scheduler's side of state slots (hybrid linear-attention targets, ``kv/state.py``).

A sequence takes a state slot when it is admitted and gives it back whenever it leaves the
running set: on finish, on abort and on preemption (a preempted sequence recomputes from
position 0, which rebuilds its state, so it holds no slot while it waits). The ranks learn a
sequence's committed state row from the first plan that schedules it after each admission
(``StepPlan.state_rows``); a new row needs no clearing, since a sequence at position 0 starts
from zero state. Plain Python, no torch, as the rest of the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specray.kv.state_slots import StateSlotAllocator

if TYPE_CHECKING:
    from specray.kv.state import StateGeometry


class StateRows:
    """Mixed into ``Scheduler``: a no-op for targets without linear-attention layers."""

    def _init_state_rows(self, allocator: StateSlotAllocator | None) -> None:
        self.state_allocator = allocator
        self._new_state_rows: dict[int, int] = {}  # since the last plan: seq_id -> committed state row

    def _has_free_state_slot(self) -> bool:
        return self.state_allocator is None or self.state_allocator.num_free > 0

    def _take_state_slot(self, seq_id: int) -> None:
        if self.state_allocator is not None:
            slot = self.state_allocator.allocate(seq_id)
            self._new_state_rows[seq_id] = self.state_allocator.rows(slot)[0]  # row 0: the committed state

    def _free_state_slot(self, seq_id: int) -> None:
        if self.state_allocator is not None:
            self.state_allocator.free(seq_id)
            self._new_state_rows.pop(seq_id, None)

    def _pop_state_rows(self) -> dict[int, int]:
        rows, self._new_state_rows = self._new_state_rows, {}
        return rows


def state_slot_allocator(state: StateGeometry | None, max_num_seqs: int,
                         num_draft_tokens: int) -> StateSlotAllocator | None:
    """The state-slot allocator of a hybrid target's agreed state pool (None without one): a slot per
    sequence of ``1 + num_draft_tokens`` rows, exactly the rows every rank allocated."""
    if state is None:
        return None
    allocator = StateSlotAllocator(max_num_seqs, 1 + num_draft_tokens)
    if allocator.num_rows != state.num_slots:
        raise RuntimeError(f"the state pool has {state.num_slots} rows, the scheduler would hand out "
                           f"{allocator.num_rows} ({max_num_seqs} slots x {1 + num_draft_tokens} rows)")
    return allocator
