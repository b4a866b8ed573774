"""Run a benchmark's other engines (llama.cpp, transformers) and its torch set-up work on
short-lived threads.

libgomp (the OpenMP runtime of torch, specray's CPU kernels and llama.cpp's CPU backend) keeps a
pool of threads for every thread that starts a parallel region, until that thread ends. While the
process holds more OpenMP threads than CPUs, every barrier sleeps instead of spinning, and
specray's decode step, which ends 120+ parallel regions, slows by about half
(docs/cpu-kernels.md, "Engine overhead per step"). A benchmark that ran such work on its main
thread would measure specray in that state for the rest of the run; a user's process that serves
with specray alone would not be in it.
"""

from __future__ import annotations

import threading


def on_own_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a new thread that ends with it, so the OpenMP pool it starts
    ends too (see the module docstring); its exception is raised here."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=f"bench-{getattr(fn, '__name__', 'call')}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
