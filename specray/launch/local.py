"""The ``local`` launcher: one rank in the caller's process; the engine loop runs in a thread.

The driver (``LLM``, ``AsyncLLM``) and the loop talk through thread-safe queues: the inbox is
a ``queue.Queue`` the loop drains before every step, and the outbox is the client's
``dispatch``, called from the loop thread. The loop thread blocks on the inbox when idle.
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
        worker = RankWorker(config, DistContext.single(config.device))
        worker.init_pools()
        self.core = EngineCore(config, worker)
        self.geometry = self.core.geometry
        self._inbox: queue.Queue = queue.Queue()
        self.client = EngineClient(self._inbox.put, self._check_alive, config.parallel.failure_timeout_s)
        self._thread = threading.Thread(target=self._run, name="specray-engine-loop", daemon=True)
        self._thread.start()

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

    def _run(self) -> None:
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
        if not self._thread.is_alive():
            self.core.close()
