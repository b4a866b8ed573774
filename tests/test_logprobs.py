"""Log-probabilities in the engine: the target's raw log_softmax at every generated position and
every prompt position, equal to transformers' on the same checkpoint; under n-gram and
standalone-drafter speculation equal to plain decoding's (the verify rows, not the drafter's);
max_tokens 0 runs the prompt only.

Tolerance: transformers and specray both run float32 on CPU, but specray fuses projections and
runs its own kernels, so logits differ by a few ulp (test_hf_parity bounds them by 1e-4); the
log-softmax inherits that. A value taken from the wrong row (a shift by one position, the
drafter's logits) is off by > 1e-2 on these checkpoints, so 1e-4 tells them apart. Speculation
against plain decoding: the same model on the same tokens, but a verify forward scores several
rows at once, so the matmuls may block differently: 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import load_reference, make_checkpoint

from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.models.drafter_presets import write_drafter_for

TOL_HF, TOL_SPEC = 1e-4, 1e-5
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3)
    return target, write_drafter_for(target, "draft_model", root / "draft_model")


def config(ckpt, method=None, k=4) -> EngineConfig:
    target, drafter = ckpt
    spec = SpecConfig(method=method, num_draft_tokens=k, draft_model=str(drafter) if method == "draft_model" else None,
                      **({"prompt_lookup_min": 2, "prompt_lookup_max": 3} if method == "ngram" else {}))
    return EngineConfig(model=str(target), kv=KVConfig(tokens_per_block=16, capacity_tokens=4096),
                        spec=spec if method else None)


@pytest.fixture(scope="module")
def prompts(ckpt):
    """Two prompts, the second a prompt followed by its own greedy continuation (its next tokens
    repeat it, so n-gram drafts are accepted)."""
    with LLM(config(ckpt)) as llm:
        base = [5, 17, 33, 2, 99, 100, 7, 250]
        tail = llm.generate([base], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    return [list(range(40, 61)), base + tail]


@pytest.fixture(scope="module")
def reference(ckpt):
    return load_reference(ckpt[0])


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``tokens`` (row i predicts token i + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain(ckpt, prompts):
    with LLM(config(ckpt)) as llm:
        return llm.generate(prompts, greedy(logprobs=5))


def test_output_logprobs_equal_transformers_at_every_position(plain, prompts, reference):
    for prompt, out in zip(prompts, plain):
        assert len(out.logprobs) == len(out.token_ids) == MAX_TOKENS
        lp = hf_logprobs(reference, prompt + out.token_ids)[len(prompt) - 1:-1]
        ours = torch.tensor([e.logprob for e in out.logprobs])
        torch.testing.assert_close(ours, lp[torch.arange(MAX_TOKENS), torch.tensor(out.token_ids)],
                                   rtol=0, atol=TOL_HF)
        top = lp.topk(5, dim=-1)
        for i, e in enumerate(out.logprobs):
            assert [t for t, _ in e.top] == top.indices[i].tolist()  # no near-ties among the top 5 here
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top.values[i], rtol=0, atol=TOL_HF)
            assert e.token_id == out.token_ids[i] == e.top[0][0]  # greedy: the chosen token is the most likely


def test_prompt_logprobs_and_max_tokens_0_equal_transformers(ckpt, prompts, reference):
    with LLM(config(ckpt)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=2))
        again = llm.generate(prompts[:1], SamplingParams(max_tokens=3, prompt_logprobs=0, ignore_eos=True))[0]
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == [] and out.finish_reason == "length" and out.prompt_token_ids == prompt
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        lp = hf_logprobs(reference, prompt)[:-1]
        ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        torch.testing.assert_close(ours, lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                                   rtol=0, atol=TOL_HF)
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
        assert all(len(e.top) == 2 for e in out.prompt_logprobs[1:])
    torch.testing.assert_close(torch.tensor([e.logprob for e in again.prompt_logprobs[1:]]),  # batched alone
                               torch.tensor([e.logprob for e in outs[0].prompt_logprobs[1:]]), rtol=0, atol=TOL_SPEC)
    assert len(again.token_ids) == 3 and again.logprobs is None  # output logprobs only when asked
    # its whole prompt ran (no prefix-cache hit: the prompt's log-probabilities need every row)
    assert again.metrics["num_cached_tokens"] == 0


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_chunking(ckpt, prompts):
    """A repeated prompt hits the cache unless it asks for prompt log-probabilities; a prompt
    prefilled in chunks of 5 gets the same log-probabilities as in one step."""
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    with LLM(config(ckpt)) as llm:
        whole = llm.generate(prompts, params)
        warm = llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        again = llm.generate(prompts[:1], params)[0]
    assert warm.metrics["num_cached_tokens"] == 16  # caching is on: one 16-token page of the 21
    assert again.metrics["num_cached_tokens"] == 0
    with LLM(dataclasses.replace(config(ckpt), max_num_batched_tokens=5)) as llm:
        chunked = llm.generate(prompts, params)
    for a, b in zip(whole + [whole[0]], chunked + [again]):
        assert a.token_ids == b.token_ids and len(b.prompt_logprobs) == len(a.prompt_logprobs)
        torch.testing.assert_close(torch.tensor([e.logprob for e in b.prompt_logprobs[1:]]),
                                   torch.tensor([e.logprob for e in a.prompt_logprobs[1:]]), rtol=0, atol=TOL_SPEC)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_logprobs_equal_plain_decoding(ckpt, prompts, plain, method):
    with LLM(config(ckpt, method)) as llm:
        outs = llm.generate(prompts, greedy(logprobs=5, prompt_logprobs=1))
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 10  # drafts were accepted: verify rows used
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor([e.logprob for e in out.logprobs]),
                                   torch.tensor([e.logprob for e in ref.logprobs]), rtol=0, atol=TOL_SPEC)
        assert [[t for t, _ in e.top] for e in out.logprobs] == [[t for t, _ in e.top] for e in ref.logprobs]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_sampled_tokens_get_the_raw_logprobs_of_the_target(ckpt, prompts, reference):
    # raw: before temperature and top-k, so log_softmax of the plain logits at the sampled token
    params = SamplingParams(max_tokens=24, temperature=1.3, top_k=20, seed=5, ignore_eos=True, logprobs=0)
    with LLM(config(ckpt, "ngram")) as llm:
        out = llm.generate(prompts[1:], params)[0]
    lp = hf_logprobs(reference, prompts[1] + out.token_ids)[len(prompts[1]) - 1:-1]
    torch.testing.assert_close(torch.tensor([e.logprob for e in out.logprobs]),
                               lp[torch.arange(24), torch.tensor(out.token_ids)], rtol=0, atol=TOL_HF)
    assert all(e.top == () for e in out.logprobs)


def test_a_stop_inside_accepted_drafts_keeps_one_logprob_per_token(ckpt, prompts, plain):
    stop = plain[1].token_ids[10]
    with LLM(config(ckpt, "ngram")) as llm:
        out = llm.generate(prompts[1:], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,), logprobs=1))[0]
    assert out.token_ids == plain[1].token_ids[:plain[1].token_ids.index(stop) + 1]
    assert [e.token_id for e in out.logprobs] == out.token_ids
