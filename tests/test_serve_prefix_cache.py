"""Prefix caching through `specray serve` and the real ``openai`` client: ``cached_tokens`` in
``usage.prompt_tokens_details``, ``cache_salt`` isolation, the per-pool Prometheus counters and
``POST /reset_prefix_cache``. The server speculates with a standalone draft model, so there are
two pools (target pages of 16 tokens, draft pages of 32: hits are multiples of 32)."""

from __future__ import annotations

import urllib.request

import pytest
from serve_server import start_server, stop_server

from specray.cli import build_parser, engine_config_from_args
from specray.config import CPU_MAX_NUM_BATCHED_TOKENS

PROMPT = [(7 * i * i + 3 * i) % 300 + 3 for i in range(45)]  # 45 tokens: a hit of 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-prefix")
    s = start_server(folder / "server.log", "--model", "tiny-llama", "--tokens-per-block", "16",
                     "--kv-capacity-tokens", "4096", "--spec", "draft_model", "--num-draft-tokens", "3",
                     "--served-model-name", "tiny")
    yield s
    assert stop_server(s) == 0, s.log_tail()


def complete(server, salt: str | None = None, prompt=PROMPT):
    extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
    return server.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body=extra)


def counters(server) -> dict[str, float]:
    m = server.metrics()
    return {f"{name}:{dict(labels)['pool']}": v for (name, labels), v in m.items()
            if name.startswith("specray:prefix_cache_")}


def test_cached_tokens_salts_counters_and_reset(server):
    cold = complete(server)
    assert cold.usage.prompt_tokens == 45 and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = complete(server)
    assert warm.usage.prompt_tokens_details.cached_tokens == 32
    assert warm.choices[0].text == cold.choices[0].text
    assert complete(server, salt="tenant-a").usage.prompt_tokens_details.cached_tokens == 0
    assert complete(server, salt="tenant-b").usage.prompt_tokens_details.cached_tokens == 0
    assert complete(server, salt="tenant-a").usage.prompt_tokens_details.cached_tokens == 32
    got = counters(server)
    assert got == {"specray:prefix_cache_queries_total:target": 5 * 45, "specray:prefix_cache_queries_total:draft": 5 * 45,
                   "specray:prefix_cache_hits_total:target": 64, "specray:prefix_cache_hits_total:draft": 64}
    request = urllib.request.Request(server.url + "/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    assert complete(server).usage.prompt_tokens_details.cached_tokens == 0
    assert complete(server).usage.prompt_tokens_details.cached_tokens == 32


def test_streamed_usage_carries_cached_tokens(server):
    complete(server, salt="stream")
    chunks = list(server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "cache_salt": "stream"}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_the_flag_turns_caching_off():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).kv.enable_prefix_caching
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--max-num-batched-tokens", "48"])
    cfg = engine_config_from_args(args)
    assert not cfg.kv.enable_prefix_caching and cfg.step_token_budget == 48
    assert engine_config_from_args(parser.parse_args(["serve"])).step_token_budget == CPU_MAX_NUM_BATCHED_TOKENS
