"""Request bodies, validated strictly before anything runs.

Strict means: a wrong JSON type is an error (no "3" for 3, no true for 1), unknown fields are errors (a typo such
as `max_token` would otherwise be silently ignored and the request run with defaults), and NaN/Infinity are
refused. The fields the official clients send are all declared, including those accepted only to be ignored
(`user`, `metadata`, `store`, ...), so those clients work unchanged. Limits that depend on the server's options
(prompt length, max_tokens) and features that are declared but not supported (n > 1, logprobs) are checked by the
endpoint, which can name the option in its message.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strata.serve.errors import ApiError

Reason = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# Template variables a client may set through chat_template_kwargs: JSON scalars only, so a request cannot hand
# the template structures it would iterate over for a long time.
TemplateValue = str | int | float | bool | None


class Strict(BaseModel):
    """Base of every request model: strict types, no unknown fields, finite numbers only."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# --- OpenAI -----------------------------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """One message. `reasoning_content` is accepted so a client can send a reply back as it received it;
    `refusal`, `annotations`, `audio` and `function_call` appear when the OpenAI SDK echoes a response message and
    are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(Strict):
    """Sampling fields both OpenAI endpoints share; top_k, min_p and repetition_penalty are the extensions
    vLLM and llama.cpp accept too."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: int | None = None
    user: str | None = None


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Reason | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# --- Anthropic --------------------------------------------------------------------------------------------------

class ATextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class AThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ARedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class AToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ATextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


ABlock = Annotated[ATextBlock | AThinkingBlock | ARedactedThinkingBlock | AToolUseBlock | AToolResultBlock,
                   Field(discriminator="type")]


class AMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ABlock]


class ATool(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class AOutputConfig(Strict):
    effort: Reason | None = None
    format: dict[str, Any] | None = None


class AMetadata(Strict):
    user_id: str | None = None


class MessagesRequest(Strict):
    model: str
    max_tokens: int
    messages: Annotated[list[AMessage], Field(min_length=1)]
    system: str | list[ATextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None
    output_config: AOutputConfig | None = None
    metadata: AMetadata | None = None
    service_tier: str | None = None


# --- parsing ----------------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes, model: type[M]) -> M:
    """The request body as `model`, or a 400 ApiError that says which field is wrong and why (never echoing
    the field's value back: it may be huge)."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise ApiError(400, f"the request body is not valid JSON: {detail[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{loc}: {err['msg']}")
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        first = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
        raise ApiError(400, "invalid request: " + "; ".join(parts) + more, param=first) from None
    except RecursionError:
        raise ApiError(400, "invalid request: the body is nested too deeply") from None
