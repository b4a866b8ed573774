"""Rendezvous: what a launcher tells a rank before its process groups exist.

A launcher gives every rank a ``Rendezvous`` (its rank, the world size, where the key-value
store is, which host it runs on and the job id), and ``DistContext.create`` turns it into
process groups. Rules:

- The store's port is bound by the process that hosts it, on port 0, so the kernel picks a
  free one and two jobs on one host can never race for it (the mp driver and the Ray rank-0
  actor host their own store; torchrun hosts its own and passes it as MASTER_ADDR/PORT).
- ``job_id`` is random per job; shared-memory names derive from it, so jobs never collide.
- ``node_key`` is equal for ranks that share a host and may use shared memory together.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from specray.envs import torchrun_env_present  # noqa: F401  (defined once, there; kept importable here)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_key: str
    """Equal for ranks on one host: they may share memory."""
    store_host: str | None = None
    store_port: int | None = None
    """The TCPStore to join; None for both means ``env://`` (torchrun's MASTER_ADDR/PORT)."""
    device_index: int | None = None
    """CUDA device ordinal; None means local_rank."""
    job_id: str = ""
    """Random per job; empty means rank 0 draws one and shares it."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank ({self.rank}) must be in [0, world_size = {self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank ({self.local_rank}) must be in [0, local_world_size = "
                             f"{self.local_world_size})")


def new_job_id() -> str:
    return secrets.token_hex(6)


def host_key() -> str:
    return socket.gethostname()


def host_store(timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """A TCPStore server on a port the kernel picks (port 0): free by construction."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def from_torchrun_env(environ=os.environ) -> Rendezvous:
    """Read torchrun's variables (also set by Slurm/mpirun wrappers that mimic torchrun).

    ``GROUP_RANK`` (torchrun's node rank) joins the node key, so the ranks torchrun places on
    different nodes never try shared memory together, even when those "nodes" share a host."""
    missing = [v for v in TORCHRUN_VARS[:2] + TORCHRUN_VARS[4:] if v not in environ]
    if missing:
        raise ValueError(f"launcher 'external' needs the torchrun variables {TORCHRUN_VARS}; missing {missing}")
    world_size = int(environ["WORLD_SIZE"])
    rank = int(environ["RANK"])
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(environ.get("LOCAL_RANK", rank % local_world))
    node = environ.get("GROUP_RANK", "0")
    return Rendezvous(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world,
                      node_key=f"{host_key()}/node{node}")
