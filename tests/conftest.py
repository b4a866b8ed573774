"""Shared fixtures: one Ray instance for the whole session, tiny checkpoints, and a guard
that no rank process or shared-memory segment outlives the test that made it."""

from __future__ import annotations

import os

# Ray's settings for this project's tests: no usage stats, no auth, no dashboard.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

from checkpoints import make_checkpoint  # noqa: E402  (tests/ is on sys.path: no __init__.py)
from session_ray import start_session_ray  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: torch's intra-op threads only contend
    (measured: 4 requests x 64 tokens take 0.2 s on one thread, 6 s on the default).
    Rank processes set their own share of the cores (launch/rank.py)."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance of this session's own, shared by every test that needs one."""
    import ray  # a dependency of specray (its ray launcher), not an optional extra: never skipped
    if ray.is_initialized():
        yield ray
        return
    start_session_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> a tiny Hugging Face checkpoint directory (built once per session, offline)."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = make_checkpoint(family, root / family)
        return cache[family]

    return get


@pytest.fixture(autouse=True, scope="session")
def _specray_cache(tmp_path_factory):
    """Presets are written under a per-session cache unless SPECRAY_CACHE is set."""
    if "SPECRAY_CACHE" not in os.environ:
        os.environ["SPECRAY_CACHE"] = str(tmp_path_factory.mktemp("specray-cache"))


def pytest_terminal_summary(terminalreporter):
    """Say in the summary when the CPU-kernel tests could not run (no C compiler): a skip is
    otherwise easy to miss. A failed build with a compiler fails those tests instead."""
    from kernel_build import no_compiler_reason
    from specray.models import cpu_kernels

    if cpu_kernels.find_compiler() is None:
        terminalreporter.write_line(f"specray CPU kernels: {no_compiler_reason()}", yellow=True)


@pytest.fixture
def step_dir(tmp_path, monkeypatch):
    """A directory where every rank started in this test writes its step count (see faults.py)."""
    from faults import STEP_DIR_VAR

    directory = tmp_path / "steps"
    directory.mkdir()
    monkeypatch.setenv(STEP_DIR_VAR, str(directory))
    return directory
