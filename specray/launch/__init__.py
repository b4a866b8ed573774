"""Launchers: who starts the ranks (local, mp, ray, external)."""

from __future__ import annotations

from specray.comm.context import DistContext
from specray.config import EngineConfig


def resolve_launcher(config: EngineConfig) -> str:
    import os

    launcher = config.parallel.launcher
    if launcher != "auto":
        return launcher
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "external"
    return "local" if config.parallel.world_size == 1 else "mp"


def start_engine(config: EngineConfig):
    """Start the ranks and return an engine handle with generate / geometry / close."""
    launcher = resolve_launcher(config)
    if launcher == "local":
        from specray.executor.engine import EngineCore
        from specray.workers.worker import RankWorker

        if config.parallel.world_size != 1:
            raise ValueError(f"launcher 'local' runs one rank, but tp_size is {config.parallel.tp_size}")
        worker = RankWorker(config, DistContext.single(config.device))
        worker.init_pools()
        return EngineCore(config, worker)
    raise ValueError(f"launcher {launcher!r} is not available yet")
