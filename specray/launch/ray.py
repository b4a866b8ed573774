"""The ``ray`` launcher: one actor per rank, placed as ``ray_placement`` describes, on the Ray
cluster this process is connected to (else the one ``ray_connect.connect_ray`` joins or starts,
which ``close`` disconnects from or shuts down again).

Each actor gets the driver's forwarded variables (``specray.envs.forwarded_env``: specray's
own, NCCL_*, GLOO_*, the thread counts) under the user's ``ParallelConfig.runtime_env``.

The driver talks to rank 0 only, from two threads: a sender that delivers inbox messages
(``add``, ``abort``) one after another (a threaded actor does not keep the order of calls
in flight, so each waits for the previous), and a reader that long-polls rank 0's ``deltas``
and routes them to the client's streams while watching every rank. The watch bounds how
long a failure takes to surface (``failure_timeout_s``, F):

- a rank's loop that ends (its actor died, or the rank failed) ends the wait at once;
- every actor is pinged every F/8 from the driver (the actor answers from a spare thread),
  and a ping unanswered for F/2 (a hung process, a lost node) fails the call;
- the failure then waits at most F/8 for the other loops to show who died, so the error
  names the rank that died, with its node, rather than a peer whose collective failed;
- every request in flight then ends with that ``RankFailure``.

Every failure tears the job down: actors killed, the placement group removed (when specray
made it). Shared memory needs no extra step: segment names are unlinked once mapped, and the
mappings die with the processes. ``close`` is safe to call twice.
"""

from __future__ import annotations

import queue
import threading
import time

from specray.comm.rendezvous import Rendezvous, new_job_id
from specray.config import EngineConfig
from specray.envs import forwarded_env
from specray.errors import EngineClosed
from specray.executor.client import EngineClient
from specray.executor.outputs import AbortRequests
from specray.launch.procs import RankFailure
from specray.launch.ray_connect import connect_ray
from specray.launch.ray_health import health_reports, last_line, settle_loops
from specray.launch.ray_placement import RankPlacement, actor_resources, place_ranks

PING_FRACTION, UNRESPONSIVE_FRACTION, SETTLE_FRACTION = 1 / 8, 1 / 2, 1 / 8  # of failure_timeout_s


def actor_runtime_env(user_env: dict | None) -> dict:
    """The user's runtime_env, with the forwarded variables under its own env_vars."""
    user_env = dict(user_env or {})
    return {**user_env, "env_vars": {**forwarded_env(), **user_env.get("env_vars", {})}}


class RayEngine:
    def __init__(self, config: EngineConfig):
        import ray

        self.config = config
        self.timeout_s = config.parallel.timeout_s
        self.failure_timeout_s = config.parallel.failure_timeout_s
        self.world_size = config.parallel.world_size
        self.job_id = new_job_id()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            connect_ray(config.parallel.ray_address)
        self._actors, self._loops, self._pg, self._owns_pg, self._closed = [], [], None, False, False
        self.placements: list[RankPlacement] = []
        self.pids: list[int] = []
        self._pings: dict[int, tuple] = {}
        self._pinged_at = 0.0
        self._closing = False
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise
        self.client = EngineClient(self._send, self._check_alive, self.failure_timeout_s)
        self._outgoing: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._deliver, name="specray-ray-sender", daemon=True),
                         threading.Thread(target=self._read, name="specray-ray-reader", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _start(self) -> None:
        import ray

        from specray.launch.ray_actor import RankActor

        is_gpu = self.config.device.startswith("cuda")
        self._pg, self._owns_pg, self.placements = place_ranks(self.config.parallel, is_gpu,
                                                               name=f"specray-{self.job_id}")
        actor_cls = ray.remote(RankActor)
        self._actors = [self._spawn(actor_cls, p, is_gpu) for p in self.placements]
        infos = self._gather([a.node_info.remote() for a in self._actors], "start-up", 3 * self.timeout_s)
        for p, info in zip(self.placements, infos):
            if info["ray_node_id"] != p.ray_node_id:
                raise RuntimeError(f"rank {p.rank}'s actor runs on Ray node {info['ray_node_id'][:8]}, not on its "
                                   f"bundle's {p.describe()}")
        self.pids = [info["pid"] for info in infos]
        port = self._gather([self._actors[0].open_store.remote()], "start-up", self.timeout_s)[0]
        refs = [a.setup.remote(self._rendezvous(p, infos, port)) for p, a in zip(self.placements, self._actors)]
        self.geometry = self._gather(refs, "start-up", 3 * self.timeout_s)[0]
        self._loops = [a.run.remote() for a in self._actors]

    def _spawn(self, actor_cls, p: RankPlacement, is_gpu: bool):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.launch.ray_actor import ACTOR_THREADS

        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=p.bundle_index)
        return actor_cls.options(
            name=f"specray-{self.job_id}-rank{p.rank}", max_concurrency=ACTOR_THREADS, scheduling_strategy=strategy,
            runtime_env=actor_runtime_env(self.config.parallel.runtime_env),
            **actor_resources(self._pg.bundle_specs[p.bundle_index], is_gpu),
        ).remote(self.config, p.rank)

    def _rendezvous(self, p: RankPlacement, infos: list[dict], port: int) -> Rendezvous:
        on_node = sum(q.node_index == p.node_index for q in self.placements)
        return Rendezvous(rank=p.rank, world_size=self.world_size, local_rank=p.local_rank,
                          local_world_size=on_node, node_key=p.ray_node_id, store_host=infos[0]["node_ip"],
                          store_port=port, job_id=self.job_id, device_index=infos[p.rank]["device_index"])

    def _gather(self, refs: list, what: str, timeout_s: float) -> list:
        """Every ref's value; the first that fails (or the deadline) fails the job."""
        import ray

        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise self._failure(what, f"no answer within {timeout_s:.0f} s")
            try:
                ray.get(ready[0])
            except Exception as e:
                raise self._failure(what, errors={refs.index(ready[0]): last_line(e)}) from None
        return ray.get(refs)

    def _send(self, message) -> None:
        if self._closed or self._closing:
            raise self.client.error or EngineClosed("this LLM is closed")
        self._outgoing.put(message)

    def _deliver(self) -> None:
        """The sender thread: inbox messages to rank 0, in order (each call waits for the last)."""
        import ray

        while not self._closed:
            try:
                message = self._outgoing.get(timeout=self.failure_timeout_s * PING_FRACTION)
            except queue.Empty:
                continue
            rank0 = self._actors[0] if self._actors else None
            if rank0 is None:
                return
            method = rank0.abort if isinstance(message, AbortRequests) else rank0.add
            ref = method.remote(message.request_ids if isinstance(message, AbortRequests) else message)
            try:  # a dead rank 0 is the reader's to report; this only keeps the order
                ray.wait([ref], timeout=self.failure_timeout_s)
            except Exception:
                return

    def _read(self) -> None:
        """The reader thread: long-poll rank 0's outputs and route them, watching every rank."""
        try:
            while not (self._closed or self._closing):
                outputs = self._watch(self._actors[0].deltas.remote(self.failure_timeout_s * PING_FRACTION),
                                      "generate")
                for output in outputs:
                    self.client.dispatch(output)
        except RankFailure as failure:
            self.client.fail(failure)
        except Exception as e:
            if not (self._closed or self._closing):
                self.client.fail(RankFailure(f"the Ray driver's reader failed: {type(e).__name__}: {e}", []))

    def _check_alive(self) -> None:
        if self.client.error is None and not self._threads[1].is_alive():
            self.client.fail(EngineClosed("this LLM is closed"))
        if self.client.error is not None:
            raise self.client.error

    @property
    def is_healthy(self) -> bool:
        return self.client.is_healthy

    def generate(self, prompts, params):
        return self.client.generate(prompts, params)

    def _watch(self, call, what: str):
        """``call``'s value, while watching every rank (see the module doc for the bound)."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            ready, _ = ray.wait([call] + self._loops, num_returns=1, timeout=self.failure_timeout_s * PING_FRACTION)
            if ready and self._closing:  # close() stopped the loops: nothing failed
                return []
            if ready and ready[0] == call:
                try:
                    value = ray.get(call)
                except RayActorError:  # rank 0's actor died
                    raise self._failure(what) from None
                self._ping_round(what)
                return value
            if ready:
                raise self._failure(what)
            self._ping_round(what)

    def _ping_round(self, what: str) -> None:
        """Every F/8: a rank whose last ping is unanswered for F/2 fails the job; ping the rest."""
        import ray
        from ray.exceptions import RayActorError

        now = time.monotonic()
        if now - self._pinged_at < self.failure_timeout_s * PING_FRACTION:
            return
        self._pinged_at = now
        for rank, actor in enumerate(self._actors):
            if rank in self._pings:
                ref, sent_at = self._pings[rank]
                if not ray.wait([ref], timeout=0)[0]:
                    if now - sent_at > self.failure_timeout_s * UNRESPONSIVE_FRACTION:
                        raise self._failure(what, unresponsive={rank: now - sent_at})
                    continue
                try:
                    ray.get(ref)
                except RayActorError:
                    raise self._failure(what) from None
            self._pings[rank] = (actor.ping.remote(), now)

    def _failure(self, what: str, detail: str = "", errors: dict[int, str] | None = None,
                 unresponsive: dict[int, float] | None = None) -> RankFailure:
        """Name the ranks whose actor died or hung (or else the first that failed), with their
        nodes; stop the job."""
        errors = dict(errors or {})
        dead = {rank: (rank, self._pid(rank), f"no answer to pings for {seconds:.0f} s")
                for rank, seconds in (unresponsive or {}).items()}
        if not dead:
            dead = settle_loops(self._loops, self._pid, min(5.0, self.failure_timeout_s * SETTLE_FRACTION), errors)
        where = {p.rank: p.describe() for p in self.placements}
        failure = RankFailure.build(what, sorted(dead.values()), errors, detail, where=where)
        self._teardown(disconnect=threading.current_thread() is threading.main_thread())
        if hasattr(self, "client"):
            self.client.fail(failure)
        return failure

    def _pid(self, rank: int) -> int | str:
        return self.pids[rank] if rank < len(self.pids) else "?"

    def health(self) -> list[dict]:
        """One report per rank (``ray_health.health_reports``), each answer awaited failure_timeout_s."""
        return health_reports(self.placements, self._actors, self._pid, self.failure_timeout_s, self._closed)

    def close(self) -> None:
        import ray

        failed = self._closed  # a failure tore the job down (in the reader): only disconnect here
        if not failed:
            self._closing = True
            if self._loops:
                try:
                    self._actors[0].stop.remote()
                    ray.wait(self._loops, num_returns=len(self._loops), timeout=self.timeout_s)
                except Exception:
                    pass
        self._teardown(disconnect=False)
        # the sender and reader may be inside a Ray call: a call that outlives ray.shutdown (here or
        # the user's own, right after close) makes Ray end the whole process with status 1
        for thread in getattr(self, "_threads", []):
            if thread is not threading.current_thread():
                thread.join(self.failure_timeout_s)
        self._teardown()
        if hasattr(self, "client") and not failed:
            self.client.fail(EngineClosed("this LLM is closed"))

    def _teardown(self, disconnect: bool = True) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        for actor in self._actors:
            ray.kill(actor)
        self._actors, self._loops = [], []
        if self._pg is not None and self._owns_pg:
            remove_placement_group(self._pg)
        self._pg = None
        if self._owns_ray and disconnect:  # ray.shutdown belongs to the driver's own thread
            ray.shutdown()
            self._owns_ray = False

