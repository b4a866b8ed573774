"""What ranks send the driver (RankReply), checked the same way by the mp and Ray drivers."""

from __future__ import annotations

import pytest

from specray.launch.rank import RankReply


def _fail(detail: str) -> Exception:
    return RuntimeError(f"job stopped: {detail}")


def test_a_reply_without_error_passes():
    reply = RankReply("ok", outputs=[1])
    assert reply.checked(0, _fail) is reply


def test_rank_zero_rejecting_bad_input_raises_it_and_the_job_goes_on():
    reply = RankReply.error(ValueError("request 0: the prompt is empty"), is_fatal=False)
    with pytest.raises(ValueError, match="^request 0: the prompt is empty$"):
        reply.checked(0, _fail)


def test_a_fatal_error_or_one_from_a_follower_stops_the_job():
    fatal = RankReply.error(TimeoutError("gloo timed out"), is_fatal=True)
    with pytest.raises(RuntimeError, match="job stopped: rank 0 reported TimeoutError: gloo timed out"):
        fatal.checked(0, _fail)
    with pytest.raises(RuntimeError, match="job stopped: rank 2 reported KeyError: 'x'"):
        RankReply.error(KeyError("x"), is_fatal=False).checked(2, _fail)
