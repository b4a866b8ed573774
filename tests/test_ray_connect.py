"""Ray start-up beside what other Ray programs leave behind (specray/launch/ray_connect.py).

A crashed ``ray.cluster_utils.Cluster`` or ``ray start`` leaves Ray's address file naming a head
that is gone; Ray's plain ``ray.init()`` then waits minutes on it. Every test here points
RAY_TMPDIR at a private directory, writes the stale file there with Ray's own writer in a
subprocess, and never touches the machine's real /tmp/ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from serve_server import free_port

from specray.launch import ray_connect

DECISION_BOUND_S = 10.0  # the bound: join, start or fail is decided within it (a probe of <= 2 s)
# A whole local Ray start takes ~4 s here, 12 s on a loaded 2-core machine (measured); Ray's wait
# on a dead address is minutes (still waiting at 300 s), so this bound still tells the two apart.
START_BOUND_S = 60.0
SUBPROCESS_LIMIT_S = 180.0  # a whole `specray generate` on Ray, loaded machine included
TESTS_DIR = Path(__file__).parent


def dead_address() -> str:
    """host:port of a port that was just free and is now closed: a connection is refused."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def stale_ray_tmpdir(monkeypatch):
    """A private Ray temp dir whose address file names a dead head, written by Ray in a subprocess."""
    directory = tempfile.mkdtemp(prefix="srray")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": directory}
    env.pop("RAY_ADDRESS", None)
    address = dead_address()
    write = ("import os, ray._common.utils as c, ray._private.utils as u\n"
             "os.makedirs(c.get_default_ray_temp_dir(), exist_ok=True)\n"
             f"u.write_ray_address({address!r})")
    subprocess.run([sys.executable, "-c", write], env=env, check=True, timeout=60)
    path = Path(directory) / "ray" / "ray_current_cluster"
    assert path.read_text().strip() == address  # Ray wrote it where Ray itself will read it
    monkeypatch.setenv("RAY_TMPDIR", directory)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield env, path, address
    subprocess.run(["rm", "-rf", directory], check=False)


def run_timed(code: str, env: dict) -> tuple[float, str]:
    """Run ``code`` in a fresh interpreter (tests/ on its path); it prints the seconds its start took last."""
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": os.pathsep.join(
        [str(TESTS_DIR), str(TESTS_DIR.parent), env.get("PYTHONPATH", "")])}, capture_output=True, text=True,
        timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return float(proc.stdout.strip().splitlines()[-1]), proc.stderr


START_AND_RUN = """
import time, ray
t = time.monotonic()
{start}
elapsed = time.monotonic() - t
assert ray.get(ray.remote(lambda: 41).remote()) == 41
ray.shutdown()
print(elapsed)
"""


def test_choose_address_starts_local_beside_a_dead_head(stale_ray_tmpdir):
    _, path, address = stale_ray_tmpdir
    t = time.monotonic()
    kind, warning = ray_connect.choose_address()
    assert time.monotonic() - t < DECISION_BOUND_S
    assert kind == "local"
    assert str(path) in warning and address in warning and "ray stop" in warning


def test_choose_address_joins_a_head_that_answers(stale_ray_tmpdir):
    _, path, _ = stale_ray_tmpdir
    with socket.socket() as listener:  # stands in for a live GCS: all the probe asks is a connection
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"127.0.0.1:{listener.getsockname()[1]}"
        path.write_text(live)
        assert ray_connect.choose_address() == ("join", live)


def test_an_explicit_address_wins_and_never_falls_back(stale_ray_tmpdir, monkeypatch):
    _, _, address = stale_ray_tmpdir
    assert ray_connect.choose_address(address) == ("join", address)  # the user's word, dead or not
    assert ray_connect.choose_address("local") == ("local", None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # never probed: an explicit address is the user's word
    assert ray_connect.choose_address() == ("join", "127.0.0.1:6379")


def test_no_address_file_starts_local(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_connect.choose_address() == ("local", None)


def test_head_answers_rejects_malformed_addresses():
    assert not ray_connect.head_answers("no-port")
    assert not ray_connect.head_answers("127.0.0.1:http")
    assert not ray_connect.head_answers(dead_address())


def test_session_fixture_start_ignores_a_stale_address_file(stale_ray_tmpdir):
    env, _, _ = stale_ray_tmpdir
    elapsed, _ = run_timed(START_AND_RUN.format(start="import session_ray; session_ray.start_session_ray()"), env)
    assert elapsed < START_BOUND_S


def test_demo_start_ignores_a_stale_address_file(stale_ray_tmpdir):
    env, _, _ = stale_ray_tmpdir
    elapsed, _ = run_timed(START_AND_RUN.format(start="from specray import demo; demo.start_ray()"), env)
    assert elapsed < START_BOUND_S


def test_connect_ray_starts_local_and_says_why(stale_ray_tmpdir):
    env, path, _ = stale_ray_tmpdir
    start = ("from specray.launch.ray_connect import connect_ray\n"
             "assert connect_ray(num_cpus=2, object_store_memory=100 << 20) is True")
    elapsed, stderr = run_timed(START_AND_RUN.format(start=start), env)
    assert elapsed < START_BOUND_S
    assert str(path) in stderr and "ray stop" in stderr


def test_ray_launcher_generates_beside_a_stale_address_file(stale_ray_tmpdir):
    """`specray generate --launcher ray` with no address: the issue's command, which used to hang."""
    env, path, _ = stale_ray_tmpdir
    cmd = [sys.executable, "-m", "specray", "generate", "--model", "tiny-llama", "--prompt-ids", "1,2,3",
           "--max-tokens", "4", "--tp", "2", "--launcher", "ray"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(path) in proc.stderr and "starting a local Ray instance" in proc.stderr
    assert proc.stdout.strip()  # the generated tokens
