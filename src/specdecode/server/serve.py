"""Start-up of `specdecode serve`: the listening socket, the banner, uvicorn, and the
shutdown (its flags are in `settings`).

The socket is bound before the models load, so a port in use fails at once with one
`error:` line rather than after loading. On SIGTERM or SIGINT the server stops accepting,
answers requests still waiting for a slot with 503, lets running generations finish for
--shutdown-grace seconds, then cuts the rest (a stream gets an error event and [DONE]); a
second signal cuts them at once, a third stops waiting for their answers. Both signals drain
alike, and the process then ends by the signal that stopped it, as a program without handlers
would (the shell's status 130 for SIGINT, 143 for SIGTERM; a clean stop for systemd):
llama-server exits 0 instead, and uvicorn raises the signal again before the server's own
clean-up, which turned SIGINT into a KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from types import FrameType

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
        self.signals: list[int] = []  # SIGINT and SIGTERM received, in order

    @property
    def stopped_by(self) -> int | None:
        """The signal that started the shutdown."""
        return self.signals[0] if self.signals else None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGINT and SIGTERM alike: the first starts the shutdown, a second cuts the running
        generations, a third stops waiting for their answers. Unlike uvicorn's own handler, the
        signal is not raised again at the end of `run` (see `end_by_signal`)."""
        self.signals.append(sig)
        self.should_exit = True
        self.force_exit = len(self.signals) > 2

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        slots = self.service.slots
        slots.close()  # before anything else: waiting requests get their 503 now
        # super().shutdown stops accepting and waits for the connections, which end as the
        # drain lets their generations finish or cuts them.
        await asyncio.gather(self._drain(), super().shutdown(sockets))

    async def _drain(self) -> None:
        """The slots' drain for the grace, cut short by a second signal."""
        slots = self.service.slots
        draining = asyncio.ensure_future(slots.drain(self.service.settings.shutdown_grace))
        while not draining.done():
            if len(self.signals) > 1:
                draining.cancel()
                await slots.drain(0)
                return
            await asyncio.wait([draining], timeout=0.05)


def run(pipeline: Pipeline, settings: ServerSettings, sock: socket.socket) -> None:
    """Serve until SIGTERM or SIGINT."""
    app = create_app(pipeline, settings)
    server = Server(app, log_level="warning")
    # Handled from before the banner, which tells clients the server is up: a signal that comes
    # before uvicorn installs its handlers stops the server as one that comes after does.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    print(banner(sock, pipeline, settings), flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        app.state.service.slots.shutdown()
        app.state.service.tokenizers.shutdown()
    if server.stopped_by is not None:
        end_by_signal(server.stopped_by)


def end_by_signal(sig: int) -> None:
    """End the process by `sig` with its default action (termination), once the drain is done:
    its parent sees how it ended (a shell prints 128 + the signal's number), and no thread still
    stopping keeps it alive."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)
