"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF file carries no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges (or the
SentencePiece scores they are derived from), the token types and the special ids as metadata.
Two families are supported, the ones llama.cpp calls:

* ``gpt2``: byte-level BPE. Tokens are already spelled in the GPT-2 byte alphabet; ``pre`` names
  the regex that cut text into words before the merges were learned (``PRE_TOKENIZERS``).
* ``llama``: SentencePiece-style BPE. Tokens spell a space as ``▁``, bytes the vocabulary lacks
  are ``<0xNN>`` tokens, merges come from the file or, failing that, from the scores.

Ids match what transformers builds for the same file (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), which the tests check, with one deliberate exception: for ``pre`` = ``smollm``
digits are split off first, as llama.cpp and SmolLM's own tokenizer do (see ``_smollm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (llama_token_type); the ones that change how a token is added.
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The GPT-2 split regex that ``ByteLevel(use_regex=True)`` applies.
_GPT2_REGEX_PRE = "gpt2-regex"
# Llama-3's split: case-insensitive contractions, numbers in groups of up to three digits.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: as Llama-3's, but every digit is a word of its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(split: str | None) -> pre_tokenizers.PreTokenizer:
    """A split regex followed by the byte-to-alphabet mapping (no regex of its own then)."""
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _smollm() -> pre_tokenizers.PreTokenizer:
    # As llama.cpp's "smollm" (and SmolLM's own tokenizer.json): every digit a word, then the GPT-2
    # regex. transformers 5.24 applies the GPT-2 regex alone, which differs only where blanks come
    # before a digit: "x  2" is x ĠĠ 2 here (as in training) and x Ġ Ġ 2 there.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# ``tokenizer.ggml.pre`` -> the pre-tokenizer the vocabulary was trained behind. A file without the
# key is "default": GPT-2's regex, as transformers assumes.
PRE_TOKENIZERS = {
    "default": lambda: _byte_level(None),
    "gpt2": lambda: _byte_level(None),
    "smollm": _smollm,
    "llama-bpe": lambda: _byte_level(_LLAMA3_SPLIT),
    "llama3": lambda: _byte_level(_LLAMA3_SPLIT),
    "llama-v3": lambda: _byte_level(_LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _byte_level(_QWEN2_SPLIT),
}
TOKENIZER_MODELS = ("gpt2", "llama")


@dataclass(frozen=True, kw_only=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata, as read; ids index ``tokens``."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...] | None
    scores: tuple[float, ...] | None
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool
    chat_template: str | None

    def __post_init__(self):
        if self.model not in TOKENIZER_MODELS:
            raise ValueError(f"tokenizer.ggml.model is {self.model!r}; supported tokenizer models: "
                             f"{', '.join(TOKENIZER_MODELS)}")
        if self.model == "gpt2" and self.pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre is {self.pre!r}, a pre-tokenizer specray does not know; "
                             f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        if self.token_types and len(self.token_types) != len(self.tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(self.token_types)} entries but tokenizer.ggml.tokens "
                             f"has {len(self.tokens)}; there must be one type per token")
        for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not 0 <= token_id < len(self.tokens):
                raise ValueError(f"tokenizer.ggml.{name} is {token_id}, outside the vocabulary of "
                                 f"{len(self.tokens)} tokens")
        if self.model == "llama" and self.merges is None and self.scores is None:
            raise ValueError("a llama (SentencePiece) GGUF vocabulary needs tokenizer.ggml.merges or "
                             "tokenizer.ggml.scores to order its merges; the file has neither")


def read_gguf_vocab(source) -> GGUFVocab | None:
    """The tokenizer metadata of a GGUF file (a path, or a ``gguf.GGUFReader`` already open on it:
    parsing a file takes seconds, so a weight loader that has one should pass it), or None when
    the file has none."""
    from gguf import GGUFReader

    fields = (source if isinstance(source, GGUFReader) else GGUFReader(str(source))).fields

    def get(key, default=None):
        field = fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    model = get("ggml.model")
    if model is None:
        return None
    merges, scores = get("ggml.merges"), get("ggml.scores")
    return GGUFVocab(
        model=model, pre=get("ggml.pre", "default"), tokens=tuple(get("ggml.tokens", ())),
        token_types=tuple(get("ggml.token_type", ())),
        merges=None if merges is None else tuple(merges), scores=None if scores is None else tuple(scores),
        bos_token_id=get("ggml.bos_token_id"), eos_token_id=get("ggml.eos_token_id"),
        unknown_token_id=get("ggml.unknown_token_id"), padding_token_id=get("ggml.padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, never to a byte-level one.
        add_bos_token=get("ggml.add_bos_token", model == "llama"), add_eos_token=get("ggml.add_eos_token", False),
        add_space_prefix=get("ggml.add_space_prefix", model == "llama"), chat_template=get("chat_template"))


def build_backend(vocab: GGUFVocab) -> BackendTokenizer:
    """The vocabulary as a ``tokenizers.Tokenizer``: model, pre-tokenizer, decoder, added tokens
    and the post-processor that adds BOS/EOS as the file's flags say."""
    backend = _byte_level_bpe(vocab) if vocab.model == "gpt2" else _sentencepiece_bpe(vocab)
    _add_typed_tokens(backend, vocab)
    backend.post_processor = _bos_eos_processor(vocab)
    return backend


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other 68
    bytes take the characters from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in spelling]
    spelling.update({byte: chr(256 + offset) for offset, byte in enumerate(others)})
    return spelling


def _byte_level_bpe(vocab: GGUFVocab) -> BackendTokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Added tokens may be stored as raw text; the BPE vocabulary needs every entry in the byte alphabet.
    spelled = {(token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))): index
               for index, token in enumerate(vocab.tokens)}
    backend = BackendTokenizer(models.BPE(vocab=spelled, merges=_merge_pairs(vocab.merges or ()), fuse_unk=False))
    backend.pre_tokenizer = PRE_TOKENIZERS[vocab.pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(vocab: GGUFVocab) -> BackendTokenizer:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    merges = _merge_pairs(vocab.merges) if vocab.merges is not None else merges_from_scores(vocab.tokens, vocab.scores)
    unk = vocab.tokens[vocab.unknown_token_id] if vocab.unknown_token_id is not None else None
    backend = BackendTokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = "first" if vocab.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:  # the space the pre-tokenizer prepended is not part of the text
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merge_pairs(merges) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    for merge, pair in zip(merges, pairs):
        if len(pair) != 2:
            raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated by one space")
    return pairs


def merges_from_scores(tokens, scores) -> list[tuple[str, str]]:
    """SentencePiece BPE ranks merges by the score of the token they make: every way to cut a token
    into two vocabulary tokens is a merge, best score first. Equal scores prefer the longer left
    part, then the longer right part, then the earlier token (the order transformers uses)."""
    ids = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        cuts = [(ids[token[:cut]], ids[token[cut:]], token[:cut], token[cut:])
                for cut in range(1, len(token)) if token[:cut] in ids and token[cut:] in ids]
        for left_id, right_id, left, right in sorted(cuts):
            candidates.append((-score, -len(left), -len(right), index, left_id, right_id, left, right))
    candidates.sort(key=lambda c: c[:4])  # stable: equal keys keep the (left id, right id) order
    return [(left, right) for *_, left, right in candidates]


def _add_typed_tokens(backend: BackendTokenizer, vocab: GGUFVocab) -> None:
    """Control (and the unknown) tokens become special added tokens and user-defined ones plain
    added tokens, so text that spells them maps to their one id instead of being cut up."""
    types = vocab.token_types or (1,) * len(vocab.tokens)
    alphabet = set(byte_alphabet().values()) if vocab.model == "gpt2" else None
    special, added = [], []
    for token, token_type in zip(vocab.tokens, types):
        if alphabet is not None and not set(token) <= alphabet:
            continue  # a mislabelled token; its id already has a byte-alphabet spelling in the vocabulary
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(added)


def _bos_eos_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    """BOS before and EOS after the text, each when the file's flag asks for it."""
    wanted = [(vocab.add_bos_token, vocab.bos_token_id, "bos"), (vocab.add_eos_token, vocab.eos_token_id, "eos")]
    for flag, token_id, name in wanted:
        if flag and token_id is None:
            raise ValueError(f"the GGUF file sets tokenizer.ggml.add_{name}_token but has no "
                             f"tokenizer.ggml.{name}_token_id")
    bos, eos = ([vocab.tokens[token_id]] if flag else [] for flag, token_id, _ in wanted)
    if not bos and not eos:
        return None
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        special_tokens=[(vocab.tokens[token_id], token_id) for flag, token_id, _ in wanted if flag])
