"""Checks made before a request reaches a route: the API key and the body size.

Plain ASGI middleware rather than route dependencies, so they run before the body is parsed
(a wrong key is a 401 even with a malformed body) and never wrap a streamed response.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.server.errors import AUTHENTICATION, APIError

OPEN_PATHS = frozenset({"/health"})  # what load balancers probe without a key


class RequireApiKey:
    """401 unless the request carries `Authorization: Bearer KEY`, or Anthropic's `x-api-key:
    KEY` (every path but /health).

    The scheme is matched case-insensitively, as HTTP auth schemes are (RFC 9110); the key
    exactly, in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self._has_key(dict(scope["headers"])):
            error = APIError(
                401,
                "invalid or missing API key: send the header 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                code="invalid_api_key",
                type=AUTHENTICATION,
                headers={"WWW-Authenticate": 'Bearer realm="specdecode"'},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        if b"authorization" in headers:
            scheme, _, key = headers[b"authorization"].partition(b" ")
            return scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.expected)
        return secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.expected)


class LimitBodySize:
    """413 for a body above `limit` bytes, announced (Content-Length) or streamed (chunked).

    The body is read here, at most `limit` bytes of it, and replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and (not declared.isdigit() or int(declared) > self.limit)
        body = None if too_large else await self._read(receive)
        if body is None:
            error = APIError(
                413, f"the request body is larger than {self.limit} bytes", code="request_too_large"
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > self.limit:
                return None
            if message["type"] != "http.request" or not message.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the buffered body once, then the client's later messages
    (a disconnect, which streaming responses listen for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
