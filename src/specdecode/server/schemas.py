"""Request bodies of the OpenAI-compatible endpoints, validated strictly.

Strict types (no "5" for 5, no true for 1) and unknown fields refused, as the OpenAI API
refuses them: a misspelt parameter should fail loudly, not be ignored. Fields that are left
out take the server's defaults (its sampling flags). `model` may be left out: the server
serves one model. top_k and min_p are llama-server extensions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 4  # the OpenAI API's limit


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = True  # the last chunk always carries usage; accepted for compatibility


class SamplingFields(BaseModel):
    """What completions and chat requests share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None  # None: up to the server's limit or the end of the context
    temperature: float | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as a label for the caller's own logs

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are given

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
