"""A rank killed under the ``mp`` launcher while the server has requests in flight: they fail
with 500 (the ``RankFailure`` message in the body, a streaming one with an error event) within
the failure timeout, ``/health`` turns 503, and the server keeps answering and stops cleanly."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import openai
from faults import STEPS_INTO_THE_CALL, wait_for_steps
from serve_server import http_get, rank_pids, start_server, stop_server

FAILURE_TIMEOUT_S = 10.0
LONG = dict(model="tiny-llama", prompt=[1, 2, 3], max_tokens=900, temperature=0, extra_body={"ignore_eos": True})


def test_a_killed_rank_fails_in_flight_requests_with_500_and_health_503(tmp_path):
    step_dir = tmp_path / "steps"
    step_dir.mkdir()
    server = start_server(tmp_path / "server.log", "--model", "tiny-llama", "--tp", "2", "--launcher", "mp",
                          "--tokens-per-block", "16", "--kv-capacity-tokens", "4096",
                          # collectives (and rank start-up) get longer: a loaded 2-core machine must not fail
                          # the start; a dead rank is seen through its process, well within the failure timeout
                          "--timeout-s", "120", "--failure-timeout-s", str(FAILURE_TIMEOUT_S),
                          env={"SPECRAY_TEST_STEP_DIR": str(step_dir)})
    try:
        ranks = rank_pids(server.proc.pid)
        assert len(ranks) == 2, f"expected 2 mp ranks below the server, found {ranks}"
        client = server.client()

        def whole() -> BaseException | None:
            try:
                client.completions.create(**LONG)
            except openai.APIError as err:
                return err
            return None

        def streamed() -> BaseException | None:
            try:
                for _ in client.completions.create(**LONG, stream=True):
                    pass
            except openai.APIError as err:
                return err
            return None

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            calls = [pool.submit(whole), pool.submit(whole), pool.submit(streamed)]
            wait_for_steps(step_dir, 1, STEPS_INTO_THE_CALL + 2, lambda: not any(c.done() for c in calls))
            os.kill(ranks[-1], signal.SIGKILL)
            killed_at = time.monotonic()
            errors = [c.result(timeout=3 * FAILURE_TIMEOUT_S) for c in calls]
            failed_after_s = time.monotonic() - killed_at
        assert failed_after_s < FAILURE_TIMEOUT_S, f"requests failed {failed_after_s:.1f} s after the kill"
        for err in errors[:2]:
            assert isinstance(err, openai.InternalServerError) and err.status_code == 500, repr(err)
            assert "rank 1" in err.body["message"], err.body
        assert isinstance(errors[2], openai.APIError) and "rank 1" in str(errors[2]), repr(errors[2])
        assert server.health() == 503
        assert http_get(server.url + "/version")[0] == 200  # the server itself still answers
        try:
            client.completions.create(**{**LONG, "max_tokens": 2})
            raise AssertionError("a request after the failure succeeded")
        except openai.APIStatusError as err:
            assert err.status_code in (500, 503), err
    finally:
        code = stop_server(server)
    assert code == 0, server.log_tail()
