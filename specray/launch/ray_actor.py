"""One Ray actor per rank: the shim between Ray and the rank code in ``launch/rank.py``.

Lifecycle (driven by ``launch/ray.py``): ``node_info`` -> rank 0's ``open_store`` -> ``setup``
on every actor (collective) -> ``run`` on every actor, which holds the actor's loop for the
life of the job (rank 0 serves, the others follow). Rank 0's ``submit`` runs in a second
actor thread and hands the call to that loop through a queue, so the driver submits
requests and collects outputs but never drives a step.
"""

from __future__ import annotations

import os
import queue

import torch

from specray.comm.rendezvous import Rendezvous, host_store
from specray.config import EngineConfig
from specray.executor.engine import EngineCore
from specray.launch.rank import run_follower, serve, start_rank


class RankActor:
    def __init__(self, config: EngineConfig, rank: int):
        self.config, self.rank = config, rank
        self.session = None
        self._store = None
        self._requests: queue.Queue = queue.Queue()
        self._reply_box: queue.Queue | None = None

    def node_info(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def open_store(self) -> int:
        """Rank 0 hosts the rendezvous store on a port the kernel picks."""
        self._store = host_store(self.config.parallel.timeout_s, host="0.0.0.0")
        return self._store.port

    def setup(self, rdzv: Rendezvous):
        self.session = start_rank(self.config, rdzv, store=self._store)
        return self.session.worker.geometry

    def run(self) -> None:
        s = self.session
        if s.ctx.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(s.ctx.device)
        try:
            if self.rank == 0:
                engine = EngineCore(self.config, s.worker, s.channel)
                serve(engine, self._next_request, self._reply, self.config.parallel.timeout_s / 4)
                engine.close()
            else:
                run_follower(s)
        finally:
            s.close()
            self.session = None

    def _next_request(self, timeout_s: float):
        try:
            request, self._reply_box = self._requests.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return request

    def _reply(self, message: tuple) -> None:
        self._reply_box.put(message)

    def submit(self, prompts, params) -> tuple:
        box: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((("generate", prompts, params), box))
        return box.get()  # bounded: if the loop dies, the driver sees it and kills this actor

    def stop(self) -> None:
        self._requests.put((("close",), None))
