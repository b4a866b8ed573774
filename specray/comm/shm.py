"""Shared-memory segments between the ranks of one host.

A segment is a file under /dev/shm created with O_EXCL and mode 0600 (only this user can
open it) under a name derived from the job id plus a random suffix, so two jobs never
collide. Rules callers must respect:

- The creator unlinks the name as soon as every peer has mapped it (``unlink`` after a
  barrier). The mapping lives on until the last process unmaps or exits, so a segment is
  never left behind, even when a rank is killed.
- Segments are raw bytes: the caller lays out its own fields (see ``comm/channel.py``).
"""

from __future__ import annotations

import mmap
import os
import secrets

SHM_DIR = "/dev/shm"


def segment_name(job_id: str, purpose: str) -> str:
    return f"specray-{job_id}-{purpose}-{secrets.token_hex(4)}"


def create_segment(name: str, num_bytes: int) -> mmap.mmap:
    """A new zero-filled segment readable and writable by this user only."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, num_bytes)
        return mmap.mmap(fd, num_bytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def attach_segment(name: str) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def leftover_segments(job_id: str) -> list[str]:
    """Names of this job's segments still visible (there should be none after start-up)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"specray-{job_id}-"))
