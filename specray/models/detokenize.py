"""Incremental detokenization: the new text of each step, from the new token ids.

Decoding the whole output after every step costs O(length) per token. Instead, as vLLM and TGI
do, keep a short window of ids: ``[prefix, read)`` were already turned into text, ``[read, end)``
are new. Decode ``[prefix, end)`` and ``[prefix, read)``; the text the first has beyond the second
is the delta. The window re-starts at ``read`` after every emission, so each step decodes a
few tokens only. The prefix tokens are kept as context because a token's text can depend on its
neighbours (a SentencePiece decoder strips the space of the first token it sees; bytes of one
character come in several tokens).

A character whose bytes are split over tokens decodes to U+FFFD until its last byte arrives, so
text ending in U+FFFD is held back and the window grows until the character is whole. The deltas
then concatenate to the one-shot ``decode`` of the output ids (for byte-level tokenizers exactly;
a SentencePiece tokenizer, seeded with the prompt's tail, keeps the leading space of the first
output word, which a one-shot decode of the output alone strips: " Paris" after "The capital is").
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first output token (enough for a split character).
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed the output ids as they come (``add``); each call returns only the text they complete.
    Call ``flush`` when the sequence ends to get text still held back (an unfinished character,
    shown as U+FFFD as a one-shot decode would show it)."""

    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)[-NUM_CONTEXT_TOKENS:]
        if self._decode(self._ids).endswith(REPLACEMENT):
            self._ids = []  # the prompt ends inside a character: as context it would hold text back forever
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, new_ids) -> str:
        """The text that ``new_ids`` (one token or several, as a speculative step accepts) complete."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if new_text.endswith(REPLACEMENT):
            return ""  # an unfinished character: wait for its last byte
        return self._emit(new_text[len(prefix_text):])

    def flush(self) -> str:
        """Whatever is held back, decoded as is; the window is empty afterwards."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        return self._emit(new_text[len(prefix_text):])

    def _emit(self, delta: str) -> str:
        # Drop the ids before the new prefix: memory and decode cost stay bounded by the window.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta
