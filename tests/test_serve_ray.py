"""``ray job submit -- python -m specray.launch.ray_job serve ...`` against a Ray head this test
starts on loopback: the server comes up on the job's driver with its ranks as Ray actors, answers
the openai client with the single-rank engine's greedy text, and ``ray job stop`` ends it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from serve_server import START_TIMEOUT_S, Server, free_port
from test_ray_job import RAY, dashboard_missing, ray_env, start_head, stop_head  # noqa: F401 (fixture)

from specray import LLM, EngineConfig, KVConfig, SamplingParams

KV = ["--tokens-per-block", "16", "--kv-capacity-tokens", "1024"]


def wait_healthy(server: Server, is_running, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if server.health() == 200:
                return
        except OSError:
            pass
        assert is_running(), "the job ended before its server was healthy"
        assert time.monotonic() < deadline, f"the served job was not healthy within {deadline_s:.0f} s"
        time.sleep(0.5)


def assert_server_gone(server: Server, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            server.health()
        except OSError:
            return  # nothing listens on the port any more
        assert time.monotonic() < deadline, f"the server still answers {within_s:.0f} s after `ray job stop`"
        time.sleep(0.5)


def job_status(address: str, env: dict, job_id: str) -> str:
    out = subprocess.run([RAY, "job", "status", "--address", address, job_id], env=env, capture_output=True,
                         text=True, timeout=60)
    return out.stdout + out.stderr


def job_ended(address: str, env: dict, job_id: str) -> bool:
    """Whether ``ray job status`` names a terminal state. A read that names none (the CLI failing to
    reach the dashboard under load) says nothing: it once failed this test while the job was
    RUNNING (CI, 12-07); the start deadline bounds the wait either way."""
    status = job_status(address, env, job_id)
    return any(f"': {state}" in status for state in ("SUCCEEDED", "FAILED", "STOPPED"))


def test_ray_job_submit_serves_from_the_cluster(ray_env, tmp_path):
    if dashboard_missing() is not None:
        pytest.skip(f"`ray job submit` needs the dashboard's jobs API, i.e. ray[default] (pip install -e '.[test]'): "
                    f"{dashboard_missing()}")
    with LLM(EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        expected = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    port, job_id = free_port(), f"specray-serve-{free_port()}"
    job = [sys.executable, "-m", "specray.launch.ray_job", "serve", "--model", "tiny-llama", "--tp", "2", *KV,
           "--port", str(port), "--timeout-s", "60"]
    head, address = start_head(ray_env, tmp_path / "head.log")
    try:
        submit = subprocess.run([RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--no-wait",
                                 "--", *job], env=ray_env, capture_output=True, text=True, timeout=120)
        assert submit.returncode == 0, (submit.stdout + submit.stderr)[-3000:]
        server = Server(None, f"http://127.0.0.1:{port}", tmp_path / "unused.log")
        try:
            wait_healthy(server, lambda: not job_ended(address, ray_env, job_id), START_TIMEOUT_S)
        except AssertionError as e:  # say why: the job's status and its own log
            logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=ray_env,
                                  capture_output=True, text=True, timeout=60)
            raise AssertionError(f"{e}\n{job_status(address, ray_env, job_id)}\n{logs.stdout[-3000:]}") from None
        got = server.client().completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected and got.usage.completion_tokens == 8
        stop = subprocess.run([RAY, "job", "stop", "--address", address, job_id], env=ray_env,
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, (stop.stdout + stop.stderr)[-3000:]
        assert "was stopped" in job_status(address, ray_env, job_id)
        assert_server_gone(server, 60.0)
        logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=ray_env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "specray ray_job: connected to the Ray cluster" in logs and "ready on http://127.0.0.1" in logs, logs
    finally:
        stop_head(head)
