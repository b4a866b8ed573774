"""Rank processes seen from the driver: naming the rank that failed, stopping them all."""

from __future__ import annotations

import signal
import time

from specray.errors import SpecrayError


class RankFailure(SpecrayError, RuntimeError):
    """A rank died, hung or failed; ``ranks`` names those that died, else those that hung
    (alive and silent while a peer timed out), else the first that failed."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    @classmethod
    def from_processes(cls, what: str, procs, conns, detail: str = "", settle_s: float = 1.0,
                       errors: dict[int, str] | None = None) -> RankFailure:
        """``errors``: reports already read off the pipes (rank -> error), with those still there."""
        # A rank that dies makes its peers' collectives fail too; wait a moment for the
        # exits to show, then blame the ranks that exited without reporting an error.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
            time.sleep(0.02)
        errors = {**_error_reports(conns), **(errors or {})}
        dead = [(r, p.pid, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in errors]
        # A rank that hangs without dying makes its peers' collectives time out while it
        # stays silent: when nothing died and a rank timed out, the silent live ranks are it.
        silent = [(r, p.pid) for r, p in enumerate(procs) if p.exitcode is None and r not in errors]
        stuck = silent if not dead and any(is_timeout(e) for e in errors.values()) else []
        return cls.build(what, dead, errors, detail, stuck=stuck)

    @classmethod
    def build(cls, what: str, dead: list[tuple[int, int, int | str | None]], errors: dict[int, str],
              detail: str = "", where: dict[int, str] | None = None,
              stuck: list[tuple[int, int]] = ()) -> RankFailure:
        """``dead``: (rank, pid, exit code); ``errors``: rank -> the error it reported;
        ``where``: rank -> where it ran (its node), named next to the rank when given;
        ``stuck``: (rank, pid) of live ranks that stayed silent while a peer timed out."""
        at = {r: f" on {w}" for r, w in (where or {}).items()}
        parts = [f"rank {r} (pid {pid}){at.get(r, '')} died ({describe_exit(code)})" for r, pid, code in dead]
        parts += [f"rank {r} (pid {pid}){at.get(r, '')} is alive but reported nothing while its peers timed out: "
                  f"it is stuck, stopped or in another collective" for r, pid in stuck]
        if not dead and errors:
            first = min(errors)
            parts.append(f"rank {first}{at.get(first, '')} failed: {errors[first]}")
        if detail:
            parts.append(detail)
        blamed = [r for r, _, _ in dead] or [r for r, _ in stuck] or sorted(errors)[:1]
        summary = "; ".join(parts) or "a rank stopped without saying why"
        return cls(f"{what} failed: {summary}. The job was stopped; build a new LLM to continue.", blamed)


def _error_reports(conns) -> dict[int, str]:
    errors = {}
    for rank, conn in enumerate(conns):
        try:
            while conn.poll():
                reply = conn.recv()
                if reply.is_error:
                    errors.setdefault(rank, reply.describe())
        except (EOFError, OSError):
            pass
    return errors


def is_timeout(error: str) -> bool:
    """Whether a reported error is a collective or channel timeout: ours (TimeoutError),
    gloo's ("Timed out waiting ...") or NCCL's watchdog ("... collective operation timeout")."""
    text = error.lower()
    return "timed out" in text or "timeout" in text


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
