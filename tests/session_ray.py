"""The test session's own Ray instance (tests/conftest.py's ``ray_cluster`` fixture), as a function
that a subprocess can call too (tests/test_ray_connect.py starts it beside a stale address file)."""

from __future__ import annotations

RAY_LOGICAL_CPUS = 8  # logical: lets a TP=4 placement group fit on a 2-core machine


def start_session_ray():
    """Start a local Ray instance of this process's own (200 MB store). ``address="local"`` never
    reads Ray's address file, so a cluster another program left behind (or its stale file) cannot
    capture or break the suite."""
    import ray

    ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False, object_store_memory=200 * 2**20,
             _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False)
    return ray
