"""Drafters for speculative decoding (built per rank, sharded like the target)."""

from __future__ import annotations

from specray.comm.context import DistContext
from specray.config import EngineConfig


def build_drafter(config: EngineConfig, ctx: DistContext, target):
    """The drafter for ``config.spec.method`` on this rank, or None for plain decoding."""
    if config.spec.method is None:
        return None
    raise ValueError(f"spec method {config.spec.method!r} is not available in this build yet")
