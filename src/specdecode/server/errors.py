"""OpenAI-style error bodies: every refusal, whatever raised it, reads the same to a client.

{"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with a 4xx status for the
client's mistakes (400 bad input, 401 key, 404 model or route, 413 body size) and 500 only for
the server's own failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID_REQUEST = "invalid_request_error"


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
        return APIError(exc.status_code, str(exc.detail)).response()

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {exc}", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
