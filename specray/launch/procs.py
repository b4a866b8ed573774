"""Rank processes seen from the driver: naming the rank that failed, stopping them all."""

from __future__ import annotations

import signal
import time


class RankFailure(RuntimeError):
    """A rank died or failed; ``ranks`` names those that died (or else the one that failed)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    @classmethod
    def from_processes(cls, what: str, procs, conns, detail: str = "", settle_s: float = 1.0) -> RankFailure:
        # A rank that dies makes its peers' collectives fail too; wait a moment for the
        # exits to show, then blame the ranks that exited without reporting an error.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
            time.sleep(0.02)
        errors = _error_reports(conns)
        dead = [(r, p.pid, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in errors]
        return cls.build(what, dead, errors, detail)

    @classmethod
    def build(cls, what: str, dead: list[tuple[int, int, int | str | None]], errors: dict[int, str],
              detail: str = "") -> RankFailure:
        """``dead``: (rank, pid, exit code); ``errors``: rank -> the error it reported."""
        parts = [f"rank {r} (pid {pid}) died ({describe_exit(code)})" for r, pid, code in dead]
        if not dead and errors:
            first = min(errors)
            parts.append(f"rank {first} failed: {errors[first]}")
        if detail:
            parts.append(detail)
        blamed = [r for r, _, _ in dead] or sorted(errors)[:1]
        summary = "; ".join(parts) or "a rank stopped without saying why"
        return cls(f"{what} failed: {summary}. The job was stopped; build a new LLM to continue.", blamed)


def _error_reports(conns) -> dict[int, str]:
    errors = {}
    for rank, conn in enumerate(conns):
        try:
            while conn.poll():
                message = conn.recv()
                if message[0] == "error":
                    errors.setdefault(rank, f"{message[1]}: {message[2]}")
        except (EOFError, OSError):
            pass
    return errors


def describe_exit(code: int | str | None) -> str:
    if isinstance(code, str):
        return code
    if code is None:
        return "unresponsive"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stop_processes(procs, grace_s: float) -> None:
    """Join every process within ``grace_s``, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
