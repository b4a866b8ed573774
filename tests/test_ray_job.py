"""``ray job submit -- python -m specray.launch.ray_job generate ...`` against a Ray head this
test starts on loopback (with the dashboard: the jobs API lives there), on ports free at run
time, stopped at the end.

Reference: the same prompt on one rank, token for token (see test_ranks_mp.py for why exact).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from test_ranks_mp import PROMPTS, single_rank_tokens

RAY = str(Path(sys.executable).with_name("ray"))
RAY_ENV = dict(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
HEAD_PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port",
                   "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")


def dashboard_missing() -> ImportError | None:
    from ray._private.utils import get_dashboard_dependency_error  # what `ray start` itself checks

    return get_dashboard_dependency_error()


def free_ports(n: int) -> list[int]:
    """n distinct ports free now (held open together so the kernel gives n different ones)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def ray_env():
    """The environment of every Ray process here: a private RAY_TMPDIR (short: Ray's socket
    paths live under it), so no other process's ``ray.init()`` finds this test's cluster."""
    ray_tmp = tempfile.mkdtemp(prefix="sr", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV, RAY_TMPDIR=ray_tmp, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    yield env
    subprocess.run(["rm", "-rf", ray_tmp], check=False)


def start_head(env: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` on 127.0.0.1; returns the process and the jobs API address."""
    ports = dict(zip(HEAD_PORT_FLAGS, free_ports(len(HEAD_PORT_FLAGS))))
    cmd = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--object-store-memory={100 << 20}",
           "--disable-usage-stats", *(f"{flag}={port}" for flag, port in ports.items())]
    with open(log_path, "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports['--dashboard-port']}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and head.poll() is None:
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2):
                return head, address
        except OSError:
            time.sleep(0.5)
    stop_head(head)
    pytest.fail(f"the Ray head did not serve the jobs API within 120 s:\n{log_path.read_text()[-3000:]}")


def stop_head(head: subprocess.Popen) -> None:
    """SIGTERM makes ``ray start --block`` stop the processes it started; whatever is left of
    its own process group (this test's alone) is killed."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(5)


def generate_args(model) -> list[str]:
    return ["generate", "--model", str(model), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", "6",
            "--ignore-eos", "--kv-capacity-tokens", "1024", "--timeout-s", "30"]


def output_ids(stdout: str) -> list[int]:
    lines = [line for line in stdout.splitlines() if line.startswith("output ids: ")]
    assert len(lines) == 1, stdout[-3000:]
    return [int(t) for t in lines[0].removeprefix("output ids: ").split(",")]


def test_ray_job_refuses_another_launcher_before_touching_ray(capsys):
    from specray.launch.ray_job import main

    assert main(["generate", "--prompt-ids", "1,2", "--launcher", "mp"]) == 2
    assert "error: ray_job runs the ranks as Ray actors; drop --launcher mp" in capsys.readouterr().err


def test_ray_job_submit_runs_generate_on_the_cluster(ray_env, tiny_checkpoints, tmp_path):
    if dashboard_missing() is not None:
        pytest.skip(f"`ray job submit` needs the dashboard's jobs API, i.e. ray[default] (pip install -e '.[test]'): "
                    f"{dashboard_missing()}")
    model = tiny_checkpoints("llama")
    expected = single_rank_tokens(model)[0]
    job = [sys.executable, "-m", "specray.launch.ray_job", *generate_args(model), "--tp", "2"]
    head, address = start_head(ray_env, tmp_path / "head.log")
    try:
        submit = subprocess.run([RAY, "job", "submit", "--address", address, "--", *job],
                                env=ray_env, capture_output=True, text=True, timeout=300)
    finally:
        stop_head(head)
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-4000:]
    # The job's driver joined the test's cluster (ray job submit sets RAY_ADDRESS for it).
    assert "specray ray_job: connected to the Ray cluster (1 nodes, 2 CPUs, 0 GPUs)" in submit.stdout
    assert output_ids(submit.stdout) == expected
    assert "succeeded" in submit.stdout
