"""Structured output (xgrammar): the per-rank matcher rules on a byte vocabulary (masks at every
verify position, forbidden drafts dropped, rollback past rejected drafts, one compilation per
spec, uncompilable specs named), and SmolLM2 answering ten JSON schemas: every answer parses and
validates (``jsonschema``), and n-gram speculation gives the same tokens as plain decoding, with
drafts rejected on the way; without the rollback the run fails (the mutation check)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from json_schemas import SCHEMAS

from specray import LLM, EngineConfig, KVConfig, RankFailure, SamplingParams, SpecConfig, StructuredOutput
from specray.errors import GrammarError
from specray.executor.text import ChatPrompt
from specray.models.tokenizer import ByteTokenizer
from specray.workers.grammar import Grammars

VOCAB, EOS = 320, 257
DIGITS = StructuredOutput("regex", "[0-9]{2}x")


@pytest.fixture
def grammars():
    return Grammars(lambda: ByteTokenizer(256, (EOS,)), VOCAB, (EOS,))


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > float("-inf")).flatten().tolist())


def test_masks_follow_the_drafts_and_a_forbidden_draft_ends_them(grammars):
    grammars.add(0, DIGITS)
    digits = {ord(c) for c in "0123456789"}
    masked, num_allowed = grammars.mask_verify_rows(0, torch.zeros(4, VOCAB), [ord("1"), ord("y"), ord("2")])
    assert num_allowed == 1  # "y" is not a digit: it and every draft after it are dropped
    assert allowed(masked[0]) == digits and allowed(masked[1]) == digits
    grammars.settle(0, [ord("1"), ord("7")])  # the draft kept, then a bonus
    masked, num_allowed = grammars.mask_verify_rows(0, torch.zeros(2, VOCAB), [ord("x")])
    assert num_allowed == 1 and allowed(masked[0]) == {ord("x")} and allowed(masked[1]) == {EOS}


def test_rejected_drafts_are_rolled_back(grammars):
    grammars.add(0, DIGITS)
    _, num_allowed = grammars.mask_verify_rows(0, torch.zeros(3, VOCAB), [ord("1"), ord("2")])
    assert num_allowed == 2
    grammars.settle(0, [ord("5")])  # verification rejected both drafts and drew "5"
    masked = grammars.masked([0], torch.zeros(1, VOCAB))
    assert allowed(masked[0]) == {ord(c) for c in "0123456789"}  # one digit so far: "5"
    grammars.accept(0, ord("3"))
    assert allowed(grammars.masked([0], torch.zeros(1, VOCAB))[0]) == {ord("x")}


def test_unconstrained_rows_are_left_alone_and_logits_are_not_changed_in_place(grammars):
    grammars.add(1, DIGITS)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    masked = grammars.masked([0, 1], logits)
    assert torch.equal(logits, before) and torch.equal(masked[0], before[0])
    assert allowed(masked[1]) == {ord(c) for c in "0123456789"}
    assert grammars.masked([0], logits) is logits  # no constrained row: no copy, no work


def test_each_spec_compiles_once_and_bad_specs_say_why(grammars):
    first = grammars.compile(StructuredOutput("json_schema", '{"type": "object"}'))
    assert grammars.compile(StructuredOutput("json_schema", '{"type": "object"}')) is first
    assert len(grammars.compiled) == 1
    for spec, reason in ((StructuredOutput("json_schema", '{"type": "objectx"}'), "Unsupported type"),
                         (StructuredOutput("regex", "a("), "parenthesis is not closed"),
                         (StructuredOutput("grammar", "root ::= x"), 'Rule "x" is not defined'),
                         (StructuredOutput("json_schema", "{not json"), "json_schema does not compile")):
        with pytest.raises(GrammarError, match=reason):
            grammars.compile(spec)
    with pytest.raises(ValueError, match="ignore_eos cannot go with structured output"):
        SamplingParams(structured=DIGITS, ignore_eos=True)


NGRAM = SpecConfig(method="ngram", num_draft_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
PROMPTS = [ChatPrompt([{"role": "user", "content": q}]) for q, _ in SCHEMAS]
PARAMS = [SamplingParams(max_tokens=120, structured=StructuredOutput("json_schema", json.dumps(s)))
          for _, s in SCHEMAS]


def smollm2(spec=None) -> LLM:
    return LLM(EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=16, capacity_tokens=8192), spec=spec))


@pytest.fixture(scope="module")
def plain():
    with smollm2() as llm:
        return llm.generate(PROMPTS, PARAMS)


def test_ten_schemas_are_answered_with_valid_json(plain):
    for out, (_, schema) in zip(plain, SCHEMAS):
        assert out.finish_reason == "stop", out.text  # the grammar ended the text, not max_tokens
        jsonschema.validate(json.loads(out.text), schema)


def test_ngram_speculation_gives_the_same_constrained_tokens(plain):
    with smollm2(NGRAM) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    hist = [sum(o.metrics["acceptance_histogram"][n] for o in outs) for n in range(5)]
    assert sum(hist[:4]) > 0 and sum(hist[1:]) > 0  # drafts were rejected (rolled back) and accepted


def test_without_the_rollback_the_matcher_falls_out_of_step(monkeypatch):
    # the mutation: rejected drafts stay accepted in the matcher; the next bonus token is refused
    monkeypatch.setattr(Grammars, "rollback", staticmethod(lambda matcher, num_tokens: None))
    with smollm2(NGRAM) as llm, pytest.raises(RankFailure, match="matcher is out of step"):
        llm.generate(PROMPTS, PARAMS)


def test_two_ranks_mask_sample_and_score_in_step():
    # TP=2 (mp): every rank masks, samples and (for prompt rows, a vocabulary-parallel LM-head call)
    # scores the same; check_every_step compares the ranks' tokens after every step. Speculation on,
    # so verify rows are masked and rolled back on both ranks. tiny-llama: byte tokenizer, random weights.
    from specray import ParallelConfig

    prompts = ["abcabcabc", "0101010101", "hello hello"]
    params = [SamplingParams(max_tokens=24, structured=StructuredOutput("regex", "(abc|0|1| ){4,30}"), logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(max_tokens=24, structured=StructuredOutput("json_object"), logprobs=0),
              SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)]
    outs = {}
    for tp in (1, 2):
        parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local", check_every_step=True,
                                  timeout_s=60.0)
        config = EngineConfig(model="tiny-llama", parallel=parallel, spec=NGRAM,
                              kv=KVConfig(tokens_per_block=16, capacity_tokens=2048))
        with LLM(config) as llm:
            outs[tp] = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[1]]
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs[2])
    for one, two in zip(outs[1], outs[2]):  # a sharded LM head sums in another order: a few ulp
        torch.testing.assert_close(torch.tensor([e.logprob for e in two.logprobs]),
                                   torch.tensor([e.logprob for e in one.logprobs]), rtol=0, atol=1e-4)
    assert len(outs[2][0].prompt_logprobs) == len(outs[2][0].prompt_token_ids)
    assert re.fullmatch("(abc|0|1| )*", outs[2][0].text)
