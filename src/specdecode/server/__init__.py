"""`specdecode serve`: an OpenAI-compatible HTTP server with speculative decoding."""

from specdecode.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
