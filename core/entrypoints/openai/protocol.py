"""Request and response bodies of the OpenAI API subset we serve (pydantic models).

Field constraints here are the first line of validation: a value outside them becomes a
400 in the OpenAI error shape (see ``errors.py``) and they appear in ``/openapi.json``.
Request models are *strict* (as OpenAI's API is): ``"10"`` is not an integer, ``true`` is not
a token id, ``"yes"`` is not a boolean; only an integer may stand for a float. Every text
field is a :data:`Text`, which refuses lone UTF-16 surrogates (``"\\ud800"`` is valid JSON
but no tokenizer can encode it). Limits that depend on the running server (prompt length,
``max_tokens`` room, ``n`` against ``--max-num-seqs``) are checked in ``serving.py``.
Fields marked *extension* are not in OpenAI's API; they follow vLLM's names so clients
written for vLLM keep working (send them with the openai client's ``extra_body``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from core.entrypoints.openai.tool_parsers.base import DeltaToolCall, ToolCall

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_INT = 2**63 - 1
"""Largest integer any count field takes (JSON clients and our int64 tensors agree on it)."""


def _valid_unicode(text: str) -> str:
    # json.loads turns "\ud800" into a lone surrogate: a str that cannot be UTF-8 encoded,
    # so the tokenizer would fail deep inside with its own message.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate {text[e.start]!r} at character {e.start}; "
                         "send valid Unicode (pair the surrogate or remove it)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyStr = Annotated[Text, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,19}$")], Annotated[float, Field(ge=-100, le=100)]],
    # pydantic writes key patterns as patternProperties, which still allows any other key;
    # propertyNames says what the server enforces: every key is a token id.
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,19}$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
]


class StrictModel(BaseModel):
    """Base of every request body: no type coercion (see the module docstring)."""

    # Unknown nested fields are refused (a 400 naming them), never dropped silently; only
    # the top level of a request body is lenient (SamplingRequest).
    model_config = ConfigDict(strict=True, extra="forbid")


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared request fields -------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool = False
    """Send a last chunk (with empty ``choices``) carrying the request's token usage."""


class SamplingRequest(StrictModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    # Unknown top-level fields are accepted and ignored (as vLLM does); the log and the
    # response header X-Ignored-Fields name them (docs/serving.md, "Request fields").
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text | None = Field(None, description="Served model name; omitted means the served model.")
    n: int = Field(1, ge=1, le=128, description="Samples per prompt.")
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) -> bias added to its logit.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Same seed, same samples.")
    user: Text | None = Field(None, description="End-user id; only logged.")
    # extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT, description="extension: keep the k likeliest tokens (-1 off)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension")
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="extension")
    min_tokens: int = Field(0, ge=0, le=MAX_INT, description="extension: no EOS/stop before this many tokens")
    ignore_eos: bool = Field(False, description="extension: keep generating after EOS")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = Field(
        None, description="extension"
    )
    include_stop_str_in_output: bool = Field(False, description="extension")
    skip_special_tokens: bool = Field(True, description="extension")
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="extension: lower runs first (--scheduling-policy priority)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="extension: top logprobs of every prompt token")
    # structured output (docs/structured_output.md): at most one of these per request
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'schema': ..., 'strict': ...}}")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="extension: exactly one of json, regex, choice, grammar, json_object")
    guided_json: dict[str, Any] | Text | None = Field(None, description="extension (older vLLM name)")
    guided_regex: Text | None = Field(None, description="extension (older vLLM name)")
    guided_choice: list[Text] | None = Field(None, description="extension (older vLLM name)")
    guided_grammar: Text | None = Field(None, description="extension (older vLLM name)")
    guided_decoding_backend: Text | None = Field(None, description="extension: only 'auto' / 'guidance'")
    guided_whitespace_pattern: Text | None = Field(None, description="extension: not supported, must be null")


# ---- /v1/completions -------------------------------------------------------------------------
PromptType = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class CompletionRequest(SamplingRequest):
    prompt: PromptType
    max_tokens: Count | None = Field(16, description="Most tokens per sample; null = up to max_model_len. "
                                     "More than the model's room (max_model_len - prompt tokens) is a 400.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Top logprobs per token.")
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")
    suffix: Text | None = Field(None, description="Not supported; must be null.")
    best_of: int | None = Field(None, ge=1, le=128, description="Only best_of == n is supported.")


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's layout of one token's prompt logprob."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Field(None, description="extension: the stop string or token id that matched")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="extension: with prompt_logprobs, per prompt token (None for the first)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- /v1/chat/completions --------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionCallIn(StrictModel):
    name: NonEmptyStr
    arguments: Text
    """JSON text of the arguments object (as OpenAI returns it)."""


class ToolCallIn(StrictModel):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant turns: the calls it made")
    tool_call_id: Text | None = Field(None, description="tool turns: the call this answers")
    reasoning_content: Text | None = Field(None, description="extension: assistant turns' reasoning, for templates that show it")


class FunctionDef(StrictModel):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: NonEmptyStr


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Count | None = Field(None, description="Deprecated by OpenAI; use max_completion_tokens.")
    max_completion_tokens: Count | None = Field(None, description="More than the model's room is a 400.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default 'auto' with tools; 'required' and a named function are enforced by a grammar.")
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call per choice")
    add_generation_prompt: bool = Field(True, description="extension")
    continue_final_message: bool = Field(
        False, description="extension: continue the last (assistant) message instead of starting a new one")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension: extra variables for the chat template (e.g. enable_thinking)")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="extension: with --reasoning-parser")
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="extension")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="extension: with prompt_logprobs, per prompt token (None for the first)")


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- /v1/models ------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "core"
    root: str | None = Field(None, description="extension: the model's file or directory name (never a full path)")
    max_model_len: int | None = Field(None, description="extension")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
