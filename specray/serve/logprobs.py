"""Engine log-probabilities (``TokenLogprob``) in OpenAI's two shapes.

- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
  prompt tokens first with ``echo`` (the first one's log-probability and top entries null);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is what the tokenizer decodes it to alone (special tokens included); a model
without a tokenizer names tokens ``token_id:<id>`` (vLLM's ``--return-tokens-as-token-ids`` form).
A token that is part of a multi-byte character decodes to U+FFFD on its own, as in vLLM.
"""

from __future__ import annotations


class TokenNames:
    """Token id -> text, cached (a response names the same top tokens many times)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            name = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = name
        return name

    def prompt_text(self, prompt) -> str:
        """The text ``echo`` returns for a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(list(prompt), skip_special_tokens=False)


def completion_logprobs(names: TokenNames, entries: list, token_ids: list[int], text_offset: int) -> dict:
    """Completions' shape for ``entries`` (TokenLogprob, or None for a prompt's first token, whose
    id is ``token_ids[i]``); offsets count from ``text_offset``, the text already sent before."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = names(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        top_logprobs.append(None if entry is None else {names(t): lp for t, lp in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(names: TokenNames, entries: list) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = names(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def text_length(offsets: dict) -> int:
    """Where the next chunk's offsets start: after the last token of ``offsets``."""
    if not offsets["tokens"]:
        return 0
    return offsets["text_offset"][-1] + len(offsets["tokens"][-1])
