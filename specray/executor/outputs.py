"""What the engine loop sends out (per-request deltas, engine stats) and takes in (add, abort).

These cross process boundaries (the mp pipe, Ray actor calls), so they are small plain
dataclasses. ``RequestDelta`` and ``EngineStats`` are the interface the driver, ``AsyncLLM``
and the HTTP server read (docs/engine-loop.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.workers.logprobs import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length" or "stop" ("abort" when aborted)
    metrics: dict = field(default_factory=dict)
    text: str = ""  # the output text ("" when the model has no tokenizer)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    logprobs: list[TokenLogprob] | None = None  # one per output token, when params.logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    new_token_ids: list[int]  # tokens appended since the last delta of this request
    new_text: str  # the text they complete (incremental detokenizer; "" without a tokenizer)
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    metrics: dict | None = None  # on the last delta: the RequestOutput.metrics dict
    prompt_token_ids: list[int] | None = None  # on the first delta only: the encoded prompt
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when params.logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, on the first delta after the prompt ran

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """A snapshot taken on rank 0 after each loop turn; the spec counters are cumulative and
    named as vLLM names them (spec_decode_num_drafts, ...)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: dict[str, float] = field(default_factory=dict)  # pool ("target", "draft") -> fraction in use
    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    prefix_cache_queries: dict[str, int] = field(default_factory=dict)  # pool -> prompt tokens looked up
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)  # pool -> tokens served from its cache
    # adaptive speculation (empty when off): draft_length_histogram (decode rows per length 0..k),
    # num_steps_without_drafting, num_draft_length_switches, step_cost (the fitted model)
    adaptive: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Inbox: requests (request_id, prompt, params) validated together, added all or none.
    ``labels`` name each in an error (``request 1``, ``request 'cmpl-7'``)."""

    requests: list[tuple[str, object, object]]
    labels: list[str | int]


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Inbox: forget every cached page (vLLM's ``POST /reset_prefix_cache``)."""


@dataclass(slots=True)
class LoopOutput:
    """Outbox: one loop turn's deltas and the stats after it; ``rejected`` maps the ids of a
    rejected add to its error (type name, message): plain data, as it may cross processes."""

    deltas: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats | None = None
    rejected: dict[str, tuple[str, str]] = field(default_factory=dict)
