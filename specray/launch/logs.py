"""Rank-aware logging: every record carries the rank; by default only rank 0 logs at INFO
(the others at WARNING), so N ranks do not print N copies of the same progress line.
``SPECRAY_LOG_LEVEL`` overrides the level on every rank."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def configure_rank_logging(rank: int) -> None:
    log = logging.getLogger("specray")
    default = "INFO" if rank == 0 else "WARNING"
    log.setLevel(os.environ.get("SPECRAY_LOG_LEVEL", default).upper())
    for handler in list(log.handlers):
        if getattr(handler, "is_specray_rank_handler", False):
            log.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.is_specray_rank_handler = True
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank)))
    log.addHandler(handler)
    log.propagate = False
