"""OpenAI response bodies and server-sent-event chunks for completions and chat.

The two endpoints differ only in names, in where a choice's text goes (``text`` or
``message.content`` / ``delta.content``) and in the shape of their log-probabilities
(serve/logprobs.py); ``Format`` holds those differences, ``Rendering`` what one request asked for
(``echo``, log-probabilities) and the token names to write them with.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from specray.serve.generation import ChoiceResult, usage
from specray.serve.logprobs import TokenNames, chat_logprobs, completion_logprobs, text_length


@dataclass(frozen=True, slots=True)
class Format:
    id_prefix: str
    object: str
    chunk_object: str
    is_chat: bool


COMPLETION = Format("cmpl-", "text_completion", "text_completion", is_chat=False)
CHAT = Format("chatcmpl-", "chat.completion", "chat.completion.chunk", is_chat=True)


@dataclass(slots=True)
class Rendering:
    fmt: Format
    names: TokenNames
    echo: bool = False  # completions: the prompt's text (and log-probabilities) come first
    has_logprobs: bool = False
    _offsets: dict[int, int] = field(default_factory=dict)  # streaming: text sent so far, per choice

    def logprobs(self, entries: list, token_ids: list[int], index: int) -> dict | None:
        if not self.has_logprobs:
            return None
        if self.fmt.is_chat:
            return chat_logprobs(self.names, entries)
        body = completion_logprobs(self.names, entries, token_ids, self._offsets.get(index, 0))
        self._offsets[index] = text_length(body) or self._offsets.get(index, 0)
        return body

    def choice(self, r: ChoiceResult) -> dict:
        text, entries, ids = r.text, r.logprobs, r.token_ids
        if self.echo:
            text = self.names.prompt_text(r.choice.prompt) + text
            entries, ids = (r.prompt_logprobs or []) + entries, r.prompt_token_ids + ids
        body = {"index": r.choice.index, "logprobs": self.logprobs(entries, ids, r.choice.index),
                "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
        if self.fmt.is_chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        return body

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, role: bool = False,
                     logprobs: dict | None = None) -> dict:
        body = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.fmt.is_chat:
            body["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            body["text"] = text
        return body

    def delta_choice(self, result: ChoiceResult, delta, is_first: bool) -> dict | None:
        """The chunk of one delta; None when it carries nothing to send."""
        text, entries, ids = delta.new_text, delta.new_logprobs or [], delta.new_token_ids
        if self.echo and is_first:
            text = self.names.prompt_text(result.choice.prompt) + text
            entries, ids = (delta.prompt_logprobs or []) + entries, (delta.prompt_token_ids or []) + ids
        if not (text or (ids and self.has_logprobs) or delta.finish_reason is not None):
            return None
        index = result.choice.index
        return self.chunk_choice(index, text, delta.finish_reason, logprobs=self.logprobs(entries, ids, index))


def response_body(render: Rendering, request_id: str, model: str, results: list[ChoiceResult]) -> dict:
    fmt = render.fmt
    return {"id": fmt.id_prefix + request_id, "object": fmt.object, "created": int(time.time()), "model": model,
            "choices": [render.choice(r) for r in sorted(results, key=lambda r: r.choice.index)],
            "usage": usage(results)}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(render: Rendering, run, model: str, include_usage: bool):
    """The SSE body of a streaming request: a role chunk per choice (chat), a chunk per delta with
    text, tokens or a finish reason, the usage chunk when asked for, then ``[DONE]``. An engine
    failure after the response started is sent as an ``error`` event (the status is already 200)."""
    from specray.serve.errors import error_response  # the one place that maps errors

    fmt = render.fmt
    head = {"id": fmt.id_prefix + run.id, "object": fmt.chunk_object, "created": int(time.time()), "model": model}
    extra = {"usage": None} if include_usage else {}
    started: set[int] = set()
    try:
        if fmt.is_chat:
            for r in run.results:
                yield sse({**head, "choices": [render.chunk_choice(r.choice.index, "", None, role=True)], **extra})
        async for result, delta in run.events():
            choice = render.delta_choice(result, delta, result.choice.index not in started)
            started.add(result.choice.index)
            if choice is not None:
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(run.results)})
    except Exception as err:  # noqa: BLE001 - reported in the stream, then the stream ends
        yield sse(json.loads(error_response(err).body))
    yield sse("[DONE]")
