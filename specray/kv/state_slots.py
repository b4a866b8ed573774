"""State-slot allocator: which sequence owns which rows of the state pool (``kv/state.py``).

Plain Python, no torch: the coordinator owns it beside the block allocator, and the ranks only
see the slot ids it hands out in step plans. A sequence slot is free or owned by exactly one
sequence, and owns ``rows_per_slot = 1 + num_draft_tokens`` consecutive state rows (the committed
state and one scratch row per draft position, the snapshot scheme of docs/geometry.md). A slot
is taken on admission and given back on finish, abort and preemption (preemption recomputes the
prompt, which rebuilds the state from zero).
"""

from __future__ import annotations

from specray.errors import SpecrayError


class OutOfStateSlots(SpecrayError):
    """Raised when a sequence asks for a state slot and every slot is held."""


class StateSlotAllocator:
    def __init__(self, num_slots: int, rows_per_slot: int):
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1")
        if rows_per_slot < 1:
            raise ValueError(f"rows_per_slot ({rows_per_slot}) must be >= 1 (1 + num_draft_tokens)")
        self.num_slots = num_slots
        self.rows_per_slot = rows_per_slot
        # Pop from the end: the lowest slots go out first, as the block allocator does.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_rows(self) -> int:
        """The state pool's rows: ``num_slots * rows_per_slot`` (``StateGeometry.num_slots``)."""
        return self.num_slots * self.rows_per_slot

    def allocate(self, seq_id: int) -> int:
        """A free slot for ``seq_id``; OutOfStateSlots when all are held (the scheduler then waits)."""
        if seq_id in self._owner:
            raise ValueError(f"sequence {seq_id} already holds state slot {self._owner[seq_id]}")
        if not self._free:
            raise OutOfStateSlots(f"no free state slot for sequence {seq_id}: all {self.num_slots} are held "
                                  f"by running sequences")
        slot = self._free.pop()
        self._owner[seq_id] = slot
        return slot

    def free(self, seq_id: int) -> None:
        """Give back ``seq_id``'s slot (on finish, abort or preemption)."""
        slot = self._owner.pop(seq_id, None)
        if slot is None:
            raise RuntimeError(f"sequence {seq_id} holds no state slot (freed twice, or never allocated)")
        self._free.append(slot)

    def slot_of(self, seq_id: int) -> int:
        if seq_id not in self._owner:
            raise KeyError(f"sequence {seq_id} holds no state slot")
        return self._owner[seq_id]

    def rows(self, slot: int) -> range:
        """The state rows of one slot: the first holds the committed state, the rest the scratch
        state after each draft position."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not within [0, {self.num_slots})")
        return range(slot * self.rows_per_slot, (slot + 1) * self.rows_per_slot)
