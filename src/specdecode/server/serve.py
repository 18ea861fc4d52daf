"""Start-up of `specdecode serve`: the listening socket, the banner, uvicorn, and the
shutdown (its flags are in `settings`).

The socket is bound before the models load, so a port in use fails at once with one
`error:` line rather than after loading. On SIGTERM or SIGINT the server stops accepting,
answers requests still waiting for a slot with 503, lets running generations finish for
--shutdown-grace seconds, then cuts the rest (a stream gets an error event and [DONE]).
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI

from specdecode.api import Pipeline
from specdecode.errors import SpecdecodeError
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

CUT_MARGIN_S = 5  # after the grace: for cut generations to end their current step and streams


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket, or a SpecdecodeError that says why not."""
    if not 0 <= port <= 65535:
        raise SpecdecodeError(f"--port must be in 0..65535 (got {port})")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise SpecdecodeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def address(sock: socket.socket) -> str:
    """The URL a listening socket serves."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def banner(sock: socket.socket, pipeline: Pipeline, settings: ServerSettings) -> str:
    """The one start-up line: where, what, how."""
    draft = getattr(pipeline.draft, "name", None)
    models = f"{settings.model_id}" + (f" + draft {draft}" if draft else "")
    strategies = ",".join(pipeline.spec_types) or "none"
    key = "API key required" if settings.api_key else "no API key"
    return (
        f"specdecode serve: listening on {address(sock)}  model {models}  strategies {strategies}  "
        f"{settings.parallel} slots  {key}"
    )


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the slots (see the module's docstring)."""

    def __init__(self, app: FastAPI, **options) -> None:
        self.service = app.state.service
        grace = self.service.settings.shutdown_grace
        super().__init__(
            uvicorn.Config(app, timeout_graceful_shutdown=grace + CUT_MARGIN_S, access_log=False, **options)
        )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        slots = self.service.slots
        slots.close()  # before anything else: waiting requests get their 503 now
        draining = asyncio.ensure_future(slots.drain(self.service.settings.shutdown_grace))
        await super().shutdown(sockets)  # stops accepting, waits for the connections
        await draining


def run(pipeline: Pipeline, settings: ServerSettings, sock: socket.socket) -> None:
    """Serve until SIGTERM or SIGINT."""
    app = create_app(pipeline, settings)
    print(banner(sock, pipeline, settings), flush=True)
    try:
        Server(app, log_level="warning").run(sockets=[sock])
    finally:
        app.state.service.slots.shutdown()
        app.state.service.tokenizers.shutdown()
