"""Where the ranks of a Ray job run: one placement-group bundle per rank, ranks ordered by node.

Rules:

- One bundle per rank: ``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` otherwise, in a placement group
  of ``ParallelConfig.placement_strategy`` (PACK by default). A group the user passes in
  (``ParallelConfig.placement_group``) is used as it is: one bundle per rank, never removed here.
- Rank 0 sits on the driver's node: bundle 0 is pinned there by a label selector whenever that
  node has the bundle's resources at all (a head node without GPUs cannot host a GPU rank).
- Ranks are numbered by node, then by bundle index on the node: the driver's node first, the
  others by IP, then node id. The order depends only on where Ray put the bundles, never on
  which actor happens to start first, so node 0 is rank 0's node and each node's ranks are
  contiguous (``local_rank`` = position on the node).
- A group that cannot be placed within ``placement_timeout_s`` is removed and raises
  ``PlacementTimeout`` with the cluster's resources, instead of waiting forever.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from specray.config import ParallelConfig
from specray.errors import SpecrayError


class PlacementTimeout(SpecrayError, RuntimeError):
    """The placement group was not ready within ``ParallelConfig.placement_timeout_s``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlacement:
    rank: int
    bundle_index: int
    node_index: int
    """0 for the driver's node (rank 0's), then 1, 2, ... in rank order."""
    local_rank: int
    ray_node_id: str
    node_ip: str

    def describe(self) -> str:
        return f"node {self.node_index} (Ray node {self.ray_node_id[:8]} at {self.node_ip})"


def rank_bundle(is_gpu: bool) -> dict[str, float]:
    return {"GPU": 1.0} if is_gpu else {"CPU": 1.0}


def _ip_key(ip: str) -> tuple:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def order_ranks(bundle_nodes: dict[int, str], driver_node: str, node_ips: dict[str, str]) -> list[RankPlacement]:
    """Rank r's placement, from bundle index -> Ray node id (see the module rules)."""
    nodes = sorted(set(bundle_nodes.values()),
                   key=lambda n: (n != driver_node, _ip_key(node_ips.get(n, "")), n))
    placements: list[RankPlacement] = []
    for node_index, node in enumerate(nodes):
        for local_rank, bundle in enumerate(sorted(b for b, n in bundle_nodes.items() if n == node)):
            placements.append(RankPlacement(rank=len(placements), bundle_index=bundle, node_index=node_index,
                                            local_rank=local_rank, ray_node_id=node, node_ip=node_ips.get(node, "?")))
    return placements


def cuda_ordinal(assigned_gpu_ids: list[str], visible_devices: str | None) -> int:
    """The CUDA ordinal of the GPU Ray assigned to this actor. Ray narrows CUDA_VISIBLE_DEVICES
    to the actor's GPUs (unless told not to), so the ordinal is the assigned id's position in
    that list, and the id itself when every GPU of the node is visible."""
    if not assigned_gpu_ids:
        raise RuntimeError("this rank's Ray actor was assigned no GPU; CUDA ranks need a bundle with GPU >= 1")
    gpu = str(assigned_gpu_ids[0])
    if visible_devices is None or not visible_devices.strip():
        return int(gpu)
    visible = [v.strip() for v in visible_devices.split(",")]
    if gpu not in visible:
        raise RuntimeError(f"GPU {gpu} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
    return visible.index(gpu)


def check_user_group(pg, world_size: int, is_gpu: bool) -> None:
    """A user's placement group must hold one bundle per rank, each with what a rank needs."""
    bundles = pg.bundle_specs
    if len(bundles) != world_size:
        raise ValueError(f"placement_group has {len(bundles)} bundles, but there are {world_size} ranks "
                         f"(tp_size): give one bundle per rank")
    need = rank_bundle(is_gpu)
    for i, bundle in enumerate(bundles):
        if any(bundle.get(k, 0) < v for k, v in need.items()):
            raise ValueError(f"placement_group bundle {i} is {bundle}; each rank needs at least {need}")


def actor_resources(bundle: dict[str, float], is_gpu: bool) -> dict[str, float]:
    """What one rank actor asks of its bundle: its GPU, and one CPU when the bundle has one."""
    return dict(num_cpus=min(1.0, bundle.get("CPU", 0.0)), num_gpus=1 if is_gpu else 0)


def place_ranks(parallel: ParallelConfig, is_gpu: bool, name: str) -> tuple[object, bool, list[RankPlacement]]:
    """(placement group, whether specray created it, each rank's placement)."""
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, placement_group_table

    world_size = parallel.world_size
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    pg, is_owned = parallel.placement_group, parallel.placement_group is None
    if is_owned:
        bundle = rank_bundle(is_gpu)
        driver = nodes.get(driver_node, {}).get("Resources", {})
        pin = all(driver.get(k, 0) >= v for k, v in bundle.items())
        selectors = [{NODE_ID_LABEL_KEY: driver_node}] + [{}] * (world_size - 1) if pin else None
        pg = placement_group([bundle] * world_size, strategy=parallel.placement_strategy, name=name,
                             bundle_label_selector=selectors)
    else:
        check_user_group(pg, world_size, is_gpu)
    ready, _ = ray.wait([pg.ready()], timeout=parallel.placement_timeout_s)
    if not ready:
        message = _unplaced_message(parallel, pg, is_owned, nodes)
        if is_owned:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        raise PlacementTimeout(message)
    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    ips = {node: info["NodeManagerAddress"] for node, info in nodes.items()}
    return pg, is_owned, order_ranks({int(b): n for b, n in bundle_nodes.items()}, driver_node, ips)


def _unplaced_message(parallel: ParallelConfig, pg, is_owned: bool, nodes: dict) -> str:
    import ray

    what = (f"{parallel.world_size} ranks ({pg.bundle_specs[0]} each, {parallel.placement_strategy}, rank 0 on "
            f"the driver's node when it can host one)" if is_owned else f"the given placement group {pg.bundle_specs}")
    hint = ""
    if parallel.placement_strategy == "STRICT_SPREAD" and is_owned and len(nodes) < parallel.world_size:
        hint = f" STRICT_SPREAD puts each rank on its own node, but the cluster has {len(nodes)} nodes."
    total, free = (_devices(r) for r in (ray.cluster_resources(), ray.available_resources()))
    return (f"Ray could not place {what} within {parallel.placement_timeout_s:g} s "
            f"(ParallelConfig.placement_timeout_s).{hint} Cluster: {len(nodes)} nodes, "
            f"{total} in total, {free} available.")


def _devices(resources: dict[str, float]) -> dict[str, float]:
    return {k: resources[k] for k in ("CPU", "GPU") if k in resources}
