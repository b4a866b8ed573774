"""The driver's side of the rank server (``launch/rank_server.py``): start ranks, watch them.

One server per driver process, started on first use with ``python -m`` (so it never imports
the user's ``__main__``) and kept for later jobs, as multiprocessing keeps its forkserver: it
holds no job state, only torch and specray already imported. A driver that forked, or a
server that died, gets a new one.

``RankProcess`` offers the part of ``multiprocessing.Process`` that ``launch/procs.py`` and
the mp driver use (pid, sentinel, exitcode, join, terminate, kill).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

from specray.comm.spin import is_alive

STATUS = struct.Struct("q")  # as rank_server writes it


class RankProcess:
    """A rank forked by the server. ``sentinel`` (its status pipe) turns readable when it ends."""

    def __init__(self, status_fd: int):
        self.sentinel = status_fd
        self.pid = STATUS.unpack(_read_exactly(status_fd, STATUS.size))[0]
        self._exitcode: int | str | None = None

    @property
    def exitcode(self) -> int | str | None:
        """None while it runs; its exit code (minus the signal that killed it) once it ended."""
        if self._exitcode is None and self.sentinel >= 0 and _readable(self.sentinel, 0.0):
            data = _read_exactly(self.sentinel, STATUS.size)
            if len(data) == STATUS.size:
                self._exitcode = STATUS.unpack(data)[0]
            elif not is_alive(self.pid):
                self._exitcode = "ended; its exit code was lost with the rank server"
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is None and self.sentinel >= 0:
            _readable(self.sentinel, timeout)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.exitcode is None:  # not reaped yet, so the pid is still this rank's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Release the status pipe (after the rank ended, or was given up on)."""
        self.exitcode  # keep the code if it is there
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class RankServer:
    """A running rank server, seen from the driver. ``start_rank`` is safe from any thread."""

    def __init__(self):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The driver's import path, so the ranks import the same specray; -P keeps the cwd off it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "specray.launch.rank_server",
                                          str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.sock = mine
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def is_usable(self) -> bool:
        return self.owner_pid == os.getpid() and self.proc.poll() is None

    def start_rank(self, conn_fd: int, timeout_s: float) -> RankProcess:
        """Fork a rank whose pipe to this driver is ``conn_fd`` (the rank's end)."""
        with self._lock:
            self.sock.settimeout(timeout_s)  # the first request also waits for the server's imports
            try:
                socket.send_fds(self.sock, [b"r"], [conn_fd])
                message, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
            except (OSError, TimeoutError) as e:
                raise RuntimeError(f"the rank server (pid {self.proc.pid}) did not start a rank within "
                                   f"{timeout_s:.0f} s: {e!r}; its exit code: {self.proc.poll()}") from None
        if not message or len(fds) != 1:
            raise RuntimeError(f"the rank server (pid {self.proc.pid}) closed its socket; exit code "
                               f"{self.proc.poll()} (see its error above)")
        return RankProcess(fds[0])

    def close(self) -> None:
        self.sock.close()  # the server exits on EOF
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: RankServer | None = None  # this process's rank server; no job state (see the module doc)
_server_lock = threading.Lock()


def rank_server() -> RankServer:
    """This driver process's rank server, started on first use (or again when unusable)."""
    global _server
    with _server_lock:
        if _server is None or not _server.is_usable:
            _server = RankServer()
        return _server


def _readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data
