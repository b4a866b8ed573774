"""Which page size each pool gets, and whether the drafter has a pool of its own.

Pure functions over what every rank reported; rank 0 applies them and broadcasts the result.
"""

from __future__ import annotations

from collections.abc import Sequence

from specray.config import POOL_LESS_DRAFTERS, STANDALONE_DRAFTERS

DRAFT_FALLBACK_PAGE_SIZE = 32


def has_separate_draft_pool(method: str | None) -> bool:
    """Standalone drafters (draft_model, dflash, dspark) get their own pool; one-model drafters
    (mtp, eagle3) put their layers in the target's pool; pool-less drafters (ngram) and plain
    decoding have no draft pool."""
    return method in STANDALONE_DRAFTERS


def _describe(per_rank: Sequence[dict[str, frozenset[int]]]) -> str:
    return "; ".join(
        f"rank {r}: " + ", ".join(f"{kernel} accepts {sorted(sizes)}" for kernel, sizes in kernels.items())
        for r, kernels in enumerate(per_rank)
    )


def check_target_page_size(page_size: int, target_kernels: Sequence[dict[str, frozenset[int]]]) -> int:
    """The target keeps the configured page size, which every target kernel on every rank must take."""
    for rank, kernels in enumerate(target_kernels):
        for kernel, sizes in kernels.items():
            if page_size not in sizes:
                raise ValueError(f"tokens_per_block {page_size} is not accepted by the target kernel {kernel} "
                                 f"on rank {rank}, which accepts {sorted(sizes)}")
    return page_size


def choose_draft_page_size(method: str | None, target_page_size: int,
                           draft_kernels: Sequence[dict[str, frozenset[int]]]) -> int | None:
    """Page size of the draft pool, or None when there is none.

    Rule: plain decoding and pool-less drafters (ngram) have none; one-model drafters keep the
    target's page size; standalone drafters keep it when
    every drafter kernel on every rank accepts it, else fall back to 32; if 32 is not
    accepted everywhere either, a clear error listing what each rank's kernels accept."""
    if method is None or method in POOL_LESS_DRAFTERS:
        return None
    if not has_separate_draft_pool(method):
        return target_page_size
    everywhere = [sizes for kernels in draft_kernels for sizes in kernels.values()]
    for candidate in (target_page_size, DRAFT_FALLBACK_PAGE_SIZE):
        if all(candidate in sizes for sizes in everywhere):
            return candidate
    raise ValueError(
        f"no draft page size works on every rank: the target's {target_page_size} and the fallback "
        f"{DRAFT_FALLBACK_PAGE_SIZE} are each rejected somewhere ({_describe(draft_kernels)})"
    )
