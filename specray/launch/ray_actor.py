"""One Ray actor per rank: the shim between Ray and the rank code in ``launch/rank.py``.

Lifecycle (driven by ``launch/ray.py``): ``node_info`` -> rank 0's ``open_store`` -> ``setup``
on every actor (collective) -> ``run`` on every actor, which holds the actor's thread for the
life of the job (rank 0 runs the engine loop, the others follow). Rank 0's ``add`` and
``abort`` run in other actor threads and only put a message in the loop's inbox (a queue the
loop drains between steps); ``deltas`` is a long poll that returns the loop's outputs as
soon as there are any (or an empty list after its timeout). So the driver writes the inbox
and reads the outbox but never drives a step. ``ping`` and ``health`` run in further threads
(the actor's ``max_concurrency``) and only read, so they answer while the rank is busy: the
driver's failure watch relies on that.
"""

from __future__ import annotations

import os
import queue
import threading

import torch

from specray.comm.rendezvous import Rendezvous, host_store
from specray.config import EngineConfig
from specray.executor.loop import CloseLoop
from specray.executor.outputs import AbortRequests, AddRequests, LoopOutput
from specray.kv.agreement import fingerprint
from specray.launch.local import drain
from specray.launch.rank import run_rank, start_rank
from specray.launch.ray_placement import cuda_ordinal

ACTOR_THREADS = 6  # run + add/abort + deltas + ping + health, and one to spare


class RankActor:
    def __init__(self, config: EngineConfig, rank: int):
        self.config, self.rank = config, rank
        self.session = None
        self.state = "starting"
        self._store = None
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: list[LoopOutput] = []
        self._has_output = threading.Condition()

    def node_info(self) -> dict:
        """Where this actor runs, and (on CUDA) the ordinal of the GPU Ray gave it."""
        import ray

        device_index = None
        if self.config.device.startswith("cuda"):
            gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
            device_index = cuda_ordinal(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return dict(ray_node_id=ray.get_runtime_context().get_node_id(), node_ip=ray.util.get_node_ip_address(),
                    pid=os.getpid(), device_index=device_index)

    def open_store(self) -> int:
        """Rank 0 hosts the rendezvous store on a port the kernel picks."""
        self._store = host_store(self.config.parallel.timeout_s, host="0.0.0.0")
        return self._store.port

    def setup(self, rdzv: Rendezvous):
        self.session = start_rank(self.config, rdzv, store=self._store, owns_process=True)
        self.state = "ready"
        return self.session.worker.geometry

    def run(self) -> None:
        s = self.session
        if s.ctx.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(s.ctx.device)
        self.state = "serving" if self.rank == 0 else "following"
        try:
            run_rank(s, self.config, lambda t: drain(self._inbox, t), self._emit)
            self.state = "stopped"
        except BaseException:
            self.state = "failed"
            raise
        finally:
            self.session = None
            with self._has_output:
                self._has_output.notify_all()  # a waiting ``deltas`` returns at once

    def _emit(self, output: LoopOutput) -> None:
        with self._has_output:
            self._outbox.append(output)
            self._has_output.notify_all()

    def add(self, message: AddRequests) -> None:
        self._inbox.put(message)

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(AbortRequests(list(request_ids)))

    def deltas(self, timeout_s: float) -> list[LoopOutput]:
        """The loop's outputs since the last call, waiting up to ``timeout_s`` for the first."""
        with self._has_output:
            if not self._outbox and self.state in ("serving", "ready"):
                self._has_output.wait(timeout_s)
            outputs, self._outbox = self._outbox, []
        return outputs

    def stop(self) -> None:
        self._inbox.put(CloseLoop())

    def ping(self) -> int:
        return self.rank

    def health(self) -> dict:
        """This rank as it sees itself: state, node, device, plan transport, all-reduce paths."""
        report = dict(rank=self.rank, state=self.state, pid=os.getpid())
        s = self.session
        if s is None:
            return report
        ctx = s.ctx
        report.update(node_id=ctx.node_id, local_rank=ctx.local_rank, local_world_size=ctx.local_world_size,
                      device=str(ctx.device), plan_transport=getattr(s.channel, "transport", None),
                      allreduce={name: _allreduce_path(getattr(ctx, name)) for name in ("tp", "moe_tp", "moe_ep")},
                      kv=fingerprint({name: pools for name, pools in (("target", s.worker.pools),
                                                                       ("draft", s.worker.draft_pools)) if pools}))
        return report


def _allreduce_path(group) -> str:
    """The group's fast path ('one_shot' inside a node, 'hierarchical' across nodes), else 'torch'."""
    if group.size == 1:
        return "none"
    reducer = getattr(group, "reducer", None)
    return "torch" if reducer is None else reducer.path
