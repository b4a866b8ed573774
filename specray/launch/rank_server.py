"""The rank server behind the ``mp`` launcher: ``python -m specray.launch.rank_server FD``.

Why not multiprocessing: its ``spawn`` and ``forkserver`` children re-import the user's
``__main__`` before they run anything, so a script without an ``if __name__ == "__main__":``
guard re-ran its top-level code in every rank and then died in multiprocessing's bootstrap.
This server is started with ``-m``: the only ``__main__`` it ever has is this module. It
imports torch and specray once, then forks one rank per request, so a rank starts in a
fraction of a second instead of paying the torch import again (see benchmarks/bench_startup.py).
The server forks before anything touches CUDA, so CUDA is safe in the ranks.

Protocol over the Unix socket FD, one request at a time (``launch/spawner.py`` is the other end):

- request: one byte carrying one fd, the rank's end of its pipe to the driver;
- reply: one byte carrying one fd, the read end of the rank's status pipe, on which the server
  writes the rank's pid (8 bytes) at once and its exit code (8 bytes; minus the signal number
  when a signal killed it) when it ends. EOF before the exit code: the server itself is gone.

The rank reads its job (config, rendezvous, forwarded environment) from its pipe, as torchrun's
workers read theirs from the environment: nothing else of the driver crosses. The server exits
when the driver closes the socket; ranks it started stop on their own once their pipe to the
driver closes (rank 0 ends the job, followers see rank 0 exit).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys

from specray.launch.mp_rank import run_rank_process

STATUS = struct.Struct("q")


def _reap(status_fds: dict[int, int]) -> None:
    """Write the exit code of every rank that ended to its status pipe, and close it."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(wait_status)))
            os.close(fd)


def _fork_rank(conn_fd: int, own_fds: list[int], status_fds: dict[int, int]) -> int:
    """Fork one rank; returns the read end of its status pipe (the child never returns)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)  # before its fd closes: a signal must not write to a reused fd number
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C reaches the ranks as before
        for fd in [read_end, write_end, *own_fds, *status_fds.values()]:  # peers' status pipes EOF with the server
            os.close(fd)
        os._exit(run_rank_process(conn_fd))
    os.close(conn_fd)
    os.write(write_end, STATUS.pack(pid))
    status_fds[pid] = write_end
    return read_end


def serve(sock: socket.socket) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's and the ranks' to handle
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through wake_r
    status_fds: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(status_fds)
        if sock in readable:
            message, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if not message or len(fds) != 1:  # the driver is gone (or spoke nonsense): stop serving
                return
            status_read = _fork_rank(fds[0], [sock.fileno(), wake_r, wake_w], status_fds)
            socket.send_fds(sock, [b"r"], [status_read])
            os.close(status_read)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
