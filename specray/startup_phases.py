"""How long each phase of a rank's start-up took: process start, process groups, node
discovery, all-reduce segments, model load, the geometry agreement, the plan channel.

A ``PhaseClock`` is passed down start-up explicitly (``DistContext.create``, ``start_rank``);
it only reads the clock. When ``SPECRAY_STARTUP_PROFILE_DIR`` is set (benchmarks), each rank
writes its phases to ``<dir>/rank<R>.json`` once it is ready, with wall-clock marks so that a
reader can line ranks and the driver up (they share a host, or an NTP-synced cluster).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

PROFILE_DIR_VAR = "SPECRAY_STARTUP_PROFILE_DIR"


class PhaseClock:
    """Seconds per named phase, in the order they ran (a phase entered twice adds up)."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def write(self, rank: int, environ=os.environ) -> Path | None:
        """Write ``<dir>/rank<R>.json`` when the profile variable is set; the path, or None."""
        directory = environ.get(PROFILE_DIR_VAR)
        if not directory:
            return None
        path = Path(directory) / f"rank{rank}.json"
        path.write_text(json.dumps(dict(rank=rank, started_at=self.started_at, ready_at=time.time(),
                                        phases=self.phases)))
        return path


@contextmanager
def timed(clock: PhaseClock | None, name: str):
    """``clock.phase(name)``, or nothing for callers that do not profile (clock None)."""
    if clock is None:
        yield
    else:
        with clock.phase(name):
            yield
