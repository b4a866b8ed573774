"""``AsyncLLM``: the engine for asyncio code (the HTTP server), one stream of deltas per request.

It is a client of rank 0's engine loop, like ``LLM.generate``: ``generate`` adds one request
to the loop's inbox and yields its ``RequestDelta``s as rank 0 emits them; cancelling the
iterator (``aclose``, task cancel, a client that went away) aborts the request, which frees
its pages in every pool. Any number of ``generate`` iterators may run at once.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import uuid
from collections.abc import AsyncIterator

from specray.config import EngineConfig, SamplingParams
from specray.errors import ConfigError, EngineClosed, SpecrayError
from specray.executor.outputs import EngineStats, RequestDelta
from specray.executor.text import ChatPrompt, Prompt, engine_tokenizer
from specray.launch import resolve_launcher, start_engine
from specray.llm import resolve_config


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        """Start the engine (blocking, like ``LLM``); keyword arguments are ``EngineConfig`` fields."""
        self._engine = None
        self.config = resolve_config(config, overrides)
        if resolve_launcher(self.config) == "external":
            raise ConfigError("AsyncLLM needs a launcher whose rank 0 runs the loop for this process (local, mp, "
                              "ray); under 'external' (torchrun) every rank runs the script and calls "
                              "LLM.generate together: use LLM there")
        self._engine = start_engine(self.config)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._tokenizer = None

    def _client(self):
        if self._engine is None:
            raise EngineClosed("this AsyncLLM is closed; build a new one")
        return self._engine.client

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until its last (``finish_reason`` set). Bad input raises
        ``ValueError`` from the first ``__anext__``, before any delta; a dead rank raises
        ``RankFailure``. Leaving the iterator early aborts the request."""
        client = self._client()
        params = SamplingParams() if params is None else params
        request_id = f"async-{self._prefix}-{next(self._ids)}" if request_id is None else request_id
        label = repr(request_id)
        _check_request(label, prompt, params, request_id)
        if not isinstance(prompt, (str, ChatPrompt)):
            prompt = list(prompt)
        stream = client.open([(request_id, prompt, params)], [label], asyncio.get_running_loop())[0]
        is_done = False
        try:
            while True:
                item = await stream.aget(client.poll_s)
                if item is None:
                    client.check_alive()
                    continue
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                is_done = item.is_finished
                yield item
                if is_done:
                    return
        finally:
            if not is_done:  # cancelled or abandoned: free its pages now
                client.discard([request_id])
                try:
                    client.abort([request_id])
                except SpecrayError:  # closed or dead: nothing runs any more
                    pass

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its stream ends with a delta whose finish_reason is "abort"."""
        self._client().abort([request_id])

    async def reset_prefix_cache(self) -> None:
        """Forget every cached page (pages in use stay with their requests)."""
        self._client().reset_prefix_cache()

    def stats(self) -> EngineStats:
        """The last snapshot rank 0 sent (after its last loop turn): cheap, no round trip."""
        return self._client().stats

    @property
    def is_healthy(self) -> bool:
        """False once a rank died or the engine broke (then generate raises RankFailure) or closed."""
        return self._engine is not None and self._engine.client.is_healthy

    @property
    def geometry(self) -> dict:
        if self._engine is None:
            raise EngineClosed("this AsyncLLM is closed; build a new one")
        return self._engine.geometry

    @property
    def tokenizer(self):
        """The model's tokenizer in this process (loaded on first use), or None without one."""
        if self._tokenizer is None:
            self._tokenizer = engine_tokenizer(self.config)
        return self._tokenizer

    def close(self) -> _Closed:
        """Stop the engine. Works called plainly (atexit, sync code) and awaited (``await llm.close()``)."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.close()
        return _Closed()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Closed:
    """What ``close`` returns: already done, and awaitable so async code can ``await`` it."""

    def __await__(self):
        return iter(())


def _check_request(label: str, prompt, params, request_id) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id ({request_id!r}) must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {label}: params ({params!r}) must be a SamplingParams")
    if isinstance(prompt, (str, ChatPrompt)):
        return
    try:
        [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError(f"request {label}: a prompt must be text, a list of token ids or a conversation "
                         f"(ChatPrompt), got {type(prompt).__name__}") from None
