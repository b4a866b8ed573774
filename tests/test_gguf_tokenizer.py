"""Tokenizers rebuilt from GGUF metadata give transformers' ids for the same file.

transformers' tokenizer is loaded once per vocabulary (about 6 s for SmolLM2's): module fixtures.
"""

from __future__ import annotations

import re

import pytest

from gguf_vocab import PIECES, SMOLLM2_GGUF, llama_vocab, write_gguf, write_llama_gguf
from specray.models.gguf_tokenizer import merges_from_scores
from specray.models.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's 12345 or 3.14159, don't you think? 2026-12-03",
    "def f(x):\n\treturn x  *  2\n\n\n    if  x:\n\t\tpass   \n",
    "  leading and trailing spaces   ",
    "Café, naïve, façade, Ångström, São Paulo, Straße",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷 🏳️‍🌈",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>a/b<file_sep>x.py",
    "",
    "\n",
    "x" * 40 + " " * 17 + "y",
]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)
    return load_tokenizer(SMOLLM2_GGUF), reference


def digits_first(reference, text: str) -> list[int]:
    """transformers' ids for ``text`` cut as llama.cpp's "smollm" pre-tokenizer cuts it: every digit
    alone first, then each piece through transformers' tokenizer."""
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.Digits(individual_digits=True).pre_tokenize_str(text)
    return [i for piece, _ in pieces for i in reference(piece, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_and_text_match_transformers(smollm2, text):
    ours, reference = smollm2
    ids = ours.encode(text)
    assert ids == ours.encode(text, add_special_tokens=False)  # the file says add_bos_token = false
    assert ids == digits_first(reference, text)
    if not re.search(r"\s\d", text):  # where the digit split cannot matter, the whole text matches too
        assert ids == reference(text)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_smollm2_splits_digits_first_as_llama_cpp_does(smollm2):
    """The one place we differ from transformers 5.24 on purpose: blanks before a digit. SmolLM's
    tokenizer (and llama.cpp's "smollm") isolate digits before the GPT-2 regex, so the blanks stay
    one word; transformers applies the GPT-2 regex alone and gives the last blank to the digit."""
    ours, reference = smollm2
    assert [ours.id_to_token(i) for i in ours.encode("x  2")] == ["x", "ĠĠ", "2"]
    assert [ours.id_to_token(i) for i in reference("x  2")["input_ids"]] == ["x", "Ġ", "Ġ", "2"]
    assert [ours.id_to_token(i) for i in ours.encode("x \n2")] == ["x", "ĠĊ", "2"]


def test_smollm2_special_tokens_stay_whole_and_metadata_matches(smollm2):
    ours, reference = smollm2
    assert isinstance(ours, Tokenizer)
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1 and ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, 4093, 198, 6004, 2]) == "user\nhi"  # specials skipped by default
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert ours.end_of_turn_ids == (2,)  # <|im_end|> is SmolLM2's EOS already
    assert ours.special_ids == set(reference.all_special_ids) | set(range(17))  # the 17 control tokens
    assert ours.vocab_size == len(reference) == 49152
    assert ours.chat_template == reference.chat_template
    assert ours.id_to_token(1) == "<|im_start|>" and ours.id_to_token(216) == "Ġ"


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no-bos"])
def tiny_llama(tmp_path_factory, request):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny_llama")
    path = write_llama_gguf(directory / "tiny.gguf", add_bos=request.param, add_space_prefix=True)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(str(directory), gguf_file=path.name)


LLAMA_TEXTS = ["the cat sat on a mat", "", " ", "  the  cat", "hello héllo 中文 😀", "<s>the</s> <unk> <tool>x",
               "\tcat\n\nmat", "xyz"]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_sentencepiece_gguf_ids_and_text_match_transformers(tiny_llama, text):
    ours, reference = tiny_llama
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference(text, add_special_tokens=add_special_tokens)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_gguf_hand_checked_pieces(tmp_path):
    ours = load_tokenizer(write_llama_gguf(tmp_path / "tiny.gguf"))  # no add_bos_token: llama adds BOS
    tokens, _, _ = llama_vocab()
    ids = {token: index for index, token in enumerate(tokens)}
    # BOS, then the space prefix joins the first word: "▁the" "▁cat" are whole pieces.
    assert ours.encode("the cat") == [1, ids["▁the"], ids["▁cat"]]
    # "😀" is not in the vocabulary: its four UTF-8 bytes fall back to <0xF0> <0x9F> <0x98> <0x80>.
    assert ours.encode("😀", add_special_tokens=False) == [ids["▁"], *(3 + b for b in "😀".encode())]
    # A user-defined token is matched whole before the space prefix is added: no "▁" in front.
    assert ours.encode("<tool>", add_special_tokens=False) == [ids["<tool>"]]
    assert ours.decode([1, ids["▁the"], ids["▁"], *(3 + b for b in "é".encode()), 2]) == "the é"
    assert ours.special_ids == {0, 1, 2} and ours.eos_token_ids == (2,) and ours.chat_template is None


def test_merges_from_scores_rank_by_the_merged_token_score():
    merges = merges_from_scores(["a", "b", "c", "ab", "abc", "bc"], [0.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    # "ab" scores best, then "abc" (cut as ab+c before a+bc: longer left part first), then "bc".
    assert merges == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]
    assert len(merges_from_scores(list(PIECES), list(PIECES.values()))) > 0


def test_an_open_gguf_reader_gives_the_same_tokenizer(smollm2):
    from gguf import GGUFReader

    from specray.models.tokenizer import tokenizer_from_gguf

    ours, _ = smollm2
    shared = tokenizer_from_gguf(GGUFReader(str(SMOLLM2_GGUF)), "smollm2")
    assert shared.encode(TEXTS[1]) == ours.encode(TEXTS[1]) and shared.chat_template == ours.chat_template


def test_unknown_tokenizer_model_is_rejected_by_name(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", model="bert", tokens=["[PAD]", "[UNK]", "[CLS]"], types=[3, 2, 3])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model is 'bert'; supported tokenizer models: gpt2, llama"):
        load_tokenizer(path)


def test_unknown_pre_tokenizer_is_rejected_by_name(tmp_path):
    path = write_gguf(tmp_path / "pre.gguf", model="gpt2", tokens=["a", "b", "ab"], types=[1, 1, 1], merges=["a b"],
                      pre="made-up-pre")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre is 'made-up-pre'.*supported: .*llama-bpe.*qwen2.*smollm"):
        load_tokenizer(path)


def test_gguf_without_tokenizer_metadata_asks_for_token_ids(tmp_path):
    path = write_gguf(tmp_path / "weights-only.gguf", model=None)
    with pytest.raises(ValueError, match=r"weights-only.gguf'? has no tokenizer.*token-id prompts"):
        load_tokenizer(path)


@pytest.mark.parametrize("pre, words", [
    ("default", ["I", "'m", "Ġ12345", "Ġabc", "ĠĠ", "Ġx"]),
    ("smollm", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġabc", "ĠĠ", "Ġx"]),  # every digit alone
    ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "Ġabc", "ĠĠ", "Ġx"]),  # digits by threes
    ("qwen2", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġabc", "ĠĠ", "Ġx"]),
])
def test_gpt2_pre_tokenizers_cut_words_as_their_model_does(pre, words):
    from specray.models.gguf_tokenizer import PRE_TOKENIZERS

    assert [word for word, _ in PRE_TOKENIZERS[pre]().pre_tokenize_str("I'm 12345 abc   x")] == words
