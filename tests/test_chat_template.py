"""Chat templates render as transformers renders them; bad conversations fail with the reason.

transformers' tokenizers are loaded once per module (SmolLM2's takes about 6 s).
"""

from __future__ import annotations

import pytest

from gguf_vocab import SMOLLM2_GGUF, write_gguf, write_llama_gguf
from specray.models.gguf_tokenizer import byte_alphabet
from specray.models.tokenizer import ByteTokenizer, load_tokenizer

# Llama-2/Mistral style: strictly alternating user/assistant turns, anything else rejected.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Llama-3 style: its turns end in <|eot_id|>, which is not the EOS token.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Block tags on their own lines (trim_blocks / lstrip_blocks matter), tojson, strftime_now, loop
# controls, a caller's kwarg.
FEATURES = """year digits: {{ strftime_now('%Y') | length }}
{% for message in messages %}
    {% if loop.index0 > 2 %}{% break %}{% endif %}
    {% if message['role'] == 'system' %}
SYSTEM: {{ message | tojson }}
    {% else %}
{{ message['role'] | upper }}: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ greeting }}{% endif %}"""

SINGLE = [{"role": "user", "content": "What is the capital of France?"}]
MULTI = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
         {"role": "user", "content": "Tell me a joke about 中文 and émojis 😀."}]
SYSTEM = [{"role": "system", "content": "You answer in one word."}, *SINGLE]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)
    return load_tokenizer(SMOLLM2_GGUF), reference


@pytest.fixture(scope="module")
def alternating(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("alternating")
    path = write_llama_gguf(directory / "tiny.gguf", add_bos=True, add_space_prefix=True, chat_template=ALTERNATING)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(str(directory), gguf_file=path.name)


@pytest.mark.parametrize("messages", [SINGLE, MULTI, SYSTEM], ids=["single", "multi", "system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_renders_and_encodes_as_transformers(smollm2, messages, add_generation_prompt):
    ours, reference = smollm2
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    # No digit follows a blank in these chats, so transformers' GGUF tokenizer gives the same ids.
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == len(messages) + (1 if messages[0]["role"] != "system" else 0) + (
        1 if add_generation_prompt else 0)  # one <|im_start|> per turn, the default system turn included


def test_alternating_template_renders_as_transformers(alternating):
    ours, reference = alternating
    for messages in (SINGLE, MULTI):
        text = ours.apply_chat_template(messages)
        assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<s>[INST] ")
    assert ours.end_of_turn_ids == (2,)  # an assistant turn ends in </s>, the EOS already


@pytest.mark.parametrize("messages, message", [
    (SYSTEM, "Conversation roles must alternate"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "Conversation roles must alternate"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "Only user and assistant roles"),
])
def test_a_role_the_template_rejects_is_a_value_error_with_its_message(alternating, messages, message):
    import jinja2

    ours, reference = alternating
    with pytest.raises(ValueError, match=rf"chat template of tiny.gguf rejects this conversation: {message}"):
        ours.apply_chat_template(messages)
    with pytest.raises(jinja2.exceptions.TemplateError, match=message):  # transformers fails the same way
        reference.apply_chat_template(messages, tokenize=False)


def test_template_features_render_as_transformers(alternating, tmp_path):
    _, reference = alternating
    ours = load_tokenizer(write_llama_gguf(tmp_path / "features.gguf", chat_template=FEATURES))
    messages = [{"role": "system", "content": "Say <b>&'\"</b> in 中文"}, *MULTI]
    text = ours.apply_chat_template(messages, greeting="ASSISTANT:")
    assert text == reference.apply_chat_template(messages, chat_template=FEATURES, add_generation_prompt=True,
                                                 tokenize=False, greeting="ASSISTANT:")
    assert '"content": "Say <b>&\'\\"</b> in 中文"' in text  # tojson keeps <, & and non-ASCII as they are
    assert text.startswith("year digits: 4\n") and text.endswith("ASSISTANT:")


def test_a_template_that_does_not_parse_fails_when_used(tmp_path):
    broken = load_tokenizer(write_llama_gguf(tmp_path / "broken.gguf", chat_template="{% for m in messages %}"))
    assert broken.end_of_turn_ids == (2,)  # loading works: the probe's error only means no extra token
    with pytest.raises(ValueError, match=r"the chat template does not parse \(line 1\)"):
        broken.apply_chat_template(SINGLE)


def test_end_of_turn_is_the_special_token_that_closes_an_assistant_turn(tmp_path):
    specials = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    path = write_gguf(tmp_path / "llama3.gguf", model="gpt2", pre="llama-bpe", merges=[], chat_template=LLAMA3,
                      tokens=[*specials, *byte_alphabet().values()], types=[3] * len(specials) + [1] * 256)
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.end_of_turn_ids == (2, 5)  # <|end_of_text|>, then <|eot_id|> from the template
    ids = tokenizer.encode_chat(SINGLE)
    assert ids[:2] == [1, 3] and ids.count(5) == 1  # BOS and header from the template; one closed turn


def test_no_template_and_bad_conversations_are_value_errors(smollm2, tmp_path):
    ours, _ = smollm2
    with pytest.raises(ValueError, match="model this preset has no chat template; pass a prompt"):
        ByteTokenizer(256, (257,)).apply_chat_template(SINGLE)
    plain = load_tokenizer(write_llama_gguf(tmp_path / "plain.gguf"))
    with pytest.raises(ValueError, match="model plain.gguf has no chat template; pass a prompt"):
        plain.encode_chat(SINGLE)
    with pytest.raises(ValueError, match="messages is empty"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="message 1 is a str, not a dict"):
        ours.apply_chat_template([SINGLE[0], "hello"])
    with pytest.raises(ValueError, match="message 0 has no 'content' key"):
        ours.apply_chat_template([{"role": "user", "text": "hi"}])
    with pytest.raises(ValueError, match="message 2 has a 'role' of type int; it must be a str"):
        ours.apply_chat_template([*MULTI[:2], {"role": 3, "content": "x"}])
    with pytest.raises(ValueError, match="messages must be a list"):
        ours.apply_chat_template("hello")
