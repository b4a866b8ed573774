"""One ``mp`` rank process, forked by the rank server (``launch/rank_server.py``).

It reads its job from its pipe to the driver (``RankJob``), starts the rank, reports
``RankReply("ready", ...)`` and then serves (rank 0) or follows (the others). Any failure is
reported on the pipe and the process exits non-zero, so the driver names this rank.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from specray.comm.rendezvous import Rendezvous
from specray.config import EngineConfig
from specray.envs import adopt_forwarded_env
from specray.launch.rank import CLOSE, RankReply, RankRequest, run_rank, start_rank

JOB_WAIT_S = 60.0
"""The driver sends the job right after the fork; this only bounds a driver that died in between."""


@dataclass(frozen=True, slots=True)
class RankJob:
    """What the driver sends a new rank process first: the rest of its start-up."""

    config: EngineConfig
    rdzv: Rendezvous
    env: dict[str, str]
    """The driver's forwarded variables (specray.envs.forwarded_env)."""


def run_rank_process(conn_fd: int) -> int:
    """The body of a forked rank: returns its exit code (0 after a clean close)."""
    conn = Connection(conn_fd)
    try:
        if not conn.poll(JOB_WAIT_S):
            print(f"specray rank: no job from the driver within {JOB_WAIT_S:.0f} s", file=sys.stderr)
            return 1
        job: RankJob = conn.recv()
        adopt_forwarded_env(job.env)
        rank_main(job.config, job.rdzv, conn)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # nothing reported yet (e.g. an unreadable job): say it here
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # os._exit follows: nothing else flushes them


def rank_main(config: EngineConfig, rdzv: Rendezvous, conn: Connection) -> None:
    try:
        session = start_rank(config, rdzv, owns_process=True)
        conn.send(RankReply("ready", geometry=session.worker.geometry, pid=os.getpid()))
        run_rank(session, config, lambda t: _next_request(conn, t), conn.send)
    except BaseException as e:  # report, then exit non-zero: the driver names this rank
        traceback.print_exc()
        try:
            conn.send(RankReply.error(e, is_fatal=True))
        except OSError:
            pass
        raise SystemExit(1)


def _next_request(conn: Connection, timeout_s: float) -> RankRequest | None:
    if not conn.poll(timeout_s):
        return None
    try:
        return conn.recv()
    except EOFError:  # the driver is gone: stop the job
        return CLOSE
