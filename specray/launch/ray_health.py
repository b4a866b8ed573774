"""What the Ray driver asks of its rank actors when something may be wrong: which loops ended
and how (a failure's settle wait), and each rank's health report. Each wait is bounded by the
time it is given; the watch that calls them, and decides what a failure is, lives in ``ray.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specray.launch.ray_placement import RankPlacement


def last_line(error: BaseException) -> str:
    """A remote error's last line: Ray's message carries the whole remote traceback."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}"


def settle_loops(loops: list, pid: Callable[[int], int | str], settle_s: float,
                 errors: dict[int, str]) -> dict[int, tuple]:
    """Wait up to ``settle_s`` for the ranks' loops to show who died: {rank: (rank, pid, why)}
    for every actor that died; a loop that raised adds its last line to ``errors``."""
    import ray
    from ray.exceptions import RayActorError

    dead: dict[int, tuple] = {}
    deadline = time.monotonic() + settle_s
    while loops and not dead and time.monotonic() < deadline:
        ready, _ = ray.wait(loops, num_returns=len(loops), timeout=0.1)
        for ref in ready:
            rank = loops.index(ref)
            try:
                ray.get(ref)
            except RayActorError:
                dead[rank] = (rank, pid(rank), "its Ray actor died")
            except Exception as e:
                errors.setdefault(rank, last_line(e))
    return dead


def health_reports(placements: Sequence[RankPlacement], actors: list, pid: Callable[[int], int | str],
                   timeout_s: float, is_closed: bool) -> list[dict]:
    """One report per rank: where it runs, whether it answered within ``timeout_s``, and what it
    says of itself (state, device, plan transport, all-reduce paths)."""
    import ray
    from ray.exceptions import RayActorError

    reports = [dict(rank=p.rank, node_id=p.node_index, local_rank=p.local_rank, ray_node_id=p.ray_node_id,
                    node_ip=p.node_ip, pid=pid(p.rank), is_alive=False) for p in placements]
    if is_closed:
        return [dict(r, state="closed") for r in reports]
    refs = [a.health.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for report, ref in zip(reports, refs):
        if ref not in ready:
            report["state"] = f"no answer within {timeout_s:g} s"
            continue
        try:
            report.update(ray.get(ref), is_alive=True)
        except RayActorError as e:
            report.update(state="dead", error=last_line(e))
    return reports
