"""A `specray serve` subprocess on 127.0.0.1 and a port free at run time, for the server tests:
started, waited for (``/health`` 200), its metrics read, and stopped with its whole process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 240.0  # a loaded 2-core machine starting ranks (and, for smollm2, reading the GGUF)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    step_dir: Path | None = None  # SPECRAY_TEST_STEP_DIR of the server, when a test set one

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120, **kwargs)

    def health(self) -> int:
        return http_get(self.url + "/health")[0]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = http_get(self.url + "/metrics")
        assert status == 200, text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                samples[(s.name, labels)] = s.value
        return samples

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]


def start_server(log: Path, *flags: str, env: dict | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "specray", "serve", "--port", str(port), *flags]
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **(env or {}))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"specray serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if server.health() == 200:
                return server
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            stop_server(server)
            raise AssertionError(f"specray serve was not healthy within {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
        time.sleep(0.2)


def stop_server(server: Server, timeout_s: float = 30.0) -> int:
    """SIGINT (uvicorn's graceful stop), then SIGKILL to the group if it does not end in time."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)  # whatever the server left behind in its session
    except ProcessLookupError:
        pass
    server.proc.wait(10)
    return server.proc.returncode


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc), oldest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(), [])):
            found.append(child)
            todo.append(child)
    return sorted(found)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)


def rank_pids(server_pid: int) -> list[int]:
    """The mp ranks below a server: the children of its rank server (forks of it, so their
    command line names it too), oldest (rank 0) first."""
    servers = [p for p in descendants(server_pid) if "specray.launch.rank_server" in cmdline(p)]
    return sorted(p for p in servers if _ppid(p) in servers)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
