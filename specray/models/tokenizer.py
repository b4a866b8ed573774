"""Text <-> token ids, and conversations -> prompts.

``load_tokenizer`` finds a checkpoint's tokenizer: a directory's ``tokenizer.json`` (with
``tokenizer_config.json`` or ``chat_template.jinja`` for the chat template, and the BOS/EOS tokens
of ``tokenizer_config.json``, ``generation_config.json`` and ``config.json``), or the
``tokenizer.ggml.*`` metadata of a ``.gguf`` file (``gguf_tokenizer``). Either becomes one
``Tokenizer`` over a ``tokenizers.Tokenizer``. The built-in presets have no trained tokenizer:
their vocabulary is byte-level (ids 0..255 are the bytes of the UTF-8 text), with the BOS and EOS
ids of the preset's ``config.json`` (``ByteTokenizer``, same interface). Anything else has no
text interface: pass token ids instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from specray.models.chat_template import compile_chat_template, render_chat

NUM_BYTES = 256


class _ChatMixin:
    """Conversations -> prompt text or ids, through the tokenizer's chat template. A subclass sets
    ``name``, ``chat_template``, ``bos_token``, ``eos_token`` and has ``encode``."""

    _compiled = (None, None)  # (template text, compiled template): compiled once, again if the text changes

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation rendered by the model's template, as transformers renders it."""
        if self._compiled[0] != self.chat_template:
            compiled = None if self.chat_template is None else compile_chat_template(self.chat_template)
            self._compiled = (self.chat_template, compiled)
        return render_chat(self._compiled[1], messages, model_name=self.name,
                           add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The rendered conversation's ids; the template wrote every special token it wants, so
        none is added (as transformers' ``apply_chat_template(tokenize=True)``)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class ByteTokenizer(_ChatMixin):
    """UTF-8 bytes as token ids; BOS is prepended as Llama-style tokenizers do. Special ids carry
    no text, so ``decode`` drops them whatever ``skip_special_tokens`` says."""

    chat_template = None
    bos_token = eos_token = None

    def __init__(self, bos_token_id: int | None, eos_token_ids: tuple[int, ...], name: str = "this preset"):
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.end_of_turn_ids = self.eos_token_ids
        self.special_ids = frozenset({bos_token_id, *eos_token_ids} - {None})
        self.vocab_size = max([NUM_BYTES - 1, *self.special_ids]) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text; special ids and ids past the bytes carry no text and are skipped.
        Invalid UTF-8 (a model may emit any byte) shows as U+FFFD instead of failing."""
        data = bytes(t for t in ids if 0 <= t < NUM_BYTES and t not in self.special_ids)
        return data.decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self.special_ids:
            return "<bos>" if token_id == self.bos_token_id else "<eos>"
        return f"<0x{token_id:02X}>" if 0 <= token_id < NUM_BYTES else None


class Tokenizer(_ChatMixin):
    """A ``tokenizers.Tokenizer`` with the ids and the chat template that go with it."""

    def __init__(self, backend, *, name: str, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None):
        self._backend = backend
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset({i for i, token in added.items() if token.special} | set(self.eos_token_ids)
                                     | ({bos_token_id} - {None}))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        self.end_of_turn_ids = self.eos_token_ids + tuple(
            i for i in self._turn_closers() if i not in self.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _turn_closers(self) -> tuple[int, ...]:
        """The end-of-turn rule: render a two-turn conversation whose assistant reply is a marker,
        without a generation prompt; the special token written right after the marker (blanks
        between allowed) is the one that closes an assistant turn. ChatML gives ``<|im_end|>``,
        Llama-3 ``<|eot_id|>``, Gemma ``<end_of_turn>``. No template, or one that will not render
        the probe, gives none."""
        if self.chat_template is None:
            return ()
        marker = "\x00specray-reply\x00"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": marker}], add_generation_prompt=False)
        except ValueError:
            return ()
        after = text[text.find(marker) + len(marker):].lstrip() if marker in text else ""
        specials = sorted(((self.id_to_token(i), i) for i in self.special_ids), key=lambda s: -len(s[0] or ""))
        return next(((i,) for token, i in specials if token and after.startswith(token)), ())


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _eos_ids(*configs: dict) -> list[int]:
    ids = []
    for config in configs:
        eos = config.get("eos_token_id")
        ids += [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    return ids


def _chat_template_of(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is for chat
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    return template


def _from_tokenizer_json(directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    config = _read_json(directory / "tokenizer_config.json")
    model_config = _read_json(directory / "config.json")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos else model_config.get("bos_token_id")
    eos_id = backend.token_to_id(eos) if eos else None
    eos_ids = ([] if eos_id is None else [eos_id]) + _eos_ids(_read_json(directory / "generation_config.json"),
                                                              model_config)
    # tokenizer.json's post-processor alone decides whether BOS/EOS are added, as in transformers 5:
    # tokenizer_config.json's add_bos_token/add_eos_token do not change it.
    return Tokenizer(backend, name=directory.name, bos_token_id=bos_id, eos_token_ids=tuple(eos_ids),
                     chat_template=_chat_template_of(directory, config))


def tokenizer_from_gguf(source, name: str) -> Tokenizer | None:
    """The tokenizer a GGUF file describes (``source``: its path or an open ``gguf.GGUFReader``),
    or None when it has no tokenizer metadata."""
    from specray.models.gguf_tokenizer import build_backend, read_gguf_vocab

    vocab = read_gguf_vocab(source)
    if vocab is None:
        return None
    eos_ids = () if vocab.eos_token_id is None else (vocab.eos_token_id,)
    return Tokenizer(build_backend(vocab), name=name, bos_token_id=vocab.bos_token_id, eos_token_ids=eos_ids,
                     chat_template=vocab.chat_template)


def load_tokenizer(path: str | Path, *, is_byte_level: bool = False) -> Tokenizer | ByteTokenizer:
    """The tokenizer of a checkpoint directory (its tokenizer.json; else, for a built-in preset
    (``is_byte_level``), the byte-level tokenizer) or of a ``.gguf`` file; a ValueError when there
    is none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = tokenizer_from_gguf(path, path.name)
        if tokenizer is not None:
            return tokenizer
    elif (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path)
    elif is_byte_level and path.is_dir():
        config = _read_json(path / "config.json")
        return ByteTokenizer(config.get("bos_token_id"), tuple(_eos_ids(config)), name=path.name)
    if not path.exists():
        raise ValueError(f"tokenizer path {str(path)!r} does not exist; pass a checkpoint directory or a .gguf file")
    found = ("has no tokenizer.ggml.* metadata" if path.suffix == ".gguf" else
             "has no tokenizer.json" if path.is_dir() else "is neither a checkpoint directory nor a .gguf file")
    raise ValueError(f"{str(path)!r} {found}, so there is no tokenizer to encode text with; pass token-id prompts "
                     f"instead (--prompt-ids on the CLI)")
