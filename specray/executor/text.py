"""The text side of a request, on rank 0: prompts in (text, token ids or a conversation), text
out (detokenized as tokens arrive), and stop strings.

Rank 0's coordinator owns the tokenizer, so the driver (``LLM``, a server) sends prompts as
they come and receives text with the ids; nothing else loads a tokenizer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from specray.config import EngineConfig, SamplingParams
from specray.models.detokenize import IncrementalDetokenizer
from specray.models.presets import is_preset, resolve_model
from specray.models.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation, rendered with the model's chat template on rank 0."""

    messages: list[dict]
    add_generation_prompt: bool = True


Prompt = str | list[int] | ChatPrompt


def engine_tokenizer(config: EngineConfig):
    """The model's tokenizer, or None when it has none (token ids in, ids out)."""
    try:
        return load_tokenizer(resolve_model(config.model, config.seed), is_byte_level=is_preset(config.model))
    except ValueError:
        return None


def encode_prompt(tokenizer, prompt: Prompt, index: int, model: str) -> list[int]:
    """A prompt's token ids; a ValueError naming the request when it cannot be encoded."""
    if isinstance(prompt, (str, ChatPrompt)) and tokenizer is None:
        kind = "a text prompt" if isinstance(prompt, str) else "a chat conversation"
        raise ValueError(f"request {index}: {kind} needs a tokenizer, and model {model!r} has none "
                         f"(no tokenizer.json, no GGUF tokenizer metadata); pass token ids instead")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, ChatPrompt):
        try:
            return tokenizer.encode_chat(prompt.messages, prompt.add_generation_prompt)
        except ValueError as err:
            raise ValueError(f"request {index}: {err}") from None
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError(f"request {index}: a prompt must be text, a list of token ids or a conversation "
                         f"(ChatPrompt), got {type(prompt).__name__}") from None


class RequestText:
    """A request's output text, grown token by token, and its stop strings.

    ``add`` returns True when the text now contains a stop string: the text is cut before it
    (vLLM's rule, whatever token boundaries the stop string crossed) and ``stop_reason`` names it.
    ``take_new`` streams the text: it holds back the last ``len(longest stop) - 1`` characters
    while the request runs, since a stop string found later may cut them, so the streamed
    pieces always add up to the final text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop = params.stop
        self.text = ""
        self.stop_reason: str | None = None
        self.num_sent = 0  # characters of text already streamed
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token: int) -> bool:
        delta = self.detokenizer.add([token])
        self.text += delta
        if not self.stop or not delta:
            return False
        # a stop string may end in the new text and start up to len(stop) - 1 characters earlier
        found = [(self.text.find(s, max(len(self.text) - len(delta) - len(s) + 1, 0)), s) for s in self.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, self.stop_reason = min(found)
        self.text = self.text[:at]
        return True

    def finish(self) -> str:
        """The final text: what the detokenizer still held back (an unfinished character) appended."""
        if self.stop_reason is None:
            self.text += self.detokenizer.flush()
        return self.text

    def take_new(self, is_finished: bool) -> str:
        """The text not streamed yet that no later stop string can cut (all of it once finished)."""
        end = len(self.text) if is_finished else max(len(self.text) - self._hold_back, self.num_sent)
        new, self.num_sent = self.text[self.num_sent:end], end
        return new
