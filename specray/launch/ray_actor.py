"""One Ray actor per rank: the shim between Ray and the rank code in ``launch/rank.py``.

Lifecycle (driven by ``launch/ray.py``): ``node_info`` -> rank 0's ``open_store`` -> ``setup``
on every actor (collective) -> ``run`` on every actor, which holds the actor's loop for the
life of the job (rank 0 serves, the others follow). Rank 0's ``submit`` runs in a second
actor thread and hands the call to that loop through a queue, so the driver submits
requests and collects outputs but never drives a step. ``ping`` and ``health`` run in
further threads (the actor's ``max_concurrency``) and only read, so they answer while the
rank is busy: the driver's failure watch relies on that.
"""

from __future__ import annotations

import os
import queue

import torch

from specray.comm.rendezvous import Rendezvous, host_store
from specray.config import EngineConfig
from specray.kv.agreement import fingerprint
from specray.launch.rank import CLOSE, RankReply, RankRequest, run_rank, start_rank
from specray.launch.ray_placement import cuda_ordinal

ACTOR_THREADS = 4  # run + submit + ping + health


class RankActor:
    def __init__(self, config: EngineConfig, rank: int):
        self.config, self.rank = config, rank
        self.session = None
        self.state = "starting"
        self._store = None
        self._requests: queue.Queue = queue.Queue()
        self._reply_box: queue.Queue | None = None

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
            run_rank(s, self.config, self._next_request, self._reply)
            self.state = "stopped"
        except BaseException:
            self.state = "failed"
            raise
        finally:
            self.session = None

    def _next_request(self, timeout_s: float):
        try:
            request, self._reply_box = self._requests.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return request

    def _reply(self, message: RankReply) -> None:
        self._reply_box.put(message)

    def submit(self, prompts, params) -> RankReply:
        box: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((RankRequest("generate", prompts, params), box))
        return box.get()  # bounded: if the loop dies, the driver sees it and kills this actor

    def stop(self) -> None:
        self._requests.put((CLOSE, None))

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
