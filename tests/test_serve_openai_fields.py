"""The OpenAI fields clients depend on, through the real ``openai`` client against `specray serve`:
completions ``logprobs`` (streamed and not) and ``echo`` with ``max_tokens`` 0 on tiny-llama, chat
``logprobs``/``top_logprobs`` (streamed and not) on SmolLM2 served with n-gram speculation, every
value equal to transformers' log_softmax of the same checkpoint at the same position; every field
of the unsupported list is a 400 naming it and the server stays healthy; structured output
(``response_format``, ``structured_outputs``) on the same speculative server, a 400 saying why for
a spec that does not compile.

Tolerances: tiny-llama 1e-4 (float32 both sides, a few ulp per fused op: test_logprobs.py);
SmolLM2 1e-3 (30 layers of the same rounding differences, test_smollm2.py's bound on its logits).
The expected tokens are transformers' greedy ones: specray's greedy output equals them exactly
(test_hf_parity.py, test_smollm2.py), and under speculation equals plain greedy decoding."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch
from json_schemas import SCHEMAS
from serve_server import start_server, stop_server
from test_serve_app import CHANGING

from specray.models.presets import resolve_model

KV = ["--tokens-per-block", "16", "--kv-capacity-tokens", "2048"]
PROMPT, MAX_TOKENS = "The quick brown fox", 12
# the answer copies the question: n-gram drafts are accepted (16 of 16 drafts in 4 verify steps)
QUESTION = ("Copy this text exactly, word for word: The cat sat on the mat. The dog sat on the log. "
            "The bird sat on the branch.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve_lp") / "server.log", "--model", "tiny-llama", *KV,
                     "--served-model-name", "tiny")
    yield s
    assert stop_server(s) == 0, s.log_tail()


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def tiny_reference():
    """transformers' tiny-llama, the prompt's ids (the byte tokenizer: BOS + UTF-8), its greedy
    continuation and the log-probabilities at every position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama", 0),
                                                              dtype=torch.float32).eval()
    prompt = [256] + list(PROMPT.encode())
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                         min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    return prompt, out[len(prompt):], log_softmax(model, out)


TOL_WARM = 1e-5  # the same model on the same tokens, warm (a prefix-cache hit) against cold: a few ulp


def close(ours: list[float], theirs, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float32), torch.as_tensor(theirs).float(),
                               rtol=0, atol=atol)


def test_completion_logprobs_equal_transformers_streamed_and_not(tiny, tiny_reference):
    prompt, expected, lp = tiny_reference
    args = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    whole = tiny.client().completions.create(**args).choices[0].logprobs
    chunks = list(tiny.client().completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    rows = lp[len(prompt) - 1:-1]
    close(whole.token_logprobs, rows[torch.arange(MAX_TOKENS), torch.tensor(expected)], 1e-4)
    assert whole.tokens == [bytes([t]).decode("utf-8", "replace") for t in expected]
    for top, row in zip(whole.top_logprobs, rows):
        values = row.topk(3)
        assert len(top) == 3
        close(sorted(top.values(), reverse=True), values.values, 1e-4)
    # The streamed request repeats the prompt, so it starts from a prefix-cache hit: its first step
    # computes fewer rows (other matmul blocking), a few ulp off the cold request's values.
    close(sum((s.token_logprobs for s in streamed), []), whole.token_logprobs, TOL_WARM)
    assert sum((s.text_offset for s in streamed), []) == whole.text_offset
    assert whole.text_offset == sorted(whole.text_offset) and whole.text_offset[0] == 0


def test_echo_with_max_tokens_0_gives_the_prompt_logprobs(tiny, tiny_reference):
    # lm-eval's log-likelihood request: the prompt echoed, no token generated
    prompt, _, lp = tiny_reference
    got = tiny.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = got.choices[0]
    assert choice.text == PROMPT and got.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(prompt)
    close(choice.logprobs.token_logprobs[1:], lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], 1e-4)
    streamed = list(tiny.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True,
                                                     logprobs=0, stream=True, temperature=0))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    first = next(c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs)
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(prompt)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_unsupported_field_is_a_400_through_the_client(tiny, route):
    client = tiny.client()
    for name, value in CHANGING.items():
        with pytest.raises(openai.BadRequestError) as err:
            if route == "completions":
                client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={name: value})
            else:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body={name: value})
        assert err.value.status_code == 400 and err.value.body["param"] == name, (name, err.value.body)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert tiny.health() == 200
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=2, user="u",
                                   extra_body={"store": True, "metadata": {"k": "v"}})
    assert ok.usage.completion_tokens == 2


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve_lp_smol") / "server.log", "--model", "smollm2-135m", *KV,
                     "--spec", "ngram", "--num-draft-tokens", "4", "--prompt-lookup-min", "2",
                     "--prompt-lookup-max", "3")
    yield s
    assert stop_server(s) == 0, s.log_tail()


@pytest.fixture(scope="module")
def smol_reference():
    """transformers on the same GGUF: the chat prompt, its greedy answer, the log-probabilities."""
    import transformers

    path = resolve_model("smollm2-135m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)[0].tolist()
    return tokenizer, prompt, out[len(prompt):], log_softmax(model, out)


def test_chat_logprobs_under_ngram_speculation_equal_transformers(smol, smol_reference):
    tokenizer, prompt, answer, lp = smol_reference
    args = dict(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], max_tokens=40,
                temperature=0, logprobs=True, top_logprobs=2)
    whole = smol.client().chat.completions.create(**args).choices[0]
    chunks = list(smol.client().chat.completions.create(**args, stream=True))
    content = whole.logprobs.content
    ended = answer[-1] in tokenizer.all_special_ids  # <|im_end|> ends the answer; its text is not content
    expected = answer[:-1] if ended and len(content) == len(answer) - 1 else answer
    assert len(content) in (len(answer), len(answer) - 1) and len(expected) >= 16
    assert [c.token for c in content][:len(expected)] == [tokenizer.decode([t]) for t in expected]
    rows = lp[len(prompt) - 1:len(prompt) - 1 + len(content)]
    close([c.logprob for c in content], rows[torch.arange(len(content)), torch.tensor(answer[:len(content)])], 1e-3)
    for c, row in zip(content, rows):
        assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
        close([t.logprob for t in c.top_logprobs], row.topk(2).values, 1e-3)
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    close([e.logprob for e in streamed], [e.logprob for e in content], TOL_WARM)  # a prefix hit, as above
    m = smol.metrics()
    assert m[("specray:spec_decode_num_accepted_tokens_total", ())] >= 16  # most tokens came from verify rows


def test_response_format_json_on_chat_and_completions(smol):
    client = smol.client()
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=120, temperature=0,
                                          messages=[{"role": "user", "content": "Give the name of a cat as JSON."}],
                                          response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    question, schema = SCHEMAS[4]  # nested objects with bounded integers
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=120, temperature=0,
                                          messages=[{"role": "user", "content": question}], response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    stream = client.chat.completions.create(model="smollm2-135m", max_tokens=120, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": question}], response_format=fmt)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    done = client.completions.create(model="smollm2-135m", prompt="A person as JSON:", max_tokens=80, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "p", "schema": SCHEMAS[0][1]}}})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS[0][1])


def test_structured_outputs_choice_regex_and_grammar(smol):
    client = smol.client()

    def ask(constraint: dict, question: str = "Is the sky blue?") -> str:
        return client.chat.completions.create(model="smollm2-135m", max_tokens=20, temperature=0,
                                              messages=[{"role": "user", "content": question}],
                                              extra_body={"structured_outputs": constraint}).choices[0].message.content

    assert ask({"choice": ["yes", "no"]}) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", ask({"regex": r"[0-9]{3}-[0-9]{4}"}, "Give a phone number."))
    assert ask({"grammar": 'root ::= "colour: " ("red" | "blue")'}) in ("colour: red", "colour: blue")


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "Unsupported type"),
    ({"structured_outputs": {"regex": "a("}}, "parenthesis is not closed"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "is not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"response_format": {"type": "xml"}}, "must be 'text'"),
])
def test_an_uncompilable_spec_is_a_400_that_says_why(smol, body, reason):
    with pytest.raises(openai.BadRequestError, match=reason):
        smol.client().chat.completions.create(model="smollm2-135m", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}], extra_body=body)
    assert smol.health() == 200
