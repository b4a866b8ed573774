"""Logs carry the rank, and only rank 0 logs at INFO by default."""

import logging

from specray.launch.logs import configure_rank_logging


def test_followers_log_warnings_only_and_every_line_names_the_rank(capsys, monkeypatch):
    monkeypatch.delenv("SPECRAY_LOG_LEVEL", raising=False)
    log = logging.getLogger("specray.test")
    try:
        configure_rank_logging(3)
        log.info("progress")
        log.warning("trouble")
        configure_rank_logging(0)
        log.info("progress")
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2
        assert "[rank 3] WARNING specray.test: trouble" in err[0]
        assert "[rank 0] INFO specray.test: progress" in err[1]
    finally:
        root = logging.getLogger("specray")
        for h in [h for h in root.handlers if getattr(h, "is_specray_rank_handler", False)]:
            root.removeHandler(h)
        root.setLevel(logging.NOTSET)
        root.propagate = True
