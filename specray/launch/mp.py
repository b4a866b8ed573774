"""The ``mp`` launcher: N rank processes on this host, started for the driver.

The driver (the process that built the ``LLM``) is not a rank: it holds the rendezvous
store, talks to rank 0 over a pipe (one call at a time: "generate" -> outputs), and watches
every rank process. Rank 0 drives the step loop; followers read its plans from shared
memory. Keeping the driver out of the ranks keeps torch.distributed state out of the user's
process, lets it name a rank that died (its status pipe fires) and lets ``close`` clean up
everything it started.

Ranks are forked by the rank server (``launch/rank_server.py``), a ``python -m`` process that
never imports the user's ``__main__``: scripts without an ``if __name__ == "__main__":``
guard, ``python -c`` and notebooks all work. Each rank reads its job (``RankJob``) from its
pipe; requests (``RankRequest``) and replies (``RankReply``) are small dataclasses.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait

from specray.comm.rendezvous import Rendezvous, host_key, host_store, new_job_id
from specray.config import EngineConfig
from specray.envs import forwarded_env
from specray.launch.mp_rank import RankJob
from specray.launch.procs import RankFailure, stop_processes
from specray.launch.rank import CLOSE, RankReply, RankRequest
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
        self._call_lock = threading.Lock()
        try:
            self._spawn()
            replies = self._await([self._conns[r] for r in range(self.world_size)], "start-up",
                                  deadline_s=3 * self.timeout_s)
        except BaseException:
            self._stop()
            raise
        self.geometry = replies[0].geometry
        self.pids = [r.pid for r in replies]

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

    def _failure(self, what: str, detail: str = "") -> RankFailure:
        """Name the ranks that died (or else the first that reported an error), stop the job."""
        failure = RankFailure.from_processes(what, self._procs, self._conns, detail)
        self._stop()
        return failure

    def generate(self, prompts, params):
        with self._call_lock:  # one call at a time on the pipe to rank 0
            if self._closed:
                raise RuntimeError("this LLM is closed")
            self._conns[0].send(RankRequest("generate", prompts, params))
            return self._await([self._conns[0]], "generate")[0].outputs

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._conns[0].send(CLOSE)
        except (OSError, IndexError):
            pass
        self._stop(grace_s=self.timeout_s)

    def _stop(self, grace_s: float = 1.0) -> None:
        self._closed = True
        stop_processes(self._procs, grace_s)
        for proc in self._procs:
            proc.close()
        for conn in self._conns:
            conn.close()
        self._store = None
