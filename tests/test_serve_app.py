"""The server's own layer against an in-process engine double that speaks AsyncLLM's interface
(deltas in, aborts recorded): request validation, the error envelope and statuses, SSE framing,
usage, admission and metrics. The real engine behind a real server is tests/test_serve.py."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from specray.config import SamplingParams
from specray.launch.procs import RankFailure
from specray.serve.app import EngineHolder, ServeConfig, build_app
from specray.serve.errors import QueueFull, status_of
from specray.serve.generation import Admission
from specray.serve.metrics import ServerMetrics
from specray.serve.protocol import ChatCompletionRequest, CompletionRequest, fan_out


@dataclass
class Delta:
    request_id: str
    new_token_ids: list
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: dict | None = None
    prompt_token_ids: list | None = None
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: dict = None
    num_drafts: int = 4
    num_draft_tokens: int = 12
    num_accepted_tokens: int = 5
    accepted_per_position: list = None
    prefix_cache_queries: dict = None
    prefix_cache_hits: dict = None
    adaptive: dict = None


class EchoEngine:
    """Answers a prompt of ids with ids+1 (text: one letter per token), two tokens per delta."""

    def __init__(self, max_len: int = 64):
        self.max_len, self.is_healthy, self.tokenizer = max_len, True, None
        self.aborted: list[str] = []
        self.seen_params: list[SamplingParams] = []
        self.num_cached_tokens, self.num_resets = 0, 0  # what the last delta reports; reset calls

    async def generate(self, prompt, params, request_id=None):
        ids = list(prompt) if isinstance(prompt, list) else [ord(c) for c in str(prompt)][:8]
        if len(ids) + params.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds {self.max_len}")
        if not self.is_healthy:
            raise RankFailure("rank 1 died (exit code -9)", [1])
        self.seen_params.append(params)
        out = [(ids[i % len(ids)] + 1) % 256 for i in range(params.max_tokens)]
        try:
            for at in range(0, len(out), 2):
                await asyncio.sleep(0)
                new = out[at:at + 2]
                done = at + 2 >= len(out)
                yield Delta(request_id, new, "".join(chr(97 + t % 26) for t in new), len(ids), at + len(new),
                            "length" if done else None,
                            metrics={"num_cached_tokens": self.num_cached_tokens} if done else None)
        except GeneratorExit:
            self.aborted.append(request_id)
            raise

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def reset_prefix_cache(self):
        self.num_resets += 1

    def stats(self):
        return Stats(kv_usage={"target": 0.0}, accepted_per_position=[3, 2])

    async def close(self):
        pass


@pytest.fixture
def engine():
    return EchoEngine()


def client_for(engine, **config):
    holder = EngineHolder(lambda: engine)
    app = build_app(holder, ServeConfig(served_model_name="m", **config))
    return TestClient(app)


@pytest.fixture
def client(engine):
    with client_for(engine) as c:
        for _ in range(100):  # the engine starts in a worker thread after the app
            if c.get("/health").status_code == 200:
                break
        yield c


def test_completion_returns_text_and_usage(client):
    body = client.post("/v1/completions", json=dict(model="m", prompt=[1, 2, 3], max_tokens=3)).json()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["cde"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_n_choices_get_consecutive_seeds_and_prompt_tokens_count_once(client, engine):
    body = client.post("/v1/completions", json=dict(model="m", prompt=[5, 6], max_tokens=2, n=3, seed=7)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert sorted(p.seed for p in engine.seen_params) == [7, 8, 9]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_frames_role_text_finish_usage_and_done(client):
    request = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    whole = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions",
                       json=dict(request, stream=True, stream_options={"include_usage": True})) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:-1]) == whole != ""
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -1, "temperature"), ("top_p", 2, "top_p"),
    ("n", 0, "n"), ("stream_options", {"include_usage": True}, None), ("stop", [""], "stop"),
])
def test_bad_fields_are_400_in_the_openai_envelope(client, field, value, param):
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1], field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    if param:
        assert error["param"] == param
    assert client.get("/health").status_code == 200


def test_engine_rejections_unknown_models_and_routes(client):
    too_long = client.post("/v1/completions", json=dict(model="m", prompt=[1] * 60, max_tokens=10))
    assert too_long.status_code == 400 and "exceeds 64" in too_long.json()["error"]["message"]
    unknown = client.post("/v1/completions", json=dict(model="other", prompt=[1]))
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert client.get("/v1/nothing").json()["error"]["code"] == 404
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_api_key_guards_v1_only(engine):
    with client_for(engine, api_key="k") as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/version").status_code == 200


def test_rank_failure_is_500_with_its_message_and_health_503(client, engine):
    engine.is_healthy = False
    r = client.post("/v1/completions", json=dict(model="m", prompt=[1], max_tokens=2))
    assert r.status_code == 500 and "rank 1 died" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503


def test_health_is_503_while_the_engine_starts():
    may_start = threading.Event()

    def slow_engine():
        may_start.wait(10)
        return EchoEngine()

    with TestClient(build_app(EngineHolder(slow_engine), ServeConfig(served_model_name="m"))) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json=dict(model="m", prompt=[1]))
        assert r.status_code == 503 and "still starting" in r.json()["error"]["message"]
        may_start.set()


def test_admission_refuses_above_capacity():
    admission = Admission(3)
    admission.acquire(2)
    with pytest.raises(QueueFull, match="capacity of 3"):
        admission.acquire(2)
    admission.release(2)
    admission.acquire(3)
    assert status_of(QueueFull("x")) == (503, "ServiceUnavailableError")


def test_fan_out_orders_choices_prompt_major():
    req = CompletionRequest(prompt=["a", "b"], n=2, seed=1)
    choices = fan_out(req.prompts(), req.sampling_params(16))
    assert [(c.index, c.prompt, c.params.seed) for c in choices] == [(0, "a", 1), (1, "a", 2), (2, "b", 1), (3, "b", 2)]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                 max_completion_tokens=5, max_tokens=9)
    assert chat.sampling_params(16)[0].max_tokens == 5
    assert chat.prompts()[0].messages == [{"role": "user", "content": "x"}]


def test_inter_token_count_is_tokens_minus_one_per_request():
    metrics = ServerMetrics("m", stats=lambda: Stats(kv_usage={"target": 0.25, "draft": 0.5},
                                                     accepted_per_position=[3, 1]))
    for sizes in ([1, 3, 2], [2, 2]):  # 6 and 4 tokens: 5 + 3 gaps
        timer = metrics.track()
        for i, size in enumerate(sizes):
            timer.on_delta(Delta("r", [0] * size, "", 4, 0, "stop" if i == len(sizes) - 1 else None))
    text = metrics.render().decode()
    assert 'specray:time_to_first_token_seconds_count{model_name="m"} 2.0' in text
    assert 'specray:inter_token_latency_seconds_count{model_name="m"} 8.0' in text
    assert 'specray:request_success_total{finished_reason="stop",model_name="m"} 2.0' in text
    assert 'specray:kv_cache_usage_perc{model_name="m",pool="draft"} 0.5' in text
    assert 'specray:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text


def test_adaptive_speculation_metrics():
    # decode rows per draft length 0..3 (k = 3): 5 plain rows, 2 at length 1, none at 2, 3 at 3
    adaptive = dict(draft_length_histogram=[5, 2, 0, 3], num_steps_without_drafting=4, num_draft_length_switches=1)
    stats = Stats(kv_usage={}, accepted_per_position=[], adaptive=adaptive)
    text = ServerMetrics("m", stats=lambda: stats).render().decode()
    for line in ('specray:spec_decode_draft_length_bucket{le="0.0",model_name="m"} 5.0',
                 'specray:spec_decode_draft_length_bucket{le="1.0",model_name="m"} 7.0',
                 'specray:spec_decode_draft_length_bucket{le="2.0",model_name="m"} 7.0',
                 'specray:spec_decode_draft_length_bucket{le="3.0",model_name="m"} 10.0',
                 'specray:spec_decode_draft_length_bucket{le="+Inf",model_name="m"} 10.0',
                 'specray:spec_decode_draft_length_count{model_name="m"} 10.0',
                 'specray:spec_decode_draft_length_sum{model_name="m"} 11.0',
                 'specray:spec_decode_num_steps_without_drafting_total{model_name="m"} 4.0',
                 'specray:spec_decode_num_draft_length_switches_total{model_name="m"} 1.0'):
        assert line in text, line
    # static speculation (or none): no adaptive metrics at all
    static = Stats(kv_usage={}, accepted_per_position=[])
    assert "draft_length" not in ServerMetrics("m", stats=lambda: static).render().decode()
    assert "not_verified" not in text  # a drafter without a confidence head exports no such counter
    gated = Stats(kv_usage={}, accepted_per_position=[], adaptive={**adaptive, "num_drafts_not_verified": 6})
    assert 'specray:spec_decode_num_drafts_not_verified_total{model_name="m"} 6.0' in \
        ServerMetrics("m", stats=lambda: gated).render().decode()


def test_serve_rejects_bad_server_flags_before_starting_anything(capsys):
    from specray.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "port (70000) must be in [0, 65535]" in capsys.readouterr().err
    assert main(["serve", "--max-num-queued-reqs", "-1"]) == 2
    assert "max_num_queued_reqs (-1) must be >= 0" in capsys.readouterr().err


# A value for every field of the unsupported list that would change the output if it were honoured.
CHANGING = {"best_of": 3, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
            "logit_bias": {"5": 10}, "suffix": "end", "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto", "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": True,
            "prompt_logprobs": 1, "min_p": 0.1, "min_tokens": 3, "modalities": ["text", "audio"],
            "audio": {"voice": "x"}, "prediction": {"type": "content", "content": "x"},
            "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low", "logits_processors": ["x"],
            "bad_words": ["x"], "allowed_token_ids": [1], "guided_json": {}, "guided_regex": "a+",
            "guided_choice": ["a"], "guided_grammar": "root ::= \"a\"", "use_beam_search": True,
            "length_penalty": 2.0, "include_stop_str_in_output": True, "chat_template": "{{ x }}",
            "chat_template_kwargs": {"enable_thinking": True}}


def test_the_unsupported_table_is_what_the_test_covers():
    from specray.serve.fields import UNSUPPORTED

    assert sorted(CHANGING) == list(UNSUPPORTED)


@pytest.mark.parametrize("name", sorted(CHANGING))
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_unsupported_field_is_400_naming_it(client, engine, name, route):
    base = (dict(model="m", prompt=[1], max_tokens=2) if route == "completions" else
            dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    r = client.post(path, json={**base, name: CHANGING[name]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    assert engine.seen_params == []  # refused before the engine saw it
    assert client.post(path, json=base).status_code == 200


@pytest.mark.parametrize("extra", [{"user": "u1"}, {"metadata": {"k": "v"}}, {"store": False},
                                   {"service_tier": "auto"}, {"cache_salt": "s"}, {"frequency_penalty": 0},
                                   {"tools": []}, {"tool_choice": "none"}, {"logit_bias": {}}, {"best_of": 1}])
def test_fields_that_cannot_change_the_output_are_accepted(client, extra):
    r = client.post("/v1/completions", json=dict(model="m", prompt=[1], max_tokens=2, **extra))
    assert r.status_code == 200, r.text


def test_unknown_fields_and_message_fields_are_400(client):
    r = client.post("/v1/completions", json=dict(model="m", prompt=[1], max_token=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]
    r = client.post("/v1/chat/completions", json=dict(model="m", messages=messages))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls"
    ok = [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "x", "refusal": None}]
    assert client.post("/v1/chat/completions", json=dict(model="m", messages=ok, max_tokens=2)).status_code == 200


def test_max_tokens_0_needs_echo_and_top_logprobs_need_logprobs(client):
    r = client.post("/v1/completions", json=dict(model="m", prompt=[1], max_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/chat/completions", json=dict(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      top_logprobs=2))
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]


def test_cache_salt_reaches_the_engine_and_cached_tokens_the_usage(client, engine):
    engine.num_cached_tokens = 32
    body = client.post("/v1/chat/completions", json=dict(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=2, cache_salt="tenant")).json()
    assert engine.seen_params[-1].cache_salt == "tenant"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    body = client.post("/v1/completions", json=dict(model="m", prompt=[1, 2], max_tokens=2, n=2)).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # once per prompt, as prompt_tokens
    assert client.post("/v1/completions", json=dict(model="m", prompt=[1], cache_salt="")).status_code == 400
    assert client.post("/reset_prefix_cache").status_code == 200 and engine.num_resets == 1
