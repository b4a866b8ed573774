"""Every error the server returns, in one place: which exception is which HTTP status, and the
OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` they are all sent in.

| exception                         | status | meaning                                         |
|-----------------------------------|--------|-------------------------------------------------|
| ``ValueError`` (request checks)   | 400    | the request is invalid (validation included)    |
| ``UnsupportedField``              | 400    | a field specray would otherwise ignore          |
| ``GrammarError``                  | 400    | a structured-output spec that does not compile  |
| ``Unauthorized``                  | 401    | ``--api-key`` is set and the request lacks it   |
| ``NotFound``                      | 404    | unknown model or route                          |
| ``QueueFull``                     | 503    | more requests than ``--max-num-queued-reqs``    |
| ``EngineUnavailable``             | 503    | the engine is still starting or was shut down   |
| ``RankFailure``, anything else    | 500    | the engine broke (``/health`` turns 503 too)    |
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from specray.errors import EngineClosed, SpecrayError
from specray.launch.procs import RankFailure


class ServeError(SpecrayError):
    """An error of the HTTP layer itself; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Unauthorized(ServeError):
    pass


class NotFound(ServeError):
    pass


class QueueFull(ServeError):
    pass


class EngineUnavailable(ServeError):
    pass


class BadRequest(ServeError, ValueError):
    pass


class UnsupportedField(BadRequest):
    """A request field specray does not implement, whose value could change the output."""


# Most specific first: the first class the exception is an instance of decides.
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (Unauthorized, 401, "AuthenticationError"),
    (NotFound, 404, "NotFoundError"),
    (QueueFull, 503, "ServiceUnavailableError"),
    (EngineUnavailable, 503, "ServiceUnavailableError"),
    (EngineClosed, 503, "ServiceUnavailableError"),
    (RankFailure, 500, "InternalServerError"),
    (ValueError, 400, "BadRequestError"),
    (TypeError, 400, "BadRequestError"),
)


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of ``exc``; 500 for anything not listed."""
    for kind, status, name in _STATUS:
        if isinstance(exc, kind):
            return status, name
    return 500, "InternalServerError"


def error_body(message: str, status: int, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(exc: BaseException) -> JSONResponse:
    status, type_ = status_of(exc)
    message = str(exc) or type(exc).__name__
    if status == 500 and not isinstance(exc, RankFailure):
        message = f"{type(exc).__name__}: {message}"
    return JSONResponse(error_body(message, status, type_, getattr(exc, "param", None)), status_code=status)


def http_error_response(status: int, detail: str | None) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in the same envelope."""
    phrase = HTTPStatus(status).phrase
    type_ = "NotFoundError" if status == 404 else phrase.replace(" ", "") + "Error"
    return JSONResponse(error_body(detail or phrase, status, type_), status_code=status)


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """pydantic's errors as one 400 (never FastAPI's 422), naming the first field at fault."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors) or "invalid request"
    return JSONResponse(error_body(message, 400, "BadRequestError", param), status_code=400)
