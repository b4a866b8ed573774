"""Which Ray cluster a specray driver joins, decided without waiting on a dead one.

Ray's own ``ray.init()`` with no address reads the address file that ``ray start`` (and
``ray.cluster_utils.Cluster``) leave in Ray's temp dir (``/tmp/ray/ray_current_cluster``, or under
``RAY_TMPDIR``) and connects to the head it names. A program that crashed leaves that file behind,
and ``ray.init()`` then waits minutes on an address nobody answers. The rule here:

1. an explicit address (``ParallelConfig.ray_address`` / ``--ray-address``, else ``RAY_ADDRESS``)
   is joined as Ray joins it (``"local"`` starts a local instance);
2. else, when the address file names a head whose GCS port accepts a TCP connection within
   ``HEAD_PROBE_TIMEOUT_S``, that cluster is joined (a node where ``ray start`` ran);
3. else a local instance is started (``address="local"``: it neither reads nor rewrites the
   file); a file naming a dead head is said in one warning with its path and the fix.

Why start rather than fail (docs/architecture.md): a head that does not accept a connection
cannot run a rank, so failing would only ask the user to delete a file Ray itself left; a user
who meant that cluster gets the warning naming it, and an explicit address never falls back.
"""

from __future__ import annotations

import logging
import os
import socket

HEAD_PROBE_TIMEOUT_S = 2.0
"""A live GCS accepts a connection at once; a dead port refuses at once, a lost host times out."""

log = logging.getLogger(__name__)


def head_answers(address: str, timeout_s: float = HEAD_PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within ``timeout_s``."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def recorded_head() -> tuple[str, str | None]:
    """(path of Ray's address file, the address it records or None)."""
    from ray._common.utils import get_ray_address_file  # Ray's own path rule (honours RAY_TMPDIR)

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            return path, f.read().strip() or None
    except FileNotFoundError:
        return path, None


def choose_address(address: str | None = None) -> tuple[str, str | None]:
    """("join" | "local", the address to join or a warning to log): the rule of this module."""
    explicit = address or os.environ.get("RAY_ADDRESS") or None
    if explicit is not None:
        return ("local", None) if explicit == "local" else ("join", explicit)
    path, recorded = recorded_head()
    if recorded is None:
        return "local", None
    if head_answers(recorded):
        return "join", recorded
    return "local", (f"specray: {path} names a Ray head at {recorded} that does not answer (left by a Ray "
                     f"program that did not shut down); starting a local Ray instance instead. `ray stop` "
                     f"removes the stale file; --ray-address or RAY_ADDRESS joins a cluster explicitly.")


def connect_ray(address: str | None = None, **local_options) -> bool:
    """Join or start Ray by the rule above; ``local_options`` (num_cpus, object_store_memory, ...)
    apply only to a local instance. Returns True when a local instance was started."""
    import ray

    kind, detail = choose_address(address)
    if kind == "join":
        ray.init(address=detail)
        return False
    if detail:
        log.warning(detail)
    ray.init(address="local", **{"include_dashboard": False, **local_options})
    return True
