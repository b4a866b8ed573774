"""Single-rank engine behaviour: batching, preemption, sampling, stopping, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoints import make_checkpoint

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig

PROMPTS = [list(range(1, 1 + n)) for n in (5, 30, 13, 61, 2, 44)]


@pytest.fixture(scope="module")
def llm():
    with LLM(EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=4096))) as engine:
        yield engine


def test_preemption_keeps_every_request_and_its_tokens(llm):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    # 12 pages of 16 tokens cannot hold the six requests at once (they need ~25 pages).
    small = EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=192))
    with LLM(small) as tight:
        outs = tight.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert all(len(o.token_ids) == 40 for o in outs)


def test_batched_equals_one_at_a_time(llm):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert together == alone


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(llm):
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    a = llm.generate(PROMPTS[:3], params)
    b = llm.generate(PROMPTS[:3], params)
    greedy = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]


def test_top_k_one_is_greedy(llm):
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.7, top_k=1, seed=1))
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


def test_stop_tokens_and_eos(llm):
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop = free[5]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=30, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[: free.index(stop) + 1]
    assert out.finish_reason == "stop"


EOS_PROMPT, EOS_MAX_TOKENS = [7, 3, 91, 12, 250], 24


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory) -> tuple[str, list[int], int]:
    """(checkpoint, its free-running greedy tokens, their EOS index): a tiny Llama whose
    config.json names as EOS the token its own weights emit (the argmax) at a known step after
    EOS_PROMPT, so the model really stops there. Random weights never emit a preset's EOS id."""
    root = tmp_path_factory.mktemp("eos")
    free_dir = make_checkpoint("llama", root / "free", seed=5)  # eos_token_id None: nothing stops it
    config = EngineConfig(model=str(free_dir), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))
    with LLM(config) as free_llm:
        free = free_llm.generate([EOS_PROMPT], SamplingParams(max_tokens=EOS_MAX_TOKENS))[0].token_ids
    # the first token, from the 4th on, that the model had not emitted before: it stops there
    at = next(i for i in range(3, len(free) - 4) if free[i] not in free[:i])
    eos_dir = shutil.copytree(free_dir, root / "eos")
    cfg = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=free[at])))
    return str(eos_dir), free, at


def _eos_config(model: str, spec: SpecConfig | None = None) -> EngineConfig:
    return EngineConfig(model=model, kv=KVConfig(tokens_per_block=32, capacity_tokens=1024), spec=spec)


@pytest.mark.parametrize("drafting", [None, "self", "eagle3"])
def test_generation_stops_at_the_models_eos(eos_case, drafting, tmp_path):
    """Local and speculative decoding: EOS ends the request (as the last token), inside
    accepted drafts too (drafting with the target itself accepts nearly every draft), and
    ignore_eos runs on to max_tokens."""
    model, free, at = eos_case
    spec = None
    if drafting == "self":
        spec = SpecConfig(method="draft_model", draft_model=model, num_draft_tokens=4)
    elif drafting == "eagle3":
        from specray.models.drafter_presets import write_drafter_for

        spec = SpecConfig(method="eagle3", draft_model=str(write_drafter_for(model, "eagle3", tmp_path / "d")))
    with LLM(_eos_config(model, spec)) as llm:
        stopped = llm.generate([EOS_PROMPT], SamplingParams(max_tokens=EOS_MAX_TOKENS))[0]
        ignored = llm.generate([EOS_PROMPT], SamplingParams(max_tokens=EOS_MAX_TOKENS, ignore_eos=True))[0]
    assert llm.config.spec.is_enabled == (drafting is not None)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:at + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == free
    if drafting == "self":  # EOS came out of accepted drafts, not only as a bonus token
        assert stopped.metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "request 1: the prompt is empty"),
    ([1, 320], SamplingParams(), r"request 1: token id 320 is outside the vocabulary \[0, 320\)"),
    ([-1], SamplingParams(), "token id -1 is outside"),
    (list(range(100)) * 41, SamplingParams(max_tokens=8), r"4100 tokens\) \+ max_tokens \(8\) = 4108 exceeds the KV pool capacity \(4096 tokens\)"),
])
def test_bad_request_rejects_the_call_and_keeps_the_engine(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params)
    # Nothing was half served: the engine still answers, and no page leaked.
    ok = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert len(ok[0].token_ids) == 4
    assert llm._engine.allocator.num_free == llm._engine.allocator.num_blocks


def test_request_longer_than_the_model_is_rejected_before_it_runs(tmp_path):
    short = make_checkpoint("llama", tmp_path / "short", max_position_embeddings=64)
    with LLM(EngineConfig(model=str(short), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        with pytest.raises(ValueError, match=r"request 0: prompt \(60 tokens\) \+ max_tokens \(8\) = 68 exceeds "
                                             r"the model's max_position_embeddings \(64\)"):
            llm.generate([list(range(1, 61)), [1, 2]], SamplingParams(max_tokens=8))
        ok = llm.generate([list(range(1, 57))], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(ok[0].token_ids) == 8  # exactly at the limit is served
        assert llm._engine.allocator.num_free == llm._engine.allocator.num_blocks


@pytest.mark.parametrize("build, message", [
    (lambda: SamplingParams(max_tokens=-1), r"max_tokens \(-1\) must be an integer >= 0"),  # 0: the prompt only
    (lambda: SamplingParams(logprobs=21), r"logprobs \(21\) must be None or an integer in \[0, 20\]"),
    (lambda: SamplingParams(temperature=-0.5), r"temperature \(-0.5\) must be >= 0"),
    (lambda: SamplingParams(top_p=0.0), r"top_p \(0.0\) must be in \(0, 1\]"),
    (lambda: SamplingParams(top_p=1.5), r"top_p \(1.5\) must be in \(0, 1\]"),
    (lambda: KVConfig(tokens_per_block=48), r"tokens_per_block \(48\) must be a power of two from 8 to 256"),
    (lambda: KVConfig(tokens_per_block=4), r"tokens_per_block \(4\) must be a power of two"),
    (lambda: KVConfig(tokens_per_block=512), r"tokens_per_block \(512\) must be a power of two"),
    (lambda: ParallelConfig(tp_size=2, moe_tp_size=3), r"moe_tp_size \(3\) must divide tp_size \(2\)"),
    (lambda: ParallelConfig(tp_size=4, moe_tp_size=2, moe_ep_size=1),
     r"moe_tp_size \(2\) \* moe_ep_size \(1\) must equal tp_size \(4\)"),
])
def test_bad_config_names_the_value_and_rule(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(EngineConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\] is not supported"):
        LLM(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="is neither a built-in model"):
        LLM(EngineConfig(model="no-such-model"))
