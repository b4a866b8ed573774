"""The ``mp`` launcher: N rank processes on this host, spawned by the driver.

The driver (the process that built the ``LLM``) is not a rank: it holds the rendezvous
store, talks to rank 0 over a pipe (one call at a time: "generate" -> outputs), and watches
every rank process. Rank 0 drives the step loop; followers read its plans from shared
memory. Keeping the driver out of the ranks keeps torch.distributed state out of the user's
process, lets it name a rank that died (its process sentinel fires) and lets ``close`` clean
up everything it started. Ranks are started without ``fork`` from the driver, so a user script
that builds an ``LLM`` at top level needs the usual ``if __name__ == "__main__":`` guard
(they are forked from a forkserver: see ``_process_context``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import traceback
from multiprocessing.connection import Connection, wait

from specray.comm.rendezvous import Rendezvous, host_key, host_store, new_job_id
from specray.config import EngineConfig
from specray.envs import forwarded_env
from specray.executor.engine import EngineCore
from specray.launch.procs import RankFailure, describe_exit, stop_processes
from specray.launch.rank import error_reply, exception_from_reply, run_follower, serve, start_rank

log = logging.getLogger(__name__)


def _rank_main(config: EngineConfig, rdzv: Rendezvous, conn: Connection, env: dict[str, str]) -> None:
    """Entry point of one rank process; ``env``: the driver's forwarded variables."""
    os.environ.update(env)
    session = None
    try:
        session = start_rank(config, rdzv)
        conn.send(("ready", session.worker.geometry, os.getpid()))
        if rdzv.rank == 0:
            engine = EngineCore(config, session.worker, session.channel)
            serve(engine, lambda t: _next_request(conn, t), conn.send, config.parallel.timeout_s / 4)
            engine.close()
        else:
            run_follower(session)
    except BaseException as e:  # report, then exit non-zero: the driver names this rank
        traceback.print_exc()
        try:
            conn.send(error_reply(e, True))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if session is not None:
            session.close()


def _next_request(conn: Connection, timeout_s: float):
    if not conn.poll(timeout_s):
        return None
    try:
        return conn.recv()
    except EOFError:  # the driver is gone: stop the job
        return ("close",)


def _process_context():
    """forkserver, with this module (torch and specray) preloaded in the server: each rank is
    forked from a process that already imported them, so a rank starts in well under a
    second instead of paying the torch import again. The server forks before anything
    touches CUDA, so CUDA is safe in the ranks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["specray.launch.mp"])
    return ctx


class MPEngine:
    """Driver-side handle: generate / geometry / close, like ``EngineCore``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.timeout_s = config.parallel.timeout_s
        self.world_size = config.parallel.world_size
        self.job_id = new_job_id()
        self._store = host_store(self.timeout_s)
        self._procs: list[mp.Process] = []
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
        self.geometry = replies[0][1]
        self.pids = [r[2] for r in replies]

    def _spawn(self) -> None:
        ctx = _process_context()
        for rank in range(self.world_size):
            rdzv = Rendezvous(rank=rank, world_size=self.world_size, local_rank=rank,
                              local_world_size=self.world_size, node_key=host_key(),
                              store_host="127.0.0.1", store_port=self._store.port, job_id=self.job_id)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(self.config, rdzv, child, forwarded_env()), daemon=True,
                               name=f"specray-{self.job_id}-rank{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def _await(self, conns: list[Connection], what: str, deadline_s: float | None = None) -> list[tuple]:
        """One reply from each of ``conns``, watching every rank; any death or error fails."""
        pending = {c: self._conns.index(c) for c in conns}
        replies: dict[int, tuple] = {}
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
                    if reply[0] == "error":
                        if not reply[3] and rank == 0:
                            raise exception_from_reply(reply)
                        raise self._failure(what, f"rank {rank} reported {reply[1]}: {reply[2]}")
                    replies[rank] = reply
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
            self._conns[0].send(("generate", prompts, params))
            return self._await([self._conns[0]], "generate")[0][1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._conns[0].send(("close",))
        except (OSError, IndexError):
            pass
        self._stop(grace_s=self.timeout_s)

    def _stop(self, grace_s: float = 1.0) -> None:
        self._closed = True
        stop_processes(self._procs, grace_s)
        for conn in self._conns:
            conn.close()
        self._store = None
