"""Start-up of `specdecode serve`: its flags, the listening socket, the banner, uvicorn,
and the shutdown.

The socket is bound before the models load, so a port in use fails at once with one
`error:` line rather than after loading. On SIGTERM or SIGINT the server stops accepting,
answers requests still waiting for a slot with 503, lets running generations finish for
--shutdown-grace seconds, then cuts the rest (a stream gets an error event and [DONE]).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

import uvicorn
from fastapi import FastAPI

from specdecode.api import Pipeline
from specdecode.errors import SpecdecodeError
from specdecode.sampling import SamplingParams
from specdecode.server.app import ServerSettings, create_app

DEFAULTS = ServerSettings(model_id="")
API_KEY_VARIABLE = "SPECDECODE_API_KEY"
CUT_MARGIN_S = 5  # after the grace: for cut generations to end their current step and streams


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    group.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=DEFAULTS.parallel,
        help="requests generated at once (slots sharing the weights); more wait in a queue",
    )
    group.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every path but /health (default: ${API_KEY_VARIABLE})",
    )
    group.add_argument("--alias", help="model id served in /v1/models (default: the target's directory name)")
    group.add_argument(
        "--max-tokens-limit",
        type=int,
        default=DEFAULTS.max_tokens,
        help="largest max_tokens a request may ask; requests without one generate up to it",
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes, help="largest request body accepted"
    )
    group.add_argument(
        "--accept-any-model",
        action="store_true",
        help="serve requests whatever model they name (for clients that hard-code one); default: 404",
    )
    group.add_argument(
        "--cors",
        action="append",
        metavar="ORIGIN",
        help="let browsers call from ORIGIN (repeat or comma-separate; '*': any); default: no CORS",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULTS.shutdown_grace,
        metavar="SECONDS",
        help="on SIGTERM, how long running generations may go on before they are cut",
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket, or a SpecdecodeError that says why not."""
    if not 0 <= port <= 65535:
        raise SpecdecodeError(f"--port must be in 0..65535 (got {port})")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise SpecdecodeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def settings_from_args(
    args: argparse.Namespace, pipeline: Pipeline, sampling: SamplingParams
) -> ServerSettings:
    return ServerSettings(
        model_id=args.alias or pipeline.target.name,
        parallel=args.parallel,
        sampling=sampling,
        verify=args.verify,
        max_tokens=args.max_tokens_limit,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE),
        accept_any_model=args.accept_any_model,
        cors_origins=tuple(origin.strip() for given in args.cors or () for origin in given.split(",")),
        shutdown_grace=args.shutdown_grace,
        model_path=str(args.model),
    )


def banner(sock: socket.socket, pipeline: Pipeline, settings: ServerSettings) -> str:
    """The one start-up line: where, what, how."""
    host, port = sock.getsockname()[:2]
    address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    draft = getattr(pipeline.draft, "name", None)
    models = f"{settings.model_id}" + (f" + draft {draft}" if draft else "")
    strategies = ",".join(pipeline.spec_types) or "none"
    key = "API key required" if settings.api_key else "no API key"
    return (
        f"specdecode serve: listening on {address}  model {models}  strategies {strategies}  "
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
