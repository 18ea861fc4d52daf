"""Request bodies, validated strictly: OpenAI's endpoints and llama-server's own.

Strict types (no "5" for 5, no true for 1) and unknown fields refused, as the OpenAI API
refuses them: a misspelt parameter should fail loudly, not be ignored. Fields that are left
out take the server's defaults (its sampling flags). `model` may be left out: the server
serves one model. top_k and min_p are llama-server extensions, and so are its per-request
drafting settings, spelt as it spells them: keys with a dot (`"speculative.n_max": 4`).

Text fields refuse lone surrogates (`"\\ud800"` is valid JSON but no Unicode character):
the tokenizer cannot encode them, and the refusal names the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specdecode.constraints import ConstraintSpec

MAX_STOP_STRINGS = 4  # the OpenAI API's limit
MAX_NATIVE_STOP_STRINGS = 16  # llama-server has none; every stop string is checked at every step
MAX_CHOICES = 16  # n: each choice is a generation of its own
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat's top_logprobs
MAX_LEGACY_LOGPROBS = 5  # OpenAI's limit on completions' logprobs
MAX_N_PROBS = 100


def no_lone_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text holds a lone surrogate (\\u{ord(text[exc.start]):04x} at character {exc.start}), "
            "which is not a Unicode character"
        ) from None
    return text


Text = Annotated[str, AfterValidator(no_lone_surrogates)]
# OpenAI's {"token id": bias}, or llama-server's [[token id or text, bias]]; a bias of false bans
LogitBias = dict[Text, float | bool] | list[list[int | Text | float | bool]]
# One prompt: text, token ids, or text and ids mixed (llama-server's); a list of such prompts
# asks for several answers (see `server.prompts`).
Prompt = Text | list[Text | int | list[Text | int]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False  # True: a last chunk with `usage` and no choices, before [DONE]


class Speculative(Strict):
    """llama-server's per-request drafting settings, within the server's limits."""

    spec_n_max: int | None = Field(None, alias="speculative.n_max", ge=1)
    spec_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    spec_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)

    def draft_overrides(self) -> dict[str, Any]:
        given = {"n_max": self.spec_n_max, "n_min": self.spec_n_min, "p_min": self.spec_p_min}
        return {name: value for name, value in given.items() if value is not None}


class Sampling(Speculative):
    """The sampling fields every generating endpoint takes."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    logit_bias: LogitBias | None = None
    timings_per_token: bool = False  # llama-server's: every streamed chunk carries `timings`
    return_progress: bool = False  # llama-server's: a stream reports the prompt's evaluation

    def sampling_overrides(self) -> dict[str, Any]:
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def token_limit(self) -> int | None:
        raise NotImplementedError

    @property
    def top_n(self) -> int | None:
        """How many alternatives each token's probabilities list; None: no probabilities."""
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        raise NotImplementedError

    def unsupported(self) -> str | None:
        """The first field asking for something this server does not do, if any."""
        return None

    def constraint(self) -> tuple[ConstraintSpec, str] | None:
        """What the output must match, and the field that asked for it; None for free text."""
        return None


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`; `strict` is accepted either way, since the output
    always follows the schema."""

    name: Annotated[str, Field(max_length=64)] | None = None  # OpenAI's requires one; llama-server's not
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema; as in
    llama-server, the schema may also be given inline (`{"type": "json_object", "schema": ...}`,
    or `"json_schema"` with `schema`), and an empty one means any object."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    inline_schema: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError('"json_schema" is only allowed with type json_schema')
        if self.type == "json_schema" and (self.json_schema is None) == (self.inline_schema is None):
            raise ValueError('type json_schema needs "json_schema" (OpenAI\'s) or "schema", one of them')
        if self.type == "text" and self.inline_schema is not None:
            raise ValueError('"schema" is not allowed with type text')
        return self

    def constraint(self) -> ConstraintSpec | None:
        if self.type == "text":
            return None
        schema = self.json_schema.json_schema if self.json_schema is not None else self.inline_schema
        return ConstraintSpec("json_schema", json.dumps(schema)) if schema else ConstraintSpec.json_object()


class SamplingFields(Sampling):
    """What OpenAI's completions and chat requests share."""

    max_tokens: int | None = None  # None: up to the server's limit or the end of the context
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None
    grammar: Text | None = None  # llama-server's: GBNF (or Lark with a %llguidance header)
    json_schema: dict[str, Any] | None = None  # llama-server's; a JSON response_format wins over it
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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return None

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingFields:
        json_format = self.response_format is not None and self.response_format.type != "text"
        if self.grammar is not None and (self.json_schema is not None or json_format):
            raise ValueError("give grammar or a JSON schema (json_schema, response_format), not both")
        return self

    def constraint(self) -> tuple[ConstraintSpec, str] | None:
        spec = self.response_format.constraint() if self.response_format is not None else None
        if spec is not None:
            return spec, "response_format"
        if self.json_schema is not None:
            schema = self.json_schema or {"type": "object"}
            return ConstraintSpec("json_schema", json.dumps(schema)), "json_schema"
        if self.grammar is not None:
            return ConstraintSpec("grammar", self.grammar), "grammar"
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text, token ids, both mixed), or a list of prompts,
    each answered by a choice of its own."""

    prompt: Prompt

    @field_validator("logprobs")
    @classmethod
    def _legacy_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value is not None and (isinstance(value, bool) or not 0 <= value <= MAX_LEGACY_LOGPROBS):
            raise ValueError(f"completions take a number of alternatives in 0..{MAX_LEGACY_LOGPROBS}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _chat_only(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("top_logprobs is chat's; completions take logprobs: N")
        return value

    @property
    def top_n(self) -> int | None:
        return None if self.logprobs is None else int(self.logprobs)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
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
    add_generation_prompt: bool = True  # open an assistant turn after the messages
    continue_final_message: bool = False  # continue the last (assistant) message, left open

    @field_validator("logprobs")
    @classmethod
    def _chat_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value is not None and not isinstance(value, bool):
            raise ValueError("chat takes true or false (top_logprobs sets the alternatives)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class NativeCompletionRequest(Sampling):
    """POST /completion, llama-server's own: its field names and defaults."""

    prompt: Prompt
    n_predict: int = -1  # -1: up to the server's limit or the end of the context
    seed: int | None = Field(None, ge=-1)  # -1: a random seed, as llama-server's default
    stop: Annotated[list[Text], Field(max_length=MAX_NATIVE_STOP_STRINGS)] = []
    repeat_penalty: float | None = Field(None, gt=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    cache_prompt: bool = True  # False: the slot's cached prefix is dropped and the prompt evaluated anew
    return_tokens: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_N_PROBS)
    n_keep: int = Field(0, ge=-1)  # with --context-shift: the tokens a shift keeps (-1: the prompt)
    n_discard: int = Field(0, ge=0)  # with --context-shift: the tokens a shift drops (0: half)
    post_sampling_probs: bool = False  # probabilities the sampler drew from, not the softmax's
    # only these fields of the answer, "a/b" naming b inside a, under the path as its key
    response_fields: list[str] | None = None
    grammar: Text | None = None  # GBNF (or Lark with a %llguidance header)
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> NativeCompletionRequest:
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give grammar or json_schema, not both")
        return self

    def constraint(self) -> tuple[ConstraintSpec, str] | None:
        if self.grammar is not None:
            return ConstraintSpec("grammar", self.grammar), "grammar"
        if self.json_schema is not None:
            return ConstraintSpec("json_schema", json.dumps(self.json_schema)), "json_schema"
        return None

    def sampling_overrides(self) -> dict[str, Any]:
        overrides = super().sampling_overrides()
        if self.seed == -1:
            overrides["seed"] = None
        for name in ("repeat_penalty", "repeat_last_n"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        return overrides

    @property
    def token_limit(self) -> int | None:
        return None if self.n_predict == -1 else self.n_predict

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop)

    @property
    def top_n(self) -> int | None:
        return self.n_probs or None


class TokenizeRequest(Strict):
    """POST /tokenize (llama-server's)."""

    content: Text
    add_special: bool = False
    parse_special: bool = True  # False: special tokens' text is tokenized as plain text
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    """POST /detokenize (llama-server's)."""

    tokens: list[int]
