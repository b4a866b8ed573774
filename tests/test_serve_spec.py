"""The real model (SmolLM2-135M-Instruct) served with n-gram speculation: chat answers, streamed
and not, equal plain greedy decoding through ``LLM.chat`` (speculation must not change greedy
text), and the speculative-decoding counters are consistent."""

from __future__ import annotations

import pytest
from serve_server import start_server, stop_server

from specray import LLM, EngineConfig, KVConfig, SamplingParams

KV = ["--tokens-per-block", "16", "--kv-capacity-tokens", "2048"]
# a question whose answer repeats its own words: n-gram drafts get accepted
QUESTIONS = ["Repeat this list twice: apple, banana, cherry, apple, banana, cherry.",
             "Write a Python function that reverses a string."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_spec") / "server.log"
    s = start_server(log, "--model", "smollm2-135m", *KV, "--spec", "ngram", "--num-draft-tokens", "4",
                     "--prompt-lookup-min", "2", "--prompt-lookup-max", "3")
    yield s
    assert stop_server(s) == 0, s.log_tail()


@pytest.fixture(scope="module")
def plain_answers():
    """Plain (no speculation) greedy answers of the same engine, in this process."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=16, capacity_tokens=2048))) as llm:
        return [llm.chat([{"role": "user", "content": q}], params)[0].text for q in QUESTIONS]


def test_streamed_speculative_chat_equals_plain_greedy(server, plain_answers):
    client = server.client()
    for question, plain in zip(QUESTIONS, plain_answers):
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0)
        stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content == plain
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_spec_decode_counters_are_consistent(server):
    m = server.metrics()
    drafted = m[("specray:spec_decode_num_draft_tokens_total", ())]
    accepted = m[("specray:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [m[("specray:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(4)]
    assert m[("specray:spec_decode_num_drafts_total", ())] > 0 and drafted > 0
    assert 0 < accepted <= drafted
    assert per_pos == sorted(per_pos, reverse=True), per_pos  # position i+1 is accepted only after i
    assert sum(per_pos) == accepted
