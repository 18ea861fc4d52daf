"""OpenAI-style error bodies: every refusal, whatever raised it, reads the same to a client.

{"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with a 4xx status for the
client's mistakes (400 bad input, 401 key, 404 model or route, 405 method, 413 body size),
503 while the server shuts down and 500 only for the server's own failures, whose details go
to the log, not to the client. `type` is OpenAI's `invalid_request_error` except where
llama-server has a type of its own (`authentication_error`, `exceed_context_size_error`,
`not_supported_error`, `unavailable_error`), so that clients of either read it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
EXCEEDS_CONTEXT = "exceed_context_size_error"
NOT_SUPPORTED = "not_supported_error"
UNAVAILABLE = "unavailable_error"
SERVER_ERROR = "server_error"
GENERIC_500 = "internal server error (the server's log has the details)"

log = logging.getLogger("specdecode.server")


class APIError(Exception):
    """A request the server refuses, with what the client needs to fix it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = INVALID_REQUEST,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """headers: sent with the answer (Allow, WWW-Authenticate); extra: more fields of the
        error object (llama-server's n_prompt_tokens and n_ctx)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def server_error() -> APIError:
    """What a client sees of a failure of the server's own: a 500 without its details."""
    return APIError(500, GENERIC_500, type=SERVER_ERROR)


def shutting_down(what: str) -> APIError:
    return APIError(503, f"the server is shutting down: {what}", type=UNAVAILABLE, code="shutting_down")


def exceeds_context(message: str, param: str, n_ctx: int, n_prompt: int | None = None) -> APIError:
    """llama-server's refusal of a request too long for the context, with its numbers
    (n_prompt_tokens only where the prompt was tokenized)."""
    extra = {"n_ctx": n_ctx} if n_prompt is None else {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
    return APIError(
        400, message, param=param, code="context_length_exceeded", type=EXCEEDS_CONTEXT, extra=extra
    )


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """Pydantic's errors as a 400 naming the field (where FastAPI answers 422).

    For a union field pydantic reports every member; a member whose type fitted but whose
    value did not (a list of five stop strings) says more than "not a string", so it wins."""
    chosen = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    path = [str(part) for part in chosen.get("loc", ()) if part != "body"]
    kind = chosen["type"]
    if not path:
        return APIError(400, f"the body must be a JSON object: {chosen['msg']}", code=kind)
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {'.'.join(path)!r}", param=path[0], code=kind)
    where = f" (at {'.'.join(path)})" if len(path) > 1 else ""
    return APIError(400, f"{path[0]}: {chosen['msg']}{where}", param=path[0], code=kind)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Routes parse their own bodies; this answers for anything FastAPI validates itself.
        return validation_error(exc.errors()).response()

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own refusals (404, 405 with its Allow header), in the same envelope.
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return server_error().response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
