"""Shared-memory segments between the ranks of one host: one helper for the plan ring
(``comm/channel.py``) and the one-shot all-reduce (``comm/one_shot.py``).

Rules every segment follows:

- Its name derives from the job id, its purpose, the creator's pid and a random token
  (``specray-<job>-<purpose>-<pid>-<token>``), so two jobs never collide and no name is fixed.
- It is created with O_CREAT | O_EXCL (never adopting a file someone else made) and mode 0600
  (only this user can open it), and its pages are reserved at once (``posix_fallocate``): a
  full /dev/shm fails at creation with an error naming the size, not as a SIGBUS later.
- A rank that maps it checks first that it is this user's, mode 0600, of the expected size.
- ``share_segment`` does all of it collectively: the creator unlinks the name as soon as every
  rank that needed it mapped it, and every rank learns of any rank's failure, so all raise
  ``SegmentUnavailable`` together instead of some waiting for the others. From then on the
  segment has no name and lives until its last mapping goes (a close, an exit, a kill), so
  nothing is left behind. The one window is start-up itself: a creator killed between create
  and unlink (one gloo round trip) leaves its file.
- Segments are raw bytes: the caller lays out its own fields.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from collections.abc import Callable

SHM_DIR = "/dev/shm"


class SegmentUnavailable(RuntimeError):
    """A shared segment could not be set up on every rank; the same error is raised on all of them."""


def segment_name(job_id: str, purpose: str) -> str:
    return f"specray-{job_id or 'nojob'}-{purpose}-{os.getpid()}-{secrets.token_hex(6)}"


def create_segment(name: str, num_bytes: int) -> mmap.mmap:
    """A new zero-filled segment, readable and writable by this user only, its pages reserved."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)


def attach_segment(name: str, num_bytes: int | None = None) -> mmap.mmap:
    """Map an existing segment after checking it is this user's, mode 0600 and (when given)
    ``num_bytes`` long."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        size = st.st_size if num_bytes is None else num_bytes
        if st.st_uid != os.getuid() or mode != 0o600 or st.st_size != size or size == 0:
            raise PermissionError(f"segment {name} has uid {st.st_uid}, mode {mode:o}, {st.st_size} bytes; "
                                  f"expected uid {os.getuid()}, mode 600, {size} bytes")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def share_segment(group, num_bytes: int, job_id: str, purpose: str, needs_map: bool,
                  init: Callable[[mmap.mmap], None] | None = None) -> tuple[str, mmap.mmap | None]:
    """One segment for ``group`` (collective): its first rank creates it and runs ``init`` on
    it before anyone else maps it, every rank with ``needs_map`` maps it, the name is
    unlinked, and any rank's failure raises ``SegmentUnavailable`` on every rank. Returns the
    (already unlinked) name and this rank's mapping (the creator always maps), else None."""
    name, error, segment = None, None, None
    if group.rank_in_group == 0:
        name = segment_name(job_id, purpose)
        try:
            segment = create_segment(name, num_bytes)
            if init is not None:
                init(segment)
        except OSError as e:
            error = f"cannot create {os.path.join(SHM_DIR, name)} ({num_bytes} bytes): {e}"
    name, error = group.broadcast_object((name, error))
    try:
        if error is None and needs_map and segment is None:
            try:
                segment = attach_segment(name, num_bytes)
            except OSError as e:
                error = f"rank {group.ranks[group.rank_in_group]} cannot map {os.path.join(SHM_DIR, name)}: {e}"
        gathered = group.gather_object(error)  # to the creator, then its verdict to all: two hops
        errors = group.broadcast_object(None if gathered is None else [e for e in gathered if e is not None])
    finally:
        if group.rank_in_group == 0 and name is not None:
            unlink_segment(name)
    if errors:
        if segment is not None:
            segment.close()
        raise SegmentUnavailable("; ".join(dict.fromkeys(errors)))
    return name, segment


def leftover_segments(job_id: str) -> list[str]:
    """Names of this job's segments still visible (there should be none after start-up)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"specray-{job_id}-"))


def segments_created_by(pid: int) -> list[str]:
    """Names of segments that process ``pid`` created and that are still visible."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("specray-") and n.split("-")[-2] == str(pid))
