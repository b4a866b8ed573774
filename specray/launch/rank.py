"""What every rank process runs, whoever launched it: join the groups, load the shards,
agree the pools, open the control channel; then rank 0 runs the engine loop and the others follow.

``start_rank`` then ``run_rank`` is the whole life of a rank under mp and Ray alike; the
launchers only supply how inbox messages arrive (``receive``) and loop outputs leave
(``emit``). The engine loop (``executor/loop.py``) takes requests at any step and, when
idle, sends a heartbeat down the channel whenever it has waited ``timeout_s / 4`` for a
message, so followers waiting for a plan can tell an idle rank 0 from a dead one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.comm.channel import PlanReceiver, PlanSender, open_channel
from specray.comm.context import DistContext
from specray.comm.rendezvous import Rendezvous
from specray.config import EngineConfig
from specray.executor.engine import EngineCore
from specray.executor.loop import run_loop
from specray.executor.outputs import LoopOutput
from specray.launch.logs import configure_rank_logging
from specray.startup_phases import PhaseClock
from specray.workers.follower import follow
from specray.workers.worker import RankWorker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankSession:
    ctx: DistContext
    worker: RankWorker
    channel: PlanSender | PlanReceiver | None

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.ctx.close()


def start_rank(config: EngineConfig, rdzv: Rendezvous, store=None, owns_process: bool = False) -> RankSession:
    """Collective over every rank of the job. ``owns_process``: the launcher started this
    process for the rank (mp, Ray), so start-up may set process-wide gloo options (lazy
    connections); under ``external`` the process is the user's and keeps its settings.
    With SPECRAY_STARTUP_PROFILE_DIR set, the rank writes how long each phase took there."""
    clock = PhaseClock()
    configure_rank_logging(rdzv.rank)
    if owns_process:
        connect_lazily()
    if config.device == "cpu":
        share_cpu_threads(rdzv.local_world_size)
    ctx = DistContext.create(rdzv, config.parallel, config.device, store, clock=clock)
    try:
        with clock.phase("model_load"):
            worker = RankWorker(config, ctx)
        with clock.phase("geometry_agreement"):
            worker.init_pools()
        with clock.phase("plan_channel"):
            channel = open_channel(ctx)
    except BaseException:
        ctx.close()
        raise
    clock.write(ctx.rank)
    log.info("rank %d/%d on node %d ready (job %s): %s", ctx.rank, ctx.world_size, ctx.node_id, ctx.job_id,
             ", ".join(f"{name} {s:.2f} s" for name, s in clock.phases.items()))
    return RankSession(ctx, worker, channel)


def connect_lazily() -> None:
    """gloo connects a pair of ranks when they first talk instead of every pair at start-up
    (world size squared connections, most never used: a rank talks to its groups and to rank
    0). An explicit TORCH_GLOO_LAZY_INIT in the environment wins."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")


def share_cpu_threads(num_local_ranks: int) -> None:
    """CPU ranks on one host split its cores: oversubscribed intra-op threads make every
    rank wait on the slowest at each collective. An explicit OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // num_local_ranks))


@dataclass(frozen=True, slots=True)
class RankReply:
    """What a rank sends the driver besides loop outputs: ``ready`` (start-up done: geometry
    and pid) or ``error``. Errors travel as plain data (type name and message): exception
    objects from torch may not unpickle elsewhere."""

    kind: str
    geometry: dict | None = None
    pid: int | None = None
    outputs: list | None = None
    error_type: str = ""
    message: str = ""
    is_fatal: bool = False
    """A fatal error broke the job; a non-fatal one (bad input) rejected only the call."""

    @classmethod
    def error(cls, exc: BaseException, is_fatal: bool) -> RankReply:
        return cls("error", error_type=type(exc).__name__, message=str(exc), is_fatal=is_fatal)

    @property
    def is_error(self) -> bool:
        return self.kind == "error"

    def describe(self) -> str:
        return f"{self.error_type}: {self.message}"

    def checked(self, rank: int, fail: Callable[[str], Exception]) -> RankReply:
        """This reply if it is no error. Rank 0's non-fatal error (bad input rejected before any
        step) is raised as it is (a ValueError stays one) and the job goes on; any other error
        is raised as ``fail(detail)``, which stops the job (mp and Ray drivers alike)."""
        if not self.is_error:
            return self
        if not self.is_fatal and rank == 0:
            if self.error_type == "ValueError":
                raise ValueError(self.message)
            raise RuntimeError(f"rank {rank} failed: {self.describe()}")
        raise fail(f"rank {rank} reported {self.describe()}")


def run_rank(session: RankSession, config: EngineConfig, receive: Callable[[float], list | None],
             emit: Callable[[LoopOutput], None]) -> None:
    """A started rank's life until its job ends, under any launcher that talks to rank 0 (mp,
    Ray): rank 0 runs the engine loop (``run_loop``) on the driver's messages, the others
    follow its plans. Closes the session however it ends; a failed step raises."""
    try:
        if session.ctx.rank == 0:
            engine = EngineCore(config, session.worker, session.channel)
            run_loop(engine, receive, emit, config.parallel.timeout_s / 4)
            engine.close()
        else:
            follow(session.worker, session.channel, session.ctx.timeout_s)
    finally:
        session.close()
