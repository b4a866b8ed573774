"""Text through the engine: text and chat prompts, ``.text`` detokenized as tokens arrive, stop
strings that cross token boundaries (plain and speculative), and every bad text input."""

from __future__ import annotations

import json

import pytest

from checkpoints import make_checkpoint
from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.executor.text import ChatPrompt
from specray.models.presets import resolve_model
from specray.models.tokenizer import load_tokenizer
from test_tokenizer import make_tokenizer_json

KV = KVConfig(tokens_per_block=16, capacity_tokens=2048)
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 48
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")


@pytest.fixture(scope="module")
def smollm2():
    with LLM(EngineConfig(model="smollm2-135m", kv=KV)) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def plain(smollm2):
    return smollm2.generate(PROMPT, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]


def test_text_is_the_decoded_output(smollm2, tokenizer, plain):
    assert plain.text == tokenizer.decode(plain.token_ids)
    assert plain.prompt_token_ids == tokenizer.encode(PROMPT)
    assert "return" in plain.text  # SmolLM2 completes the function: real text
    chat = smollm2.chat([{"role": "user", "content": "Say hello in French."}], SamplingParams(max_tokens=32))[0]
    assert chat.text == tokenizer.decode(chat.token_ids) and "<|im_end|>" not in chat.text
    assert chat.prompt_token_ids == tokenizer.encode_chat([{"role": "user", "content": "Say hello in French."}])
    if chat.finish_reason == "stop":
        assert chat.token_ids[-1] in tokenizer.end_of_turn_ids and chat.stop_reason is None
    raw = smollm2.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8, skip_special_tokens=False))
    assert raw[0].text == tokenizer.decode(raw[0].token_ids, skip_special_tokens=False)


def _stop_across_tokens(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one output token and the start of the next, and how many
    output tokens it takes for the text to contain it."""
    for i in range(4, len(ids) - 1):
        left, right = tokenizer.decode(ids[i:i + 1]), tokenizer.decode(ids[i + 1:i + 2])
        if len(left.strip()) >= 2 and right.strip():
            stop = left[-2:] + right[:2]
            full = tokenizer.decode(ids)
            needed = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
            if full.find(stop) == tokenizer.decode(ids[:needed]).find(stop):
                return stop, needed
    raise AssertionError("no two adjacent tokens with text on both sides")


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_stop_string_across_token_boundaries(smollm2, tokenizer, plain, spec):
    stop, needed = _stop_across_tokens(tokenizer, plain.token_ids)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop=["never in the text", stop])
    if spec is None:
        out = smollm2.generate(PROMPT, params)[0]
    else:  # several tokens per step: the tokens past the stop string are dropped
        config = EngineConfig(model="smollm2-135m", kv=KV,
                              spec=SpecConfig(method="draft_model", draft_model="smollm2-135m", num_draft_tokens=3))
        with LLM(config) as llm:
            out = llm.generate(PROMPT, params)[0]
        assert out.metrics["acceptance_length"] > 1.5
    assert out.text == plain.text[: plain.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == plain.token_ids[:needed]


def test_one_prompt_or_many_text_ids_and_chat(smollm2, tokenizer):
    params = SamplingParams(max_tokens=4)
    ids = tokenizer.encode("Hello")
    single = smollm2.generate("Hello", params)
    assert len(single) == 1
    mixed = smollm2.generate(["Hello", ids, ChatPrompt([{"role": "user", "content": "Hello"}])], params)
    assert mixed[0].token_ids == mixed[1].token_ids == single[0].token_ids
    assert smollm2.generate(ids, params)[0].token_ids == single[0].token_ids  # a flat list of ids is one prompt
    two = smollm2.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hello"}]], params)
    assert two[1].prompt_token_ids == mixed[2].prompt_token_ids


def test_chat_errors_name_the_rule(smollm2):
    with pytest.raises(ValueError, match="must be a non-empty list"):
        smollm2.chat([], SamplingParams())
    with pytest.raises(ValueError, match="request 0: .*role"):
        smollm2.chat([{"content": "no role"}], SamplingParams())
    with LLM(EngineConfig(model="tiny-llama", kv=KV)) as llm:  # byte-level preset: no chat template
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}])
        assert llm.generate("hi", SamplingParams(max_tokens=2))[0].prompt_token_ids == [256, *b"hi"]


def test_role_the_template_rejects(tmp_path):
    directory = make_checkpoint("llama", tmp_path / "ckpt")
    make_tokenizer_json(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": ALTERNATING}))
    with LLM(EngineConfig(model=str(directory), kv=KV)) as llm:
        out = llm.chat([{"role": "user", "content": "the drafts"}], SamplingParams(max_tokens=3))[0]
        assert out.prompt_token_ids == llm.generate("user: the drafts\n", SamplingParams(max_tokens=1))[0] \
            .prompt_token_ids[1:]  # the template's text, no BOS added (transformers' rule)
        with pytest.raises(ValueError, match="request 0: .*roles must alternate"):
            llm.chat([{"role": "assistant", "content": "first"}])
        assert llm.generate("the drafts", SamplingParams(max_tokens=2))[0].finish_reason == "length"  # still serves


def test_text_needs_a_tokenizer(tmp_path):
    directory = make_checkpoint("llama", tmp_path / "bare")  # no tokenizer.json
    with LLM(EngineConfig(model=str(directory), kv=KV)) as llm:
        with pytest.raises(ValueError, match="request 1: a text prompt needs a tokenizer.*pass token ids"):
            llm.generate([[1, 2], "text"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="request 0: a chat conversation needs a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(ValueError, match=r"request 0: stop strings \['x'\] need a tokenizer"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop="x"))
        out = llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0]
        assert out.text == "" and len(out.token_ids) == 2  # ids in, ids out
    with pytest.raises(ValueError, match="must be a string or a list of non-empty strings"):
        SamplingParams(stop=["ok", ""])
