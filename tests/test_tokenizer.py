"""Tokenizers of the CLI: byte-level for the presets, tokenizer.json for checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specray.models.presets import PRESETS
from specray.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TINY = PRESETS["tiny-llama"]
BYTES = ByteTokenizer(TINY["bos_token_id"], (TINY["eos_token_id"],))


def make_tokenizer_json(directory: Path) -> Path:
    """A byte-level BPE tokenizer trained offline on a few sentences, with BOS added by its
    post-processor, saved as tokenizer.json (ids stay below 300: fits a vocab-384 checkpoint)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["speculative decoding drafts tokens", "the target model verifies the drafts",
              "paged attention over a KV pool"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


@given(st.text(max_size=64))
def test_byte_tokenizer_round_trips_any_text(text):
    ids = BYTES.encode(text)
    assert ids[0] == TINY["bos_token_id"]
    assert ids[1:] == list(text.encode("utf-8"))
    assert BYTES.decode(ids) == text


def test_byte_tokenizer_skips_special_and_non_byte_ids():
    ids = [TINY["bos_token_id"], *b"hi", TINY["eos_token_id"], 300]
    assert BYTES.decode(ids) == "hi"
    assert BYTES.decode([0xFF, *b"ok"]) == "\ufffdok"  # a lone invalid byte does not raise


def test_preset_checkpoint_gets_the_byte_tokenizer_with_its_special_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(bos_token_id=256, eos_token_id=[257, 258])))
    tokenizer = load_tokenizer(tmp_path, is_byte_level=True)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.encode("a") == [256, 97]
    assert tokenizer.decode([97, 257, 98, 258]) == "ab"


def test_tokenizer_json_is_loaded_and_round_trips(tmp_path):
    make_tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(tmp_path, is_byte_level=True)  # tokenizer.json wins over bytes
    assert isinstance(tokenizer, Tokenizer)
    text = "the drafts verify speculative tokens"
    ids = tokenizer.encode(text)
    assert ids[0] == 0  # "<s>" from the post-processor
    assert len(ids) < len(text.encode())  # merges learned from the corpus are used
    assert tokenizer.decode(ids) == text


def test_checkpoint_without_tokenizer_json_asks_for_ids(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer.*token-id prompts"):
        load_tokenizer(tmp_path, is_byte_level=False)


TURNS = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_tokenizer_config_gives_template_and_special_tokens_as_transformers(tmp_path, add_bos_token):
    from transformers import AutoTokenizer

    make_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<s>", eos_token={"__type": "AddedToken", "content": "</s>", "special": True},
        add_bos_token=add_bos_token,
        chat_template=TURNS)))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=[1, 7])))
    ours, reference = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "the target verifies </s> the drafts"
    assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.encode(text)[0] == 0  # tokenizer.json's post-processor adds BOS whatever the flag says
    assert ours.decode(ours.encode(text)) == reference.decode(reference(text)["input_ids"], skip_special_tokens=True)
    messages = [{"role": "user", "content": "verify the drafts"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1, 7) and ours.end_of_turn_ids == (1, 7)
    assert ours.special_ids == {0, 1, 7}


def test_chat_template_jinja_file_is_read(tmp_path):
    make_tokenizer_json(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TURNS)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi</s>assistant:"
    assert tokenizer.eos_token_ids == () and tokenizer.end_of_turn_ids == (1,)  # </s> closes a turn
