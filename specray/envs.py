"""Environment variables specray reads on each rank (operators and tests set them).

A value applies to every rank, or to chosen ranks with ``rank:value`` items separated by
``;`` (``"1:32"`` narrows rank 1 only; ``"0:0.2;1:0.4"`` gives each rank its own value).

| variable                          | meaning                                                        |
|-----------------------------------|----------------------------------------------------------------|
| SPECRAY_KV_MEMORY_FRACTION        | this rank's kv.memory_fraction                                 |
| SPECRAY_DRAFT_KERNEL_PAGE_SIZES   | narrow this rank's drafter-kernel page sizes (comma list)      |
| SPECRAY_FAULT_KV_EXTRA_BLOCKS     | testing only: allocate this many extra blocks, which the       |
|                                   | fingerprint check must catch                                   |
"""

from __future__ import annotations

import os


def rank_value(name: str, rank: int) -> str | None:
    """The value of ``name`` for ``rank``, or None when it is unset for that rank."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    if ":" not in raw:
        return raw.strip()
    for item in raw.split(";"):
        who, _, value = item.partition(":")
        if who.strip() == str(rank):
            return value.strip()
    return None


def rank_page_sizes(name: str, rank: int) -> frozenset[int] | None:
    value = rank_value(name, rank)
    if value is None:
        return None
    try:
        return frozenset(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: page sizes must be integers like '32,64'") from None
