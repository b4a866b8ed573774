"""Incremental detokenization: deltas concatenate to the one-shot decode, never show half a character."""

from __future__ import annotations

import pytest

from gguf_vocab import SMOLLM2_GGUF, write_llama_gguf
from specray.models.detokenize import NUM_CONTEXT_TOKENS, IncrementalDetokenizer
from specray.models.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = [
    "Crème brûlée, déjà vu, naïve Ångström.",
    "中文分词测试，日本語のテキスト。",
    "Emoji: 😀🎉 family 👩‍👩‍👧 flag 🇫🇷!",
    "def f(x):\n\treturn {'a': x  *  2}  # ok\n",
]
BYTES = ByteTokenizer(256, (257,))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(SMOLLM2_GGUF)


def stream(tokenizer, prompt_ids, ids, chunk: int, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    return [detokenizer.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)], detokenizer


def check_every_prefix(tokenizer, ids, prompt_ids=()):
    """For every prefix, fed one token at a time and three at a time (a speculative step): the
    deltas never hold U+FFFD, they add up to the one-shot decode once it ends in a whole
    character, and with ``flush`` always."""
    for end in range(len(ids) + 1):
        expected = tokenizer.decode(ids[:end])
        for chunk in (1, 3):
            deltas, detokenizer = stream(tokenizer, prompt_ids, ids[:end], chunk)
            emitted = "".join(deltas)
            assert "\ufffd" not in emitted
            assert expected.startswith(emitted)
            if not expected.endswith("\ufffd"):
                assert emitted == expected
            assert emitted + detokenizer.flush() == expected == detokenizer.text


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_deltas_add_up_to_one_shot_decode(smollm2, text):
    check_every_prefix(smollm2, smollm2.encode(text))


def test_smollm2_texts_do_split_characters_over_tokens(smollm2):
    """The test texts exercise the hold-back: some of their tokens are part of a character."""
    for text in TEXTS[:3]:
        assert any("\ufffd" in smollm2.decode([i]) for i in smollm2.encode(text)), text


def test_smollm2_with_a_chat_prompt_and_special_tokens(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "Say something nice in French"}])
    output = smollm2.encode("Très bien ! C'est génial 😀") + [smollm2.eos_token_ids[0]]
    check_every_prefix(smollm2, output, prompt_ids=prompt)
    deltas, _ = stream(smollm2, prompt, output, 1, skip_special_tokens=False)
    assert "".join(deltas) == smollm2.decode(output, skip_special_tokens=False)
    assert "".join(deltas).endswith("génial 😀<|im_end|>")


def test_prompt_that_ends_inside_a_character(smollm2):
    ids = smollm2.encode("😀 ok")
    cut = next(i for i in range(1, len(ids)) if smollm2.decode(ids[:i]).endswith("\ufffd"))
    deltas, detokenizer = stream(smollm2, ids[:cut], ids[cut:], 1)
    assert "".join(deltas) + detokenizer.flush() == smollm2.decode(ids[cut:])  # the lone bytes show as U+FFFD


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_deltas_add_up_to_one_shot_decode(text):
    ids = BYTES.encode(text) + [257]
    check_every_prefix(BYTES, ids)
    deltas, _ = stream(BYTES, [], ids, 1)
    assert sum(1 for d in deltas if d) == len(text)  # one delta per whole character, nothing for BOS/EOS


def test_sentencepiece_without_prompt_matches_decode_and_with_prompt_keeps_the_space(tmp_path):
    tokenizer = load_tokenizer(write_llama_gguf(tmp_path / "tiny.gguf", add_bos=True, add_space_prefix=True))
    check_every_prefix(tokenizer, tokenizer.encode("the cat sat on a mat é 😀 中文"))
    prompt, output = tokenizer.encode("the cat"), tokenizer.encode(" sat", add_special_tokens=False)
    deltas, _ = stream(tokenizer, prompt, output, 1)
    assert tokenizer.decode(output) == "sat"  # alone, the first piece's "▁" is the stripped prefix space
    assert "".join(deltas) == " sat"  # after the prompt it is the space between two words


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_bounded_window(smollm2):
    ids = smollm2.encode("".join(TEXTS) * 20)
    counting = CountingTokenizer(smollm2)
    deltas, _ = stream(counting, ids[:50], ids, 3)
    assert "".join(deltas) == smollm2.decode(ids)
    # The window is the previous step's tokens plus the new ones, longer only while a step ends inside
    # a character (a run of emoji bytes, up to ~20 tokens here): it does not grow with the output
    # (about 2,000 tokens here), so the second half of the stream decodes windows no longer than the first.
    half = len(counting.sizes) // 2
    assert len(ids) > 1000 and max(counting.sizes) < 32 and counting.sizes[0] <= NUM_CONTEXT_TOKENS
    assert max(counting.sizes[half:]) <= max(counting.sizes[:half])
    assert sum(counting.sizes) / len(counting.sizes) < 10
