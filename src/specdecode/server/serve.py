"""Start-up of `specdecode serve`: its flags, the listening socket, the banner, uvicorn.

The socket is bound before the models load, so a port in use fails at once with one
`error:` line rather than after loading.
"""

from __future__ import annotations

import argparse
import os
import socket

import uvicorn

from specdecode.api import Pipeline
from specdecode.errors import SpecdecodeError
from specdecode.sampling import SamplingParams
from specdecode.server.app import ServerSettings, create_app

DEFAULTS = ServerSettings(model_id="")
API_KEY_VARIABLE = "SPECDECODE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5


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
        api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
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


def run(pipeline: Pipeline, settings: ServerSettings, sock: socket.socket) -> None:
    """Serve until interrupted."""
    app = create_app(pipeline, settings)
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False
    )
    print(banner(sock, pipeline, settings), flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.service.slots.shutdown()
