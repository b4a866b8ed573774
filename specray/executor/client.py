"""The driver's side of the engine loop: requests into the inbox, deltas out to per-request streams.

One ``EngineClient`` per engine, whatever the transport: the transport gives it ``send`` (a
message to rank 0's inbox, never blocking on a step) and calls ``dispatch`` with every
``LoopOutput`` and ``fail`` when the engine died. ``LLM.generate`` (``generate``) and
``AsyncLLM.generate`` are both streams over it: one code path. Every wait is bounded by
``poll_s``, after which ``check_alive`` (the transport's death watch) runs, so a dead engine
is always noticed, even by a reader blocked on a stream.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from collections.abc import Callable

from specray.errors import GrammarError
from specray.executor.outputs import (AbortRequests, AddRequests, EngineStats, RequestDelta, RequestOutput,
                                      ResetPrefixCache)


class RequestStream:
    """One request's deltas (or the error that ended it), for a thread or an asyncio task."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._queue = asyncio.Queue() if loop is not None else queue.Queue()

    def put(self, item: RequestDelta | BaseException) -> None:
        if self._loop is None:
            self._queue.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody reads this stream any more
            pass

    def get(self, timeout_s: float) -> RequestDelta | BaseException | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    async def aget(self, timeout_s: float) -> RequestDelta | BaseException | None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a task's cancel when
        # an item arrives at the same moment, and a cancelled reader would keep its request running
        try:
            async with asyncio.timeout(timeout_s):
                return await self._queue.get()
        except TimeoutError:
            return None


def rejection(error_type: str, message: str) -> Exception:
    """A rejected add as the caller sees it: bad input stays a ValueError."""
    if error_type == "GrammarError":
        return GrammarError(message)
    return ValueError(message) if error_type in ("ValueError", "ConfigError") else RuntimeError(
        f"rank 0 rejected the request: {error_type}: {message}")


class EngineClient:
    def __init__(self, send: Callable[[object], None], check_alive: Callable[[], None], poll_s: float):
        self._send = send
        self.check_alive = check_alive  # raises (after calling fail) when the engine is dead
        self.poll_s = poll_s
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._batch_ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.stats = EngineStats()
        self.error: BaseException | None = None  # set once the engine died: every call raises it

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    def open(self, requests: list[tuple[str, object, object]], labels: list,
             loop: asyncio.AbstractEventLoop | None = None) -> list[RequestStream]:
        """Send ``requests`` (id, prompt, params) to rank 0 as one add; their streams, in order."""
        ids = [rid for rid, _, _ in requests]
        with self._lock:
            if self.error is not None:
                raise self.error
            for label, rid in zip(labels, ids):
                if rid in self._streams or ids.count(rid) > 1:
                    raise ValueError(f"request {label}: request id {rid!r} is already in use; "
                                     f"request ids must be unique")
            streams = [RequestStream(rid, loop) for rid in ids]
            self._streams.update(zip(ids, streams))
        try:
            self._send(AddRequests(requests, labels))
        except BaseException:
            self.discard(ids)
            raise
        return streams

    def abort(self, request_ids: list[str]) -> None:
        """Ask rank 0 to abort; each stream still open ends with an "abort" delta."""
        if self.error is None and request_ids:
            self._send(AbortRequests(list(request_ids)))

    def reset_prefix_cache(self) -> None:
        """Ask rank 0 to forget every cached page; requests sent after this call see an empty cache."""
        if self.error is None:
            self._send(ResetPrefixCache())

    def discard(self, request_ids: list[str]) -> None:
        """Stop routing deltas to these streams (their reader left)."""
        with self._lock:
            for rid in request_ids:
                self._streams.pop(rid, None)

    def dispatch(self, output) -> None:
        """Route one ``LoopOutput`` (called by the transport's reader)."""
        with self._lock:
            if output.stats is not None:
                self.stats = output.stats
            routed = [(self._streams.pop(rid, None), rejection(*err)) for rid, err in output.rejected.items()]
            for delta in output.deltas:
                stream = (self._streams.pop if delta.is_finished else self._streams.get)(delta.request_id, None)
                routed.append((stream, delta))
        for stream, item in routed:
            if stream is not None:
                stream.put(item)

    def fail(self, error: BaseException) -> None:
        """The engine died: every open stream ends with ``error``, and so does every later call."""
        with self._lock:
            if self.error is None:
                self.error = error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(self.error)

    def next_delta(self, stream: RequestStream) -> RequestDelta:
        """The stream's next delta (raising the error that ended it), waiting in bounded slices."""
        while True:
            item = stream.get(self.poll_s)
            if item is None:
                self.check_alive()
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def generate(self, prompts: list, params: list) -> list[RequestOutput]:
        """The batch call: every request added at once (all or none), outputs in prompt order."""
        batch = f"{self._prefix}-{next(self._batch_ids)}"
        requests = [(f"generate-{batch}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        if len(prompts) != len(params):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one or one per prompt")
        if not requests:
            return []
        streams = self.open(requests, list(range(len(requests))))
        outputs = []
        try:
            for i, stream in enumerate(streams):
                outputs.append(collect(i, stream, self.next_delta))
        except BaseException:  # rejected, failed or interrupted: leave nothing running
            rest = [s.request_id for s in streams[len(outputs):]]
            self.discard(rest)
            if self.error is None:
                self.abort(rest)
            raise
        return outputs


def collect(index: int, stream: RequestStream, next_delta: Callable[[RequestStream], RequestDelta]) -> RequestOutput:
    """Read a stream to its last delta and build the request's ``RequestOutput``."""
    prompt, tokens, text, logprobs, prompt_logprobs = [], [], [], None, None
    while True:
        delta = next_delta(stream)
        if delta.prompt_token_ids is not None:
            prompt = delta.prompt_token_ids
        tokens += delta.new_token_ids
        text.append(delta.new_text)
        if delta.new_logprobs is not None:
            logprobs = (logprobs or []) + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            prompt_logprobs = delta.prompt_logprobs
        if delta.is_finished:
            return RequestOutput(index, prompt, tokens, delta.finish_reason, delta.metrics or {}, "".join(text),
                                 delta.stop_reason, logprobs, prompt_logprobs)
