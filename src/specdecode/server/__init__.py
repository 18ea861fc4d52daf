"""`specdecode serve`: an OpenAI-compatible HTTP server with speculative decoding.

`create_app` loads the HTTP stack (fastapi, the `server` extra) on first use, so the package
and its settings import without it.
"""

from __future__ import annotations

from typing import Any

from specdecode.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from specdecode.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
