"""Text <-> token ids for the CLI.

A checkpoint directory that ships a ``tokenizer.json`` is read with the ``tokenizers``
package. The built-in presets have no trained tokenizer: their vocabulary is byte-level
(ids 0..255 are the bytes of the UTF-8 text), with the BOS and EOS ids of the preset's
``config.json``. Anything else has no text interface: pass token ids instead.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_BYTES = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; BOS is prepended as Llama-style tokenizers do."""

    def __init__(self, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self._special = {bos_token_id, *eos_token_ids} - {None}

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids and ids past the bytes carry no text and are skipped.
        Invalid UTF-8 (a model may emit any byte) shows as U+FFFD instead of failing."""
        data = bytes(t for t in ids if 0 <= t < NUM_BYTES and t not in self._special)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` read by the ``tokenizers`` package; its post-processor adds BOS."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def _special_ids(config: dict) -> tuple[int | None, tuple[int, ...]]:
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return config.get("bos_token_id"), eos_ids


def load_tokenizer(checkpoint_dir: str | Path, is_byte_level: bool) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's tokenizer.json when it has one, else the byte-level tokenizer when the
    checkpoint is a built-in preset (``is_byte_level``); otherwise a ValueError."""
    directory = Path(checkpoint_dir)
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory / "tokenizer.json")
    if is_byte_level:
        config = json.loads((directory / "config.json").read_text())
        return ByteTokenizer(*_special_ids(config))
    raise ValueError(f"checkpoint directory {str(directory)!r} has no tokenizer.json, so text prompts cannot be "
                     f"encoded; pass token ids with --prompt-ids")
