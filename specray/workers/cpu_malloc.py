"""Keep freed CPU tensors' memory in the process (glibc malloc tuning for CPU ranks).

A decode step allocates and frees the same activations every step (a few hundred KB to
tens of MB). glibc serves allocations above its mmap threshold (128 KB at start) with a
fresh ``mmap`` and gives the top of the heap back to the kernel when it frees more than
its trim threshold, so each step the same buffers are mapped again and every page of them
faults on first touch: on the 2-core VM that measured ~20% of a batch-8 decode step of
mid-llama. Raising both thresholds makes malloc reuse the freed memory instead.

This is what CPU inference stacks get from preloading tcmalloc or jemalloc; ``mallopt``
does it without a preload. It is process-wide (under the ``local`` launcher, the caller's
process) and only keeps memory the process already used, so resident memory stays at its
peak rather than shrinking between steps. ``SPECRAY_CPU_MALLOC_TUNING=0`` turns it off.

The same tuning keeps what a closed engine freed: its weights are thousands of tensors under
the 32 MB mmap threshold, served from whichever malloc arena the thread that loaded them used,
and nothing is trimmed below 1 GB an arena. A process that builds engine after engine on new
threads (the test suite: 18 GB) then holds every arena's leftovers, so closing a local engine
calls ``release_cpu_malloc`` (glibc's ``malloc_trim``, which returns every arena's free pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit hosts
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20


def _glibc():
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def release_cpu_malloc() -> bool:
    """Give the free memory of every malloc arena back to the kernel; True when some went back
    (False too where there is no glibc ``malloc_trim``)."""
    try:
        return bool(_glibc().malloc_trim(0))
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        return False


def tune_cpu_malloc() -> bool:
    """Apply the tuning once per process; True when glibc accepted every setting."""
    if os.environ.get("SPECRAY_CPU_MALLOC_TUNING", "1").strip() == "0":
        return False
    try:
        mallopt = _glibc().mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    accepted = all(mallopt(param, value) == 1 for param, value in settings)
    if not accepted:
        log.warning("glibc refused part of the malloc tuning; CPU steps may page-fault on fresh activations")
    return accepted
