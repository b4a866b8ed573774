"""One engine in a process of its own, driven call by call over a pipe (benchmarks only).

A benchmark that compares configurations side by side holds one engine per configuration. In one
process they share what a process holds once: libgomp's thread count, the allocator's arenas, the
page cache of the weights. Measured 12-07 (docs/benchmarks.md, 10:36): of a plain and a pinned
dflash engine in one process, both spinning at the kernels' barriers, the one built second took
11.0 ms a decode step against 7.8, and built first 10.3 against 10.2. A user's process holds one
engine; ``EngineProcess`` gives each configuration its own, as users run it, and the benchmark's
process only sends work and reads results.

The child builds the engine with ``make_engine(*args)`` (a module-level function, so that the
spawn start method can pickle it), answers "ready", then runs ``call(llm, *args)`` for each
request and sends back what it returns, until told to close. Every wait has a timeout; a child
that dies or exceeds it is an error naming the engine, and ``close`` kills what does not exit.
Children are started one at a time (``start`` waits for "ready"), so the CPU kernels' first build
(models/cpu_kernels.py) never races between two of them.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

READY_TIMEOUT_S = 600.0  # a first start builds the CPU kernels: minutes on a loaded 2-core host
CALL_TIMEOUT_S = 900.0  # the slowest batch of the grid (16 chats at k = 5, every draft rejected) is ~30 s


def _serve(conn, make_engine: Callable, args: tuple) -> None:
    try:
        llm = make_engine(*args)
    except BaseException as exc:  # the parent raises it with the engine's name
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", "ready"))
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            call, call_args = message
            try:
                conn.send(("ok", call(llm, *call_args)))
            except BaseException as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        llm.close()


class EngineProcess:
    def __init__(self, name: str, make_engine: Callable, *args: Any):
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, make_engine, args), name=f"engine {name}", daemon=True)
        self._proc.start()
        child.close()
        try:
            self._receive(READY_TIMEOUT_S, "start")
        except BaseException:  # the child failed to build its engine, died or hung: leave nothing behind
            self.close()
            raise

    def _receive(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            self.close()
            raise TimeoutError(f"engine process {self.name!r}: no answer to {what} within {timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"engine process {self.name!r} died during {what} "
                               f"(exit code {self._proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"engine process {self.name!r}, {what}: {value}")
        return value

    def call(self, function: Callable, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """``function(llm, *args)`` in the engine's process (a module-level function), its result."""
        self._conn.send((function, args))
        return self._receive(timeout_s, getattr(function, "__name__", "a call"))

    def close(self, timeout_s: float = 60.0) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10.0)
        self._conn.close()
