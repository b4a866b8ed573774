"""`specray serve` in a subprocess (tiny-llama: it has no chat template, so chat is tested on the
real model in test_serve_spec.py), driven by the real ``openai`` client: outputs equal
``LLM.generate``, streaming equals non-streaming, errors map to the client's error classes,
many concurrent clients with cancellations leave nothing behind, and the metrics add up.

Greedy outputs are compared exactly: the server and the reference run the same engine code on
the same weights, and greedy decoding of the tiny preset has no near-ties at these lengths (the
same rule the launcher parity tests rely on)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import openai
import pytest
from faults import steps_done
from serve_server import http_get, start_server, stop_server

from specray import LLM, EngineConfig, KVConfig, SamplingParams

KV = ["--tokens-per-block", "16", "--kv-capacity-tokens", "4096"]
MAX_NUM_SEQS, MAX_QUEUED = 8, 32  # admission capacity 40: the 32 streaming clients fit, a burst of 80 does not
PROMPTS = ["hello there", "the drafts", "abc", "speculative decoding is", "0123456789"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    s = start_server(folder / "server.log", "--model", "tiny-llama", *KV, "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--max-num-queued-reqs", str(MAX_QUEUED), "--served-model-name", "tiny",
                     env={"SPECRAY_TEST_STEP_DIR": str(folder)})
    s.step_dir = folder
    yield s
    assert stop_server(s) == 0, s.log_tail()


@pytest.fixture(scope="module")
def reference():
    with LLM(EngineConfig(model="tiny-llama", max_num_seqs=MAX_NUM_SEQS,
                          kv=KVConfig(tokens_per_block=16, capacity_tokens=4096))) as llm:
        yield llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_completions_equal_llm_generate(server, reference):
    client = server.client()
    outs = reference.generate(PROMPTS[:2], greedy(12))
    got = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [o.text for o in outs]
    assert got.usage.completion_tokens == 24
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == reference.generate([[5, 6, 7]], greedy(8))[0].text
    assert ids.choices[0].finish_reason == "length" and ids.usage.prompt_tokens == 3


def test_stream_equals_whole_and_usage_comes_last(server):
    client = server.client()
    args = dict(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_n_samples_with_a_seed_are_reproducible(server):
    client = server.client()
    args = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, n=3, seed=11, temperature=1.0,
                extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**args).choices]
    again = [c.text for c in client.completions.create(**args).choices]
    assert first == again
    assert len(set(first)) > 1, "three samples at temperature 1 should not all be equal"
    streamed = ["", "", ""]
    for chunk in client.completions.create(**args, stream=True):  # the choices' chunks interleave
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == first


@pytest.mark.parametrize("args, error", [
    (dict(max_tokens=0), openai.BadRequestError),
    (dict(temperature=-1), openai.BadRequestError),
    (dict(top_p=2), openai.BadRequestError),
    (dict(model="no-such-model"), openai.NotFoundError),
    (dict(prompt="x" * 5000, max_tokens=4), openai.BadRequestError),  # over the 4096-token pool
    (dict(stream_options={"include_usage": True}), openai.BadRequestError),
])
def test_bad_fields_raise_the_clients_error_and_the_server_stays_healthy(server, args, error):
    with pytest.raises(error) as info:
        server.client().completions.create(**{"model": "tiny", "prompt": "hi", "max_tokens": 4, **args})
    assert info.value.body["message"], info.value.body  # the envelope's message reaches the client
    assert server.health() == 200


async def _stream_text(client, prompt: str, cancel_after: int | None) -> str | None:
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text, num_chunks = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text
        num_chunks += 1
        if cancel_after is not None and num_chunks >= cancel_after:
            await stream.close()  # the client leaves mid-stream
            return None
    return text


def test_32_streaming_clients_with_a_third_cancelled_leave_nothing_behind(server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(32)]
    expected = [o.text for o in reference.generate(prompts, greedy(24))]

    async def run_all():
        client = server.async_client()
        jobs = [_stream_text(client, p, 2 if i % 3 == 0 else None) for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run_all())
    for i, (text, want) in enumerate(zip(texts, expected)):
        if i % 3:
            assert text == want, f"client {i}"
    _wait_idle(server)


def _wait_idle(server, timeout_s: float = 20.0) -> None:
    """Running and waiting gauges back to 0 and every target page free, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        busy = (m[("specray:num_requests_running", ())], m[("specray:num_requests_waiting", ())],
                m.get(("specray:kv_cache_usage_perc", (("pool", "target"),))))
        if busy == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: running, waiting, kv = {busy}"
        time.sleep(0.1)


def test_a_burst_above_the_queue_gets_503_and_never_500(server):
    client = server.client()

    def one(i: int) -> int:
        try:
            client.completions.create(model="tiny", prompt=PROMPTS[i % 5], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as err:
            return err.status_code

    with concurrent.futures.ThreadPoolExecutor(80) as pool:
        statuses = list(pool.map(one, range(80)))
    assert 503 in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, 503}, statuses
    assert server.health() == 200
    _wait_idle(server)


def test_ttft_and_inter_token_counts_add_up(server):
    before = server.metrics()
    client = server.client()
    outputs = [client.completions.create(model="tiny", prompt=p, max_tokens=5 + i, temperature=0,
                                         extra_body={"ignore_eos": True}) for i, p in enumerate(PROMPTS)]
    after = server.metrics()

    def grew(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert grew("specray:time_to_first_token_seconds_count") == len(PROMPTS)
    assert grew("specray:inter_token_latency_seconds_count") == sum(o.usage.completion_tokens - 1 for o in outputs)
    assert grew("specray:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert grew("specray:generation_tokens_total") == sum(o.usage.completion_tokens for o in outputs)


def test_routes_around_generation(server):
    status, text = http_get(server.url + "/version")
    assert status == 200 and '"version"' in text
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    import json
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    ids = post("/tokenize", {"prompt": "hello"})
    assert ids["count"] == len(ids["tokens"]) > 0
    assert post("/detokenize", {"tokens": ids["tokens"]})["prompt"].endswith("hello")


def test_a_client_that_times_out_aborts_its_non_streaming_request(server):
    """The request would take 4000 decode steps; the engine stops far short of that, and the
    gauges and the pool show nothing left running."""
    client = server.client().with_options(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4000, temperature=0,
                                  extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 20.0
    steps = [steps_done(server.step_dir, 0)]
    while len(steps) < 2 or steps[-1] != steps[-2]:  # until the engine stops stepping
        assert time.monotonic() < deadline, f"the engine kept stepping: {steps}"
        time.sleep(0.5)
        steps.append(steps_done(server.step_dir, 0))
    assert steps[-1] < steps[0] + 4000, f"the abandoned request ran to its end: {steps}"
    _wait_idle(server, timeout_s=5.0)
