"""The ``local`` launcher: one rank in the caller's process; the engine loop runs in a thread.

The driver (``LLM``, ``AsyncLLM``) and the loop talk through thread-safe queues: the inbox is
a ``queue.Queue`` the loop drains before every step, and the outbox is the client's
``dispatch``, called from the loop thread. The loop thread blocks on the inbox when idle.

The loop thread also builds the rank (loads the model, allocates the pools), so that one
thread runs every torch op and CPU kernel of the engine. OpenMP (libgomp, torch's and the
kernels') keeps a pool of worker threads per thread that starts a parallel region, and once
the process holds more pool threads than cores, every barrier wait stops spinning after a
short count and sleeps on a futex. A decode step ends 120+ parallel regions at a barrier, so
on a 2-core machine a model loaded by the caller's thread and stepped by the loop thread
made each step ~5 ms (20%) slower (docs/cpu-kernels.md, "Engine overhead per step").
"""

from __future__ import annotations

import queue
import threading

from specray.comm.context import DistContext
from specray.config import EngineConfig
from specray.errors import EngineClosed
from specray.executor.client import EngineClient
from specray.executor.engine import EngineCore
from specray.executor.loop import CloseLoop, run_loop
from specray.launch.procs import RankFailure
from specray.workers.worker import RankWorker


def drain(inbox: queue.Queue, timeout_s: float) -> list:
    """Every message waiting in ``inbox``, waiting up to ``timeout_s`` for the first (0: none)."""
    messages = []
    try:
        messages.append(inbox.get(timeout=timeout_s) if timeout_s > 0 else inbox.get_nowait())
        while True:
            messages.append(inbox.get_nowait())
    except queue.Empty:
        return messages


class LocalEngine:
    def __init__(self, config: EngineConfig):
        if config.parallel.world_size != 1:
            raise ValueError(f"launcher 'local' runs one rank, but tp_size is {config.parallel.tp_size}")
        self.config = config
        self.core: EngineCore | None = None  # built by the loop thread (see the module docstring)
        self._start_error: BaseException | None = None
        self._started = threading.Event()
        self._inbox: queue.Queue = queue.Queue()
        self.client = EngineClient(self._inbox.put, self._check_alive, config.parallel.failure_timeout_s)
        self._thread = threading.Thread(target=self._run, name="specray-engine-loop", daemon=True)
        self._thread.start()
        self._wait_started()
        self.geometry = self.core.geometry

    def _wait_started(self) -> None:
        """Wait for the loop thread to build the rank, in slices that check it is alive; raise
        what its start-up raised (a bad config stays a ValueError)."""
        try:
            while not self._started.wait(self.config.parallel.failure_timeout_s):
                if not self._thread.is_alive():
                    raise RuntimeError("the engine loop thread ended during start-up")
        except BaseException:  # interrupted: the loop ends as soon as it starts
            self._inbox.put(CloseLoop())
            raise
        if self._start_error is not None:
            raise self._start_error

    # rank 0's state, read by tests and tools (the loop thread owns it)
    @property
    def worker(self) -> RankWorker:
        return self.core.worker

    @property
    def allocator(self):
        return self.core.allocator

    @property
    def draft_allocator(self):
        return self.core.draft_allocator

    def _start(self) -> bool:
        """Build rank 0 on this thread; False (the error kept for the caller) when it failed."""
        try:
            worker = RankWorker(self.config, DistContext.single(self.config.device))
            worker.init_pools()
            self.core = EngineCore(self.config, worker)
            return True
        except BaseException as e:
            self._start_error = e
            return False
        finally:
            self._started.set()

    def _run(self) -> None:
        if not self._start():
            return
        try:
            run_loop(self.core, lambda t: drain(self._inbox, t), self.client.dispatch,
                     self.config.parallel.timeout_s / 4)
        except BaseException as e:
            failure = RankFailure.build("the engine loop", [], {0: f"{type(e).__name__}: {e}"})
            failure.__cause__ = e
            self.client.fail(failure)

    def _check_alive(self) -> None:
        if self.client.error is None and not self._thread.is_alive():
            self.client.fail(RankFailure.build("the engine loop", [], {0: "its thread ended"}))
        if self.client.error is not None:
            raise self.client.error

    def generate(self, prompts, params):
        return self.client.generate(prompts, params)

    def close(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(CloseLoop())
            self._thread.join(self.config.parallel.timeout_s)
        self.client.fail(EngineClosed("this engine is closed"))
        if not self._thread.is_alive() and self.core is not None:
            self.core.close()
            self.core.worker.release()  # the memory comes back at close, not at some later gc pass
