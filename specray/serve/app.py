"""The FastAPI app: routes that turn request models into engine choices and engine deltas into
OpenAI responses. No engine logic lives here; errors become responses in ``serve/errors.py``.

The engine starts in the background after the app does (``EngineHolder``), so ``/health``
answers 503 while it loads and every other route says the engine is starting.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import specray
from specray.errors import EngineClosed, SpecrayError
from specray.serve.errors import (BadRequest, EngineUnavailable, NotFound, Unauthorized, error_response,
                                  http_error_response, validation_error_response)
from specray.serve.generation import Admission, RequestRun
from specray.serve.metrics import ServerMetrics
from specray.serve.protocol import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest,
                                    CompletionRequest, DetokenizeRequest, TokenizeRequest, fan_out)
from specray.serve.logprobs import TokenNames
from specray.serve.responses import CHAT, COMPLETION, Rendering, response_body, stream_events

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left; nobody reads it


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 64
    max_num_queued_reqs: int = 256
    """Engine requests allowed to wait beyond the running batch; more get 503."""

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs ({self.max_num_queued_reqs}) must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given (leave it out to serve without a key)")


class EngineHolder:
    """The engine (an ``AsyncLLM``) once ``factory`` has built it in a worker thread."""

    def __init__(self, factory, on_failure=None):
        self._factory, self._on_failure = factory, on_failure
        self.engine = None
        self.error: BaseException | None = None

    async def start(self) -> None:
        try:
            self.engine = await asyncio.to_thread(self._factory)
        except BaseException as err:  # noqa: BLE001 - kept for /health and the exit code
            self.error = err
            if self._on_failure is not None:
                self._on_failure(err)

    def require(self):
        if self.engine is None:
            state = f"failed to start: {self.error}" if self.error else "is still starting"
            raise EngineUnavailable(f"the engine {state}")
        return self.engine

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_healthy

    def stats(self):
        """The engine's last ``EngineStats``; None before it started and after it closed."""
        try:
            return self.engine.stats() if self.engine is not None else None
        except EngineClosed:
            return None

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


class _ClosingStream(StreamingResponse):
    """Runs ``on_close`` however the response ends (a client that left included, even before
    the body started), so the run's engine requests are aborted now, not when collected."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()


def build_app(holder: EngineHolder, config: ServeConfig) -> FastAPI:
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(holder.start())
        yield
        starting.cancel()
        await holder.close()

    app = FastAPI(title="specray", version=specray.__version__, lifespan=lifespan)
    app.state.metrics = metrics = ServerMetrics(config.served_model_name, holder.stats)
    admission = Admission(config.max_num_seqs + config.max_num_queued_reqs)
    _install_error_handlers(app)

    def check_api_key(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise Unauthorized("this server needs an API key: send `Authorization: Bearer <key>`")

    def check_model(model: str | None) -> None:
        if model is not None and model != config.served_model_name:
            raise NotFound(f"the model {model!r} does not exist; this server serves {config.served_model_name!r}",
                           param="model")

    async def generate(request: Request, body, fmt, default_max_tokens: int):
        check_model(body.model)
        body.check_fields()
        engine = holder.require()
        choices = fan_out(body.prompts(), body.sampling_params(default_max_tokens))
        render = Rendering(fmt, TokenNames(engine.tokenizer), echo=getattr(body, "echo", False),
                           has_logprobs=choices[0].params.logprobs is not None)
        admission.acquire(len(choices))
        run = RequestRun(engine, choices, metrics)
        is_finished = False

        async def finish():  # once, whichever path ends the request first
            nonlocal is_finished
            if not is_finished:
                is_finished = True
                admission.release(len(choices))
                await run.close()

        try:
            await run.start()
            if body.stream:
                events = stream_events(render, run, config.served_model_name, body.include_usage)
                return _ClosingStream(events, on_close=finish, media_type="text/event-stream")
            results = await _collect_unless_disconnected(request, run)
        except BaseException:
            await finish()
            raise
        await finish()
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return response_body(render, run.id, config.served_model_name, results)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, body, COMPLETION, DEFAULT_COMPLETION_MAX_TOKENS)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(request, body, CHAT, DEFAULT_CHAT_MAX_TOKENS)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "specray"}]}

    app.include_router(v1)
    _add_plain_routes(app, holder, metrics, check_model)
    return app


def _add_plain_routes(app: FastAPI, holder: EngineHolder, metrics: ServerMetrics, check_model) -> None:
    @app.get("/health")
    async def health():
        if holder.is_healthy:
            return Response(status_code=200)
        if holder.engine is None:
            state = f"failed to start: {holder.error}" if holder.error else "is still starting"
            return error_response(EngineUnavailable(f"the engine {state}"))
        return error_response(EngineUnavailable("the engine is not healthy: a rank died or the engine broke"))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await holder.require().reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": specray.__version__}

    def tokenizer():
        tok = holder.require().tokenizer
        if tok is None:
            raise BadRequest("this model has no tokenizer: only token-id prompts can be served")
        return tok

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        tok = tokenizer()
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = tok.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages],
                                  body.add_generation_prompt)
        return {"tokens": ids, "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        return {"prompt": tokenizer().decode(body.tokens, skip_special_tokens=False)}


async def _collect_unless_disconnected(request: Request, run: RequestRun):
    """The run's results, or None when the client left first (the caller closes the run).

    The disconnect is awaited, not polled: a task reads the request's ASGI channel, whose next
    message after the body is ``http.disconnect`` (as Starlette's streaming responses listen)."""
    collecting = asyncio.ensure_future(run.collect())
    listening = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait([collecting, listening], return_when=asyncio.FIRST_COMPLETED)
        return collecting.result() if collecting.done() else None
    finally:
        collecting.cancel()
        listening.cancel()


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return validation_error_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return http_error_response(exc.status_code, exc.detail if isinstance(exc.detail, str) else None)

    async def mapped(_request, exc: Exception):
        return error_response(exc)

    # ValueError, TypeError and SpecrayError go through Starlette's exception middleware; the bare
    # Exception handler catches the rest (Starlette logs those with their traceback, as it should).
    for kind in (ValueError, TypeError, SpecrayError, Exception):
        app.add_exception_handler(kind, mapped)
