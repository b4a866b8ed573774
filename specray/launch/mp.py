"""The ``mp`` launcher: N rank processes on this host, started for the driver.

The driver (the process that built the ``LLM``) is not a rank: it holds the rendezvous
store, writes rank 0's inbox over a pipe (``AddRequests``, ``AbortRequests``, from any thread)
and reads rank 0's outbox from the same pipe in one reader thread, which routes each
``LoopOutput`` to the client's per-request streams and watches every rank process: a death
(its status pipe fires) or an error report fails every request in flight at once. Rank 0
runs the engine loop, polling its pipe between steps without blocking; followers read its
plans from shared memory. Keeping the driver out of the ranks keeps torch.distributed state out of the user's
process, lets it name a rank that died (its status pipe fires) and lets ``close`` clean up
everything it started.

Ranks are forked by the rank server (``launch/rank_server.py``), a ``python -m`` process that
never imports the user's ``__main__``: scripts without an ``if __name__ == "__main__":``
guard, ``python -c`` and notebooks all work. Each rank reads its job (``RankJob``) from its
pipe; start-up replies (``RankReply``) and loop messages (``executor/outputs.py``) are small
dataclasses.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait

from specray.comm.rendezvous import Rendezvous, host_key, host_store, new_job_id
from specray.config import EngineConfig
from specray.envs import forwarded_env
from specray.errors import EngineClosed
from specray.executor.client import EngineClient
from specray.executor.loop import CloseLoop
from specray.executor.outputs import LoopOutput
from specray.launch.mp_rank import RankJob
from specray.launch.procs import RankFailure, stop_processes
from specray.launch.rank import RankReply
from specray.launch.spawner import RankProcess, rank_server

log = logging.getLogger(__name__)


class MPEngine:
    """Driver-side handle: generate / geometry / close, like ``EngineCore``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.timeout_s = config.parallel.timeout_s
        self.world_size = config.parallel.world_size
        self.job_id = new_job_id()
        self._store = host_store(self.timeout_s)
        self._procs: list[RankProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        try:
            self._spawn()
            replies = self._await([self._conns[r] for r in range(self.world_size)], "start-up",
                                  deadline_s=3 * self.timeout_s)
        except BaseException:
            self._stop()
            raise
        self.geometry = replies[0].geometry
        self.pids = [r.pid for r in replies]
        self.client = EngineClient(self._send, self._check_alive, config.parallel.failure_timeout_s)
        self._reader = threading.Thread(target=self._read, name="specray-mp-reader", daemon=True)
        self._reader.start()

    def _spawn(self) -> None:
        server = rank_server()
        env = forwarded_env()
        for rank in range(self.world_size):
            rdzv = Rendezvous(rank=rank, world_size=self.world_size, local_rank=rank,
                              local_world_size=self.world_size, node_key=host_key(),
                              store_host="127.0.0.1", store_port=self._store.port, job_id=self.job_id)
            parent, child = Pipe()
            try:
                proc = server.start_rank(child.fileno(), self.timeout_s)
            finally:
                child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            parent.send(RankJob(self.config, rdzv, env))

    def _await(self, conns: list[Connection], what: str, deadline_s: float | None = None) -> list[RankReply]:
        """One reply from each of ``conns``, watching every rank; any death or error fails."""
        pending = {c: self._conns.index(c) for c in conns}
        replies: dict[int, RankReply] = {}
        watched = {p.sentinel: r for r, p in enumerate(self._procs)}
        watched.update({c: r for r, c in enumerate(self._conns)})
        while pending:
            ready = wait(list(watched), timeout=deadline_s)
            if not ready:
                raise self._failure(what, f"no reply within {deadline_s:.0f} s")
            for handle in ready:
                rank = watched[handle]
                if handle in pending and handle.poll():
                    try:
                        reply = handle.recv()
                    except EOFError:
                        raise self._failure(what) from None
                    replies[rank] = reply.checked(rank, lambda detail: self._failure(what, detail))
                    del pending[handle]
                    del watched[handle]
                elif handle not in pending:  # a death, or an error from a rank we did not ask
                    raise self._failure(what)
        return [replies[r] for r in sorted(replies)]

    def _failure(self, what: str, detail: str = "", errors: dict[int, str] | None = None) -> RankFailure:
        """Name the ranks that died (or else the first that reported an error), stop the job."""
        failure = RankFailure.from_processes(what, self._procs, self._conns, detail, errors=errors)
        self._stop(error=failure)
        return failure

    def _send(self, message) -> None:
        with self._send_lock:
            if self._closed:
                raise self.client.error or EngineClosed("this LLM is closed")
            try:
                self._conns[0].send(message)
                return
            except OSError:  # rank 0 is gone: the reader names it
                pass
        self._reader.join(self.timeout_s)
        self._check_alive()
        raise self.client.error

    def _read(self) -> None:
        """The reader thread: route rank 0's outputs; on any death or error, fail everything."""
        rank0 = self._conns[0]
        watched = [rank0] + [p.sentinel for p in self._procs] + self._conns[1:]
        try:
            while not self._closed:
                ready = wait(watched, timeout=self.timeout_s / 4)  # wakes for close, too
                if rank0 in ready and rank0.poll():
                    message = rank0.recv()
                    if isinstance(message, LoopOutput):
                        self.client.dispatch(message)
                        continue
                    raise self._failure("generate", errors={0: message.describe()})
                if ready and not self._closed:
                    raise self._failure("generate")
        except EOFError:
            if not self._closed:
                self.client.fail(self._failure("generate"))
        except RankFailure as failure:
            self.client.fail(failure)
        except BaseException as e:  # a driver bug: fail loudly rather than hang the callers
            if self._closed:
                return
            self.client.fail(RankFailure(f"the mp driver's reader failed: {type(e).__name__}: {e}", []))
            raise

    def _check_alive(self) -> None:
        if self.client.error is None and not self._reader.is_alive():
            self.client.fail(EngineClosed("this LLM is closed") if self._closed else self._failure("generate"))
        if self.client.error is not None:
            raise self.client.error

    @property
    def is_healthy(self) -> bool:
        return self.client.is_healthy

    def generate(self, prompts, params):
        return self.client.generate(prompts, params)

    def close(self) -> None:
        if self._closed:  # a failure may be stopping the job in the reader: let it finish
            if self._reader not in (None, threading.current_thread()):
                self._reader.join(self.timeout_s)
            return
        try:
            with self._send_lock:
                self._conns[0].send(CloseLoop())
        except (OSError, IndexError):
            pass
        self._stop(grace_s=self.timeout_s)

    def _stop(self, grace_s: float = 1.0, error: BaseException | None = None) -> None:
        """Stop every rank, then end every stream in flight with ``error`` (closed by default)."""
        self._closed = True
        stop_processes(self._procs, grace_s)
        if self._reader not in (None, threading.current_thread()):
            self._reader.join(self.timeout_s)  # it wakes at the deaths (or within timeout_s / 4) and sees _closed
        for proc in self._procs:
            proc.close()
        for conn in self._conns:
            conn.close()
        self._store = None
        if hasattr(self, "client"):
            self.client.fail(error or EngineClosed("this LLM is closed"))
