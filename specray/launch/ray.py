"""The ``ray`` launcher: one actor per rank, in a placement group, on a local or existing
Ray cluster (``RAY_ADDRESS`` or an already initialised ``ray``; else a local one is started
and shut down again by ``close``).

The driver talks to rank 0 only: it submits a call and waits for its outputs while watching
every rank's loop; an actor that dies ends its loop with ``ActorDiedError``, which the
driver turns into an error naming the rank. ``close`` stops the loops, kills the actors and
removes the placement group; it is safe to call twice.
"""

from __future__ import annotations

import os
import time

from specray.comm.rendezvous import Rendezvous, new_job_id
from specray.config import EngineConfig
from specray.launch.procs import RankFailure
from specray.launch.rank import exception_from_reply


class RayEngine:
    def __init__(self, config: EngineConfig):
        import ray

        self.config = config
        self.timeout_s = config.parallel.timeout_s
        self.world_size = config.parallel.world_size
        self.job_id = new_job_id()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**({} if os.environ.get("RAY_ADDRESS") else dict(include_dashboard=False)))
        self._actors, self._loops, self._pg, self._closed = [], [], None, False
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.launch.ray_actor import RankActor

        is_gpu = self.config.device.startswith("cuda")
        bundle = {"CPU": 1, "GPU": 1} if is_gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK", name=f"specray-{self.job_id}")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            raise RuntimeError(f"Ray could not place {self.world_size} ranks of {bundle} within {self.timeout_s:.0f} s;"
                               f" available: {ray.available_resources()}")
        actor_cls = ray.remote(RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(actor_cls.options(num_cpus=1, num_gpus=1 if is_gpu else 0, max_concurrency=2,
                                                  scheduling_strategy=strategy).remote(self.config, rank))
        infos = self._get([a.node_info.remote() for a in self._actors], "start-up", 3 * self.timeout_s)
        self.pids = [pid for _, _, pid in infos]
        port = self._get([self._actors[0].open_store.remote()], "start-up", self.timeout_s)[0]
        node_keys = [node for node, _, _ in infos]
        refs = [a.setup.remote(self._rendezvous(rank, node_keys, infos[0][1], port, is_gpu))
                for rank, a in enumerate(self._actors)]
        self.geometry = self._get(refs, "start-up", 3 * self.timeout_s)[0]
        self._loops = [a.run.remote() for a in self._actors]

    def _rendezvous(self, rank: int, node_keys: list[str], store_host: str, port: int, is_gpu: bool) -> Rendezvous:
        same_node = [r for r, key in enumerate(node_keys) if key == node_keys[rank]]
        return Rendezvous(rank=rank, world_size=self.world_size, local_rank=same_node.index(rank),
                          local_world_size=len(same_node), node_key=node_keys[rank], store_host=store_host,
                          store_port=port, job_id=self.job_id,
                          device_index=0 if is_gpu else None)  # Ray shows each actor only its own GPU

    def _get(self, refs: list, what: str, timeout_s: float) -> list:
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        try:
            return ray.get(refs, timeout=0 if len(ready) == len(refs) else 1)
        except Exception as e:
            raise self._failure(what, f"{type(e).__name__}: {e}") from None

    def generate(self, prompts, params):
        import ray

        if self._closed:
            raise RuntimeError("this LLM is closed")
        call = self._actors[0].submit.remote(prompts, params)
        ready, _ = ray.wait([call] + self._loops, num_returns=1)
        if ready[0] != call:
            raise self._failure("generate")
        reply = ray.get(call)
        if reply[0] == "ok":
            return reply[1]
        if not reply[3]:
            raise exception_from_reply(reply)
        raise self._failure("generate", f"rank 0 reported {reply[1]}: {reply[2]}")

    def _failure(self, what: str, detail: str = "") -> RankFailure:
        """Name the ranks whose actor died (or else the first that failed); stop the job."""
        import ray
        from ray.exceptions import ActorDiedError

        dead, errors = [], {}
        deadline = time.monotonic() + min(5.0, self.timeout_s)
        while self._loops and not dead and time.monotonic() < deadline:
            ready, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0.2)
            for ref in ready:
                rank = self._loops.index(ref)
                try:
                    ray.get(ref)
                except ActorDiedError:
                    dead.append((rank, self.pids[rank], "its Ray actor died"))
                except Exception as e:
                    errors[rank] = f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
        failure = RankFailure.build(what, sorted(set(dead)), errors, detail)
        self._teardown()
        return failure

    def close(self) -> None:
        import ray

        if self._closed:
            return
        if self._loops:
            try:
                self._actors[0].stop.remote()
                ray.wait(self._loops, num_returns=len(self._loops), timeout=self.timeout_s)
            except Exception:
                pass
        self._teardown()

    def _teardown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        for actor in self._actors:
            ray.kill(actor)
        self._actors, self._loops = [], []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
