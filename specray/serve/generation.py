"""Running one HTTP request's choices on the engine: admission, one task per choice feeding a
shared queue, and the accumulated results.

Every choice's first event (its first delta, or the error the engine raised for it) is awaited
before the response starts, so a request the engine rejects gets a proper 4xx/5xx status even
when it asked to stream. Closing a run (the client went away, or the request finished) cancels
the choice tasks, which closes their ``AsyncLLM.generate`` iterators: that aborts the engine
requests and frees their pages.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from specray.errors import SpecrayError
from specray.serve.errors import QueueFull
from specray.serve.metrics import ServerMetrics
from specray.serve.protocol import Choice

_DONE = object()


class Admission:
    """Engine requests in flight through this server; more than ``capacity`` are refused (503)
    rather than queued without bound. ``capacity`` = ``--max-num-seqs`` + ``--max-num-queued-reqs``."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"admission capacity ({capacity}) must be >= 1")
        self.capacity = capacity
        self.in_flight = 0

    def acquire(self, num_requests: int) -> None:
        if self.in_flight + num_requests > self.capacity:
            raise QueueFull(f"the server holds {self.in_flight} engine requests and this one needs {num_requests} "
                            f"more, above its capacity of {self.capacity} (--max-num-seqs + "
                            f"--max-num-queued-reqs); retry later")
        self.in_flight += num_requests

    def release(self, num_requests: int) -> None:
        self.in_flight -= num_requests


@dataclass(slots=True)
class ChoiceResult:
    choice: Choice
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked
    prompt_logprobs: list | None = None  # per prompt token (echo with logprobs), the first None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def add(self, delta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs or ())
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_output_tokens = delta.num_output_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.num_cached_tokens = (delta.metrics or {}).get("num_cached_tokens", 0)


def usage(results: list[ChoiceResult]) -> dict:
    """Prompt tokens once per prompt (not per sample of it), output tokens of every choice, and
    the prompt tokens served from the prefix cache (OpenAI's ``prompt_tokens_details``; the
    first choice of each prompt counts, as its prompt tokens do)."""
    prompt, cached = {}, {}
    for r in results:
        prompt.setdefault(r.choice.prompt_index, r.num_prompt_tokens)
        cached.setdefault(r.choice.prompt_index, r.num_cached_tokens)
    num_prompt, num_output = sum(prompt.values()), sum(r.num_output_tokens for r in results)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


class RequestRun:
    """The choices of one HTTP request running on the engine; iterate ``events()`` for
    ``(ChoiceResult, delta)`` pairs in arrival order, and always ``close()``."""

    def __init__(self, engine, choices: list[Choice], metrics: ServerMetrics, request_id: str | None = None):
        self.id = request_id or uuid.uuid4().hex
        self.results = [ChoiceResult(c) for c in choices]
        self._engine, self._metrics = engine, metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[ChoiceResult, object]] = []
        self._tasks: list[asyncio.Task] = []
        self._is_closed = False

    async def start(self) -> None:
        """Start every choice; raise the first error any choice hit before its first delta."""
        self._tasks = [asyncio.create_task(self._pump(r)) for r in self.results]
        waiting = set(range(len(self.results)))
        while waiting:
            result, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            waiting.discard(result.choice.index)
            self._buffer.append((result, item))

    async def _pump(self, result: ChoiceResult) -> None:
        timer = self._metrics.track()
        stream = self._engine.generate(result.choice.prompt, result.choice.params, f"{self.id}-{result.choice.index}")
        try:
            async for delta in stream:
                if self._is_closed:  # a cancel can be lost in a race inside the stream: stop anyway
                    break
                timer.on_delta(delta)
                await self._queue.put((result, delta))
            await self._queue.put((result, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - handed to the reader, which raises it
            await self._queue.put((result, err))
        finally:
            await stream.aclose()  # aborts the engine request if it is still running

    async def events(self):
        num_open = len(self.results)
        pending, self._buffer = self._buffer, []
        while num_open:
            result, item = pending.pop(0) if pending else await self._queue.get()
            if item is _DONE:
                num_open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            result.add(item)
            yield result, item

    async def collect(self) -> list[ChoiceResult]:
        async for _ in self.events():
            pass
        return self.results

    async def close(self) -> None:
        """Stop every choice: cancel its task and abort its engine request by id too, since a
        task's cancellation can be swallowed by an ``asyncio.wait_for`` that completed at the
        same moment (Python < 3.12) and the request would then run to its end unread."""
        self._is_closed = True
        for task in self._tasks:
            task.cancel()
        unfinished = [f"{self.id}-{r.choice.index}" for r in self.results if r.finish_reason is None]
        for request_id in unfinished:  # ids that finished meanwhile are skipped by the engine
            try:
                await self._engine.abort(request_id)
            except SpecrayError:
                break  # the engine is closed or dead: nothing runs any more
        await asyncio.gather(*self._tasks, return_exceptions=True)
