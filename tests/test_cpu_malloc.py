"""The CPU malloc tuning: freed activations are reused instead of mapped and faulted again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specray.workers.cpu_malloc import tune_cpu_malloc

# In a fresh interpreter, 20 rounds of what a step does: allocate and touch a few
# activations (8 x 4 MB), then free them all; print the minor page faults of the last 19
# rounds (the first grows the heap).
CHILD = """
import resource, sys, torch
from specray.workers.cpu_malloc import tune_cpu_malloc
if sys.argv[1] == "tuned":
    assert tune_cpu_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
weight = torch.ones(5632, 1024)  # a model's weight allocated first, as at load time
before = None
for i in range(20):
    if i == 1:
        before = faults()
    step = [torch.ones(1 << 20) for _ in range(8)]  # 4 MB each: above glibc's initial mmap threshold
    del step
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_malloc_reuses_freed_memory():
    # 19 rounds x 8 x 1024 pages of 4 KB fault when every round maps fresh memory. With
    # glibc's defaults this child faults either on nearly all of them or on ~9000 (it
    # depends on where the heap top lands); tuned, it reuses the memory and faults on
    # (almost) none. The bounds leave room for the interpreter's own faults.
    pages = 19 * 8 * 1024
    assert _faults("default") > 2000
    assert _faults("tuned") < pages // 100


def test_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECRAY_CPU_MALLOC_TUNING", "0")
    assert tune_cpu_malloc() is False


# A fresh interpreter, tuned: a thread allocates and frees what a small model's weights are (300
# tensors of 2 MB, under the raised mmap threshold, in that thread's arena); print the resident
# MB after the free and after release_cpu_malloc.
RELEASE_CHILD = """
import threading, torch
from specray.workers.cpu_malloc import release_cpu_malloc, tune_cpu_malloc
assert tune_cpu_malloc()
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 2**20
def load_and_drop():
    weights = [torch.ones(1 << 19) for _ in range(300)]
    del weights
thread = threading.Thread(target=load_and_drop)
thread.start()
thread.join()
freed = rss_mb()
assert release_cpu_malloc()
print(freed, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_returns_what_the_tuned_malloc_kept():
    # Tuned, the 600 MB freed stay resident (nothing is trimmed under 1 GB an arena); closing
    # a local engine calls release_cpu_malloc, which must give them back.
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, check=True)
    freed_mb, released_mb = map(int, out.stdout.split())
    assert freed_mb - released_mb > 400, (freed_mb, released_mb)
