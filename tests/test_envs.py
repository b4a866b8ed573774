"""The variables a rank process takes from its driver (specray.envs), with literal environments."""

from __future__ import annotations

from specray.envs import adopt_forwarded_env, forwarded_env


def test_forwarded_env_keeps_the_allowlist_only():
    environ = {"SPECRAY_X": "1", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1", "HOME": "/h", "PATH": "/bin"}
    assert forwarded_env(environ) == {"SPECRAY_X": "1", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1"}


def test_a_rank_drops_forwarded_variables_the_driver_unset():
    # The rank server started while SPECRAY_KV_MEMORY_FRACTION was set; the driver unset it since.
    rank_environ = {"SPECRAY_KV_MEMORY_FRACTION": "0.001", "GLOO_SOCKET_IFNAME": "lo", "HOME": "/h"}
    adopt_forwarded_env({"SPECRAY_CACHE": "/c", "GLOO_SOCKET_IFNAME": "eth0"}, rank_environ)
    assert rank_environ == {"SPECRAY_CACHE": "/c", "GLOO_SOCKET_IFNAME": "eth0", "HOME": "/h"}
