"""The server's settings and the `specdecode serve` flags that set them.

Kept apart from the HTTP stack (fastapi, uvicorn), which the command imports only to serve:
building the command line needs none of it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from specdecode.api import Pipeline


@dataclass(frozen=True)
class ServerSettings:
    model_id: str  # the name /v1/models lists and requests may give as "model"
    parallel: int = 4  # slots: generations running at once; more requests wait in a queue
    # for the fields a request leaves out: llama-server's, temperature 0.8 (the library's is greedy)
    sampling: SamplingParams = SamplingParams(temperature=0.8)
    verify: str = "match"
    max_tokens: int = 2048  # the most a request may ask for; also the default when it asks nothing
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None
    accept_any_model: bool = False  # True: any "model" a request names is served by the one model
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from ("*": any); none: no CORS
    shutdown_grace: float = 10.0  # seconds running generations get to finish at shutdown
    context_shift: bool = False  # at a full context, drop tokens and go on (llama-server's --context-shift)
    model_path: str = ""  # what /props reports (default: the model's name)
    # a prompt goes to the free slot whose cache holds more than this part of it (0: to the
    # least recently used), llama-server's --slot-prompt-similarity
    slot_prompt_similarity: float = 0.1

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise SpecdecodeError("--parallel must be >= 1")
        if self.max_tokens < 1:
            raise SpecdecodeError("--max-tokens-limit must be >= 1")
        if self.max_body_bytes < 1:
            raise SpecdecodeError("--max-body-bytes must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise SpecdecodeError("the API key is empty: give a key, or no --api-key for an open server")
        if self.shutdown_grace < 0:
            raise SpecdecodeError("--shutdown-grace must be >= 0")
        if not 0 <= self.slot_prompt_similarity <= 1:
            raise SpecdecodeError("--slot-prompt-similarity must be in 0..1")


DEFAULTS = ServerSettings(model_id="")
API_KEY_VARIABLE = "SPECDECODE_API_KEY"


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
    group.add_argument(
        "--context-shift",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.context_shift,
        help="at a full context, drop tokens after n_keep and go on, as llama-server (default: stop there)",
    )
    group.add_argument(
        "-sps",
        "--slot-prompt-similarity",
        type=float,
        default=DEFAULTS.slot_prompt_similarity,
        metavar="SIMILARITY",
        help="send a prompt to the free slot whose cache holds more than this part of it, else to the "
        "least recently used (0: always the least recently used)",
    )


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
        context_shift=args.context_shift,
        model_path=str(args.model),
        slot_prompt_similarity=args.slot_prompt_similarity,
    )
