"""The OpenAI request bodies the server accepts (pydantic), and how one becomes engine work.

A request fans out into choices: every prompt of a completion request (one text, one list of
token ids, or a list of either) times ``n``. Each choice is one engine request with its own
``SamplingParams``; with a ``seed``, choice ``j`` samples with ``seed + j`` so that the ``n``
answers differ from each other and the same request gives the same answers again.

Field rules live here as pydantic constraints, so a bad value is rejected with the field's name
(``param`` in the error body) before anything reaches the engine; ``SamplingParams`` checks the
same rules again for callers of the Python API.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.config import MAX_LOGPROBS, SamplingParams
from specray.executor.text import ChatPrompt, Prompt
from specray.serve.errors import BadRequest
from specray.serve.fields import check_fields, check_message_fields
from specray.serve.structured import ResponseFormat, StructuredOutputs

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI API's own default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # chat has no fixed API default (OpenAI: up to the context); a bounded answer
MAX_N = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat. Fields not declared here are kept aside and checked
    by ``check_fields`` (serve/fields.py): accepted when they cannot change the output, else 400."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM's "off") is read as 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache isolation (vLLM's field)

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    @model_validator(mode="after")
    def _one_structured_output(self):
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def structured(self):
        source = self.structured_outputs or self.response_format
        return source.structured() if source is not None else None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_fields(self) -> None:
        """400 for a field this model does not declare that could change the output."""
        check_fields(self.model_extra)

    def _logprob_params(self) -> dict:
        return {}

    def sampling_params(self, default_max_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice (``n`` of them)."""
        requested = self._requested_max_tokens()
        max_tokens = default_max_tokens if requested is None else requested
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seeds = _choice_seeds(self.seed, self.n)
        return [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=max(self.top_k, 0), seed=seed, stop=stop,
                               stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                               skip_special_tokens=self.skip_special_tokens, structured=self.structured(),
                               **self._logprob_params(), cache_salt=self.cache_salt)
                for seed in seeds]


def _choice_seeds(seed: int | None, n: int) -> list[int]:
    # Without a seed each choice still needs its own: the engine would otherwise derive the same
    # default seed for every request, and n samples would come back identical.
    if seed is None:
        return [random.getrandbits(63) for _ in range(n)]
    return [seed + j for j in range(n)]


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's log-probabilities only (lm-eval)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def check_fields(self) -> None:
        super().check_fields()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens (0) returns nothing without echo; set echo true (the prompt and, with "
                             "logprobs, its log-probabilities) or ask for at least one token", param="max_tokens")

    def _logprob_params(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    def prompts(self) -> list[Prompt]:
        """The prompts of this request, in order: one text, one id list, or a list of either."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(t, int) for t in self.prompt):
            return [list(self.prompt)]
        return [p if isinstance(p, str) else list(p) for p in self.prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts must all be ``{"type": "text", "text": ...}``."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = sorted({part.get("type", "?") for part in self.content} - {"text"})
        if kinds:
            raise ValueError(f"message content parts of type {kinds} are not supported; only 'text' parts are")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs true")
        return self

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_fields(self) -> None:
        check_fields(self.model_extra)
        for i, message in enumerate(self.messages):
            check_message_fields(i, message.model_extra)

    def _logprob_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def prompts(self) -> list[Prompt]:
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        return [ChatPrompt(messages, self.add_generation_prompt)]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) or messages (a conversation)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Choice:
    """One engine request of an HTTP request: its position in ``choices`` and its prompt."""

    index: int
    prompt_index: int
    prompt: Prompt
    params: SamplingParams


def fan_out(prompts: list[Prompt], params: list[SamplingParams]) -> list[Choice]:
    """Choices in OpenAI's order: prompt-major, then the ``n`` samples of each prompt."""
    return [Choice(index=i * len(params) + j, prompt_index=i, prompt=prompt, params=p)
            for i, prompt in enumerate(prompts) for j, p in enumerate(params)]
