"""Speculative decoding on the built-in real model, SmolLM2-135M-Instruct (GGUF): greedy
speculative output equals plain greedy output for every method, n-gram drafting's measured
acceptance on code prompts, the pools each method gets (literals), and bad input.

Prompts: the first three HumanEval problems, chat-formatted (121 to 167 tokens); with up to
48 new tokens every sequence crosses a page boundary at 32 and at 64 (checked). The drafters
(EAGLE-3 with and without a draft vocabulary, DFlash, DSpark) are seeded random weights
written here in their published formats, shaped for SmolLM2 (hidden 576, vocabulary 49152,
9 heads / 3 kv heads of 64); draft_model drafts with SmolLM2's own weights.

The grid is cut to what a 2-core machine runs in a few minutes (each engine start loads the
GGUF file, a few seconds): every method at TP=1 with k=3; k in {1, 3, 7} for ngram and
eagle3 (one-model, autoregressive: each k is a different number of chained draft forwards);
TP=3 for ngram (drafts computed on every rank, never sent), dflash (standalone, own pool) and
eagle3 (one-model, draft vocabulary); pages 32 and 64 spread over the cases. MTP is left out:
SmolLM2 has no MTP weights (its bad-input case belongs to the MTP work).
"""

from __future__ import annotations

import pytest
from drafter_checkpoints import write_dflash, write_dspark, write_eagle3

from benchmarks.prompts import humaneval_chats
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.spec_metrics import aggregate
from specray.models.drafters.ngram import find_ngram_drafts
from specray.models.presets import resolve_model

MODEL = "smollm2-135m"
CHATS = humaneval_chats(3)
PARAMS = SamplingParams(max_tokens=48)
LOOKUP = dict(prompt_lookup_min=2, prompt_lookup_max=4)
DRAFT_VOCAB = 8192  # eagle3 with a draft vocabulary (d2t) over a sixth of SmolLM2's 49152


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root, gguf = tmp_path_factory.mktemp("smollm2-drafters"), resolve_model(MODEL)
    return {"eagle3": write_eagle3(root / "eagle3", gguf, "speculators", DRAFT_VOCAB),
            "eagle3-full": write_eagle3(root / "eagle3-full", gguf),  # SpecForge's layout, no d2t
            "dflash": write_dflash(root / "dflash", gguf),
            "dspark": write_dspark(root / "dspark", gguf, draft_vocab_size=DRAFT_VOCAB, markov_head_type="gated")}


def config(spec: SpecConfig | None = None, page=32, tp=1) -> EngineConfig:
    parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local", check_every_step=tp > 1,
                              timeout_s=120.0)
    return EngineConfig(model=MODEL, kv=KVConfig(tokens_per_block=page, capacity_tokens=4096), parallel=parallel,
                        spec=spec or SpecConfig())


def spec_for(case: str, k: int, drafters) -> SpecConfig:
    if case == "ngram":
        return SpecConfig(method="ngram", num_draft_tokens=k, **LOOKUP)
    if case == "draft_model":
        return SpecConfig(method="draft_model", draft_model=MODEL, num_draft_tokens=k)
    return SpecConfig(method=case.split("-")[0], draft_model=str(drafters[case]), num_draft_tokens=k)


def shape(geometry) -> dict:
    return {name: (g.tokens_per_block, g.num_layers) for name, g in geometry.items()}


@pytest.fixture(scope="module")
def plain():
    """Plain greedy decoding, once: the reference for every case (SmolLM2's plain output is
    the same at pages 16/64 and TP 1/3: test_smollm2.py)."""
    with LLM(config()) as llm:
        outs = llm.chat(CHATS, PARAMS)
        assert shape(llm.geometry) == {"target": (32, 30)}  # no draft pool
    return outs


def test_prompts_cross_pages(plain):
    for out in plain:
        first, last = len(out.prompt_token_ids) - 1, len(out.prompt_token_ids) + len(out.token_ids) - 1
        assert last // 64 > first // 64 and last // 32 > first // 32
        assert len(out.token_ids) == PARAMS.max_tokens  # no early EOS: every case decodes all 48
    assert "def " in plain[0].text  # SmolLM2 answers with code: the drafts are real text


# (case, k, page, tp, pools: name -> (tokens_per_block, num_layers), literal)
CASES = [
    ("draft_model", 3, 32, 1, {"target": (32, 30), "draft": (32, 30)}),  # the target's own 30 layers
    ("eagle3", 3, 32, 1, {"target": (32, 31)}),  # one-model: one extra layer in the target pool
    ("eagle3-full", 3, 64, 1, {"target": (64, 31)}),
    ("dflash", 3, 64, 1, {"target": (64, 30), "draft": (64, 2)}),  # own pool of its 2 layers
    ("dspark", 3, 64, 1, {"target": (64, 30), "draft": (64, 2)}),
    ("ngram", 3, 32, 1, {"target": (32, 30)}),  # no weights, no draft pool
    ("ngram", 1, 64, 1, {"target": (64, 30)}),
    ("ngram", 7, 32, 1, {"target": (32, 30)}),
    ("eagle3", 1, 64, 1, {"target": (64, 31)}),
    ("eagle3", 7, 32, 1, {"target": (32, 31)}),
    ("ngram", 3, 32, 3, {"target": (32, 30)}),
    ("dflash", 3, 64, 3, {"target": (64, 30), "draft": (64, 2)}),
    ("eagle3", 3, 64, 3, {"target": (64, 31)}),
]


@pytest.mark.parametrize("case, k, page, tp, pools", CASES, ids=[f"{c[0]}-k{c[1]}-p{c[2]}-tp{c[3]}" for c in CASES])
def test_greedy_speculative_output_is_plain_output(drafters, plain, case, k, page, tp, pools):
    with LLM(config(spec_for(case, k, drafters), page, tp)) as llm:
        assert shape(llm.geometry) == pools
        outs = llm.chat(CHATS, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    total = aggregate([o.metrics for o in outs])
    assert total["num_verify_steps"] > 0 and total["num_draft_tokens"] <= k * total["num_verify_steps"]
    if case == "draft_model":  # drafting with the target's own weights: nearly every draft is taken
        assert total["acceptance_length"] > 0.9 * (k + 1)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_narrowed_drafter_kernel_gets_a_32_token_pool(drafters, plain, monkeypatch, method):
    monkeypatch.setenv("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", "0:32")  # rank 0's kernels accept 32 only
    with LLM(config(spec_for(method, 3, drafters), page=64)) as llm:
        assert shape(llm.geometry) == {"target": (64, 30), "draft": (32, 2)}
        outs = llm.chat(CHATS[:1], PARAMS)
    assert outs[0].token_ids == plain[0].token_ids


def test_ngram_acceptance_on_code_is_above_one(plain):
    """Measured, nothing forced: SmolLM2 quotes the function signature from its prompt."""
    with LLM(config(SpecConfig(method="ngram", num_draft_tokens=5, **LOOKUP), page=64)) as llm:
        outs = llm.chat(CHATS, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    total = aggregate([o.metrics for o in outs])
    assert total["num_accepted_tokens"] > 0
    assert total["acceptance_length"] > 1.0 and total["tokens_per_decode_step"] > 1.0


def test_ngram_proposes_nothing_without_a_repeated_ngram():
    prompt = list(range(1000, 1040))  # 40 distinct token ids
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(config(SpecConfig(method="ngram", num_draft_tokens=3, **LOOKUP))) as llm:
        out, = llm.generate([prompt], params)
    seen = prompt + out.token_ids[:-1]  # what the drafter looked at before each decode step
    if any(find_ngram_drafts(seen[:n], 2, 4, 3) for n in range(len(prompt) + 1, len(seen) + 1)):
        pytest.fail(f"SmolLM2's output {out.token_ids} repeats a 2-gram: pick another prompt for this test")
    m = out.metrics
    assert (m["num_verify_steps"], m["num_draft_tokens"], m["acceptance_length"]) == (0, 0, 1.0)
    assert m["num_decode_steps"] == 5  # six tokens: the prefill's, then five plain decode steps


def _edited(writer, path, **overrides):
    return SpecConfig(method=writer.__name__.removeprefix("write_"), num_draft_tokens=3,
                      draft_model=str(writer(path, resolve_model(MODEL), **overrides)))


@pytest.mark.parametrize("make, error", [
    (lambda p: _edited(write_eagle3, p, hidden_size=512, target_hidden_size=512),
     "target hidden states of size 512, but the target's hidden_size is 576"),
    (lambda p: _edited(write_dflash, p, hidden_size=512), "hidden_size 512 but the target has 576"),
    (lambda p: _edited(write_eagle3, p, vocab_size=32000, draft_vocab_size=32000),  # no d2t
     "vocab_size 32000 .* but the target has 49152"),
], ids=["eagle3-hidden", "dflash-hidden", "eagle3-vocab"])
def test_drafter_that_does_not_fit_smollm2_is_rejected(tmp_path, make, error):
    with pytest.raises(ValueError, match=error):
        LLM(config(make(tmp_path / "drafter")))


def test_ngram_lookup_bounds_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"):
        config(SpecConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2))
