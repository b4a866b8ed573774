"""The ``external`` launcher: torchrun (or Slurm/mpirun in torchrun's manner) started every
process, and every process runs the same user script (SPMD).

Each process reads its rank and the rendezvous from the environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GROUP_RANK names the node) and
becomes one rank. Rank 0 runs the engine loop in its batch form (``run_until_idle``: the
call's requests added at once, stepped until none is left, in the calling thread), read by
the same client as every launcher; on the other ranks ``LLM.generate`` follows rank 0's plans
until rank 0 marks the end of the call, then returns the outputs rank 0 sends,
so every rank returns the same outputs and an unchanged script works on all of them.
Rank 0's prompts are the ones served: the other ranks' arguments are not used. A follower
waits for each plan at most ``timeout_s``, so the ranks must call ``generate`` together.
"""

from __future__ import annotations

from specray.comm.rendezvous import from_torchrun_env
from specray.config import EngineConfig
from specray.executor.client import EngineClient
from specray.executor.engine import EngineCore
from specray.executor.loop import run_until_idle
from specray.launch.mapping import validate_mapping
from specray.launch.rank import RankSession, start_rank
from specray.models.arch import ModelArch
from specray.workers.follower import follow
from specray.workers.plan import CallEnd


class ExternalCoordinator:
    def __init__(self, config: EngineConfig, session: RankSession):
        self.session = session
        self.rank = 0
        self.engine = EngineCore(config, session.worker, session.channel)
        self.geometry = self.engine.geometry
        # sending a message runs the loop on it until idle, here: the streams are full before they are read
        self.client = EngineClient(lambda m: run_until_idle(self.engine, [m], self.client.dispatch),
                                   self._check_alive, config.parallel.failure_timeout_s)

    def _check_alive(self) -> None:
        raise RuntimeError("rank 0's loop went idle with a request of this call unfinished")

    def generate(self, prompts, params):
        """Serve the call, then send the followers its outputs (or the error that rejected it)."""
        try:
            outputs = self.client.generate(prompts, params)
            if not prompts:  # no request, no plan: the followers still wait for the call's end
                self.engine.settle()
        except ValueError as e:  # rejected before any step: the job goes on
            if not self.engine.is_broken:
                self._send(CallEnd(error=str(e)))
            raise
        self._send(CallEnd(outputs=outputs))
        return outputs

    def _send(self, message: CallEnd) -> None:
        if self.engine.channel is not None:
            self.engine.channel.send(message)

    def close(self) -> None:
        if self.session is None:
            return
        try:
            self.engine.close()
        finally:
            self.session.close()
            self.session = None


class ExternalFollower:
    def __init__(self, session: RankSession):
        self.session = session
        self.rank = session.ctx.rank
        self.geometry = session.worker.geometry

    def generate(self, prompts, params):
        """Follow rank 0's plans for one call; return rank 0's outputs (or raise its error)."""
        s = self.session
        end = follow(s.worker, s.channel, s.ctx.timeout_s, until_call_end=True)
        if end is None:
            raise RuntimeError(f"rank {self.rank}: rank 0 shut down while this rank called generate")
        if end.error is not None:
            raise ValueError(end.error)
        return end.outputs

    def close(self) -> None:
        if self.session is None:
            return
        try:  # rank 0's close sends the shutdown plan: wait for it, so no rank leaves early
            follow(self.session.worker, self.session.channel, self.session.ctx.timeout_s)
        finally:
            self.session.close()
            self.session = None


def start_external(config: EngineConfig, arch: ModelArch):
    rdzv = from_torchrun_env()
    validate_mapping(arch, config.parallel, world_size=rdzv.world_size)
    session = start_rank(config, rdzv)
    if rdzv.rank == 0:
        return ExternalCoordinator(config, session)
    return ExternalFollower(session)
