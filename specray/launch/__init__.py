"""Launchers: who starts the ranks (local, mp, ray, external).

``start_engine`` returns an engine handle with ``generate``, ``geometry``, ``close`` and (all
but ``external``'s followers) ``client``, the driver's side of rank 0's engine loop
(``executor/client.py``) that ``LLM`` and ``AsyncLLM`` use.
The mapping (does the model split over these ranks?) and the drafter's fit to the target
are validated here, on the driver, before any process or process group starts.
"""

from __future__ import annotations

from specray.config import EngineConfig
from specray.envs import torchrun_env_present
from specray.launch.mapping import validate_mapping
from specray.models.drafters import check_drafter
from specray.models.loader import read_model_arch
from specray.models.presets import resolve_model


def resolve_launcher(config: EngineConfig) -> str:
    """auto: ray when given a placement group, external under torchrun, local for one rank,
    mp otherwise."""
    launcher = config.parallel.launcher
    if launcher != "auto":
        return launcher
    if config.parallel.placement_group is not None:
        return "ray"
    if torchrun_env_present():
        return "external"
    return "local" if config.parallel.world_size == 1 else "mp"


def start_engine(config: EngineConfig):
    """Start the ranks and return an engine handle with generate / geometry / close."""
    launcher = resolve_launcher(config)
    arch = read_model_arch(resolve_model(config.model, config.seed))
    check_drafter(config, arch)  # a drafter that cannot fit fails here, before any rank loads the target
    if launcher == "external":
        from specray.launch.external import start_external

        return start_external(config, arch)
    validate_mapping(arch, config.parallel)
    if launcher == "local":
        from specray.launch.local import LocalEngine

        return LocalEngine(config)
    if launcher == "mp":
        from specray.launch.mp import MPEngine

        return MPEngine(config)
    if launcher == "ray":
        from specray.launch.ray import RayEngine

        return RayEngine(config)
    raise ValueError(f"launcher {launcher!r} is not available")
