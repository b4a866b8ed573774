"""One ``mp`` rank process, forked by the rank server (``launch/rank_server.py``).

It reads its job from its pipe to the driver (``RankJob``), starts the rank, reports
``RankReply("ready", ...)`` and then runs the engine loop (rank 0: inbox messages in and
``LoopOutput``s out on the same pipe) or follows (the others). Any failure is reported on the
pipe and the process exits non-zero, so the driver names this rank.
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
from specray.executor.loop import CloseLoop
from specray.launch.rank import RankReply, run_rank, start_rank

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
        run_rank(session, config, lambda t: receive(conn, t), conn.send)
    except BaseException as e:  # report, then exit non-zero: the driver names this rank
        traceback.print_exc()
        try:
            conn.send(RankReply.error(e, is_fatal=True))
        except OSError:
            pass
        raise SystemExit(1)


def receive(conn: Connection, timeout_s: float) -> list:
    """Every message the driver has sent, waiting up to ``timeout_s`` for the first (0: only
    what is already there, so a busy loop never waits on the pipe)."""
    messages = []
    try:
        if conn.poll(timeout_s):
            messages.append(conn.recv())
            while conn.poll(0):
                messages.append(conn.recv())
    except EOFError:  # the driver is gone: stop the job
        messages.append(CloseLoop())
    return messages
