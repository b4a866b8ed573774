"""OpenAI response bodies and server-sent-event chunks for completions and chat.

The two endpoints differ only in names and in where a choice's text goes (``text`` or
``message.content`` / ``delta.content``); ``Format`` holds those differences.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from specray.serve.generation import ChoiceResult, usage


@dataclass(frozen=True, slots=True)
class Format:
    id_prefix: str
    object: str
    chunk_object: str
    is_chat: bool

    def choice(self, r: ChoiceResult) -> dict:
        body = {"index": r.choice.index, "logprobs": None, "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason}
        if self.is_chat:
            body["message"] = {"role": "assistant", "content": r.text}
        else:
            body["text"] = r.text
        return body

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, role: bool = False) -> dict:
        body = {"index": index, "logprobs": None, "finish_reason": finish_reason}
        if self.is_chat:
            body["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            body["text"] = text
        return body


COMPLETION = Format("cmpl-", "text_completion", "text_completion", is_chat=False)
CHAT = Format("chatcmpl-", "chat.completion", "chat.completion.chunk", is_chat=True)


def response_body(fmt: Format, request_id: str, model: str, results: list[ChoiceResult]) -> dict:
    return {"id": fmt.id_prefix + request_id, "object": fmt.object, "created": int(time.time()), "model": model,
            "choices": [fmt.choice(r) for r in sorted(results, key=lambda r: r.choice.index)],
            "usage": usage(results)}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(fmt: Format, run, model: str, include_usage: bool):
    """The SSE body of a streaming request: a role chunk per choice (chat), a chunk per delta with
    text or a finish reason, the usage chunk when asked for, then ``[DONE]``. An engine failure
    after the response started is sent as an ``error`` event (the status is already 200)."""
    from specray.serve.errors import error_response  # the one place that maps errors

    head = {"id": fmt.id_prefix + run.id, "object": fmt.chunk_object, "created": int(time.time()), "model": model}
    extra = {"usage": None} if include_usage else {}
    try:
        if fmt.is_chat:
            for r in run.results:
                yield sse({**head, "choices": [fmt.chunk_choice(r.choice.index, "", None, role=True)], **extra})
        async for result, delta in run.events():
            if delta.new_text or delta.finish_reason is not None:
                choice = fmt.chunk_choice(result.choice.index, delta.new_text, delta.finish_reason)
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(run.results)})
    except Exception as err:  # noqa: BLE001 - reported in the stream, then the stream ends
        yield sse(json.loads(error_response(err).body))
    yield sse("[DONE]")
