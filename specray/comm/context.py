"""DistContext: everything a rank knows about where it runs, passed explicitly.

Built once per rank from the launcher's rendezvous information; layers receive the group
they need from it (``ctx.tp``, ``ctx.moe_tp``, ``ctx.moe_ep``), never from a global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specray.comm.group import SINGLE, Group


@dataclass(slots=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_id: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    timeout_s: float = 60.0
    tp: Group = SINGLE
    moe_tp: Group = SINGLE
    moe_ep: Group = SINGLE
    cpu: Group = SINGLE
    """Control messages (step plans across nodes, geometry agreement): always gloo."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: str = "cpu") -> DistContext:
        dev = torch.device(device)
        return cls(device=dev, backend="nccl" if dev.type == "cuda" else "gloo")

    def close(self) -> None:
        for group in {id(g): g for g in (self.tp, self.moe_tp, self.moe_ep, self.cpu)}.values():
            group.close()
