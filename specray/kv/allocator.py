"""Block allocator: a free list of page ids shared by every pool of one model pair.

Plain Python, no torch: the coordinator owns it, and the ranks only see the block ids it
hands out in step plans. A page is either free or owned by exactly one sequence.
"""

from __future__ import annotations

from specray.errors import SpecrayError


class OutOfBlocks(SpecrayError):
    """Raised when an allocation asks for more pages than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        # Pop from the end: the lowest ids go out first, which keeps small runs compact.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} pages, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"page {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    """Pages that hold num_tokens tokens (ceil division)."""
    return -(-num_tokens // tokens_per_block)
