"""Request bodies of the embedded server, validated completely at the boundary.

Every field the server reads is typed and bounded (strict types: ``"1"`` is not a number, ``true`` is
not an integer); a body that fails is refused with an OpenAI-shaped 400 naming the field. Unknown
top-level fields are ignored, as vLLM and OpenAI-compatible servers do, so clients that send extra
options keep working. Penalties are checked against their OpenAI ranges but only their neutral
values are served: the sampler applies none, and the reported log-probs must be what was sampled from.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..engine.types import MAX_SEED

MAX_INT32 = 2**31 - 1
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary served; the engine checks against its own


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# -- messages ---------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


Content = Union[str, list[TextPart]]


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[Annotated[Union[TextPart, RefusalPart], Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _has_something(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, max_length=256)
    name: str | None = None


Message = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")
]


def text_of(content) -> str:
    """The text of a message's content: a string, or its text (and refusal) parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


# -- tools ------------------------------------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# -- request bodies ---------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingBody(_Strict):
    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)  # vLLM uses -1 for "off"; so does 0 here
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # vLLM's sampling parameter: sample only among these token ids (the engine checks them against
    # its vocabulary); the reported log-probs are those of the masked distribution.
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    n: int = Field(default=1, ge=1, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Many clients send every option, unset ones as null: null is the default, as in vLLM.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _neutral_penalty(cls, value: float, info: ValidationInfo) -> float:
        neutral = 1.0 if info.field_name == "repetition_penalty" else 0.0
        if value != neutral:
            raise ValueError(f"only {neutral} is supported: the sampler applies no penalties, so the "
                             "log-probs it reports are those it sampled from")
        return value


class ChatRequest(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools")
        if choice not in (None, "none") and not tools:
            raise ValueError("tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names function {choice.function.name!r}, which is not among tools")
        return choice


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class LoadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=256)


class MessageError(ValueError):
    """A message that validates but cannot be rendered; ``param`` is the field's path."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def template_messages(messages: list) -> list[dict]:
    """The messages as Hugging Face chat templates take them: text content, ``developer`` as
    ``system``, tool-call arguments as objects (templates write them with ``tojson``, as vLLM
    passes them), tool results with their ``tool_call_id`` and the called function's name.
    Raises ``MessageError`` for arguments nested too deeply to parse."""
    import json

    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        d = {"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
        if isinstance(m, AssistantMessage) and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                except RecursionError:  # a refusal, not a 500; the recursion limit stays as it is
                    raise MessageError("tool call arguments are nested too deeply to parse",
                                       f"messages.{i}.tool_calls.{j}.function.arguments") from None
                names[c.id] = c.function.name
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        elif isinstance(m, ToolMessage):
            d["tool_call_id"] = m.tool_call_id
            if m.name or m.tool_call_id in names:
                d["name"] = m.name or names[m.tool_call_id]
        out.append(d)
    return out
