"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Only what the server implements is modelled. Unknown request fields are ignored (as
OpenAI clients send extras such as `user`); known fields are type-checked, and fields
we accept for compatibility but cannot honour (`n > 1`, `stop` strings, penalties, ...)
are rejected by `unsupported_fields()` with a 400 rather than silently dropped.
Integer fields are strict (`true` is not 1); float fields accept JSON integers.
"""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# ---------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: Optional[StrictStr] = None
    temperature: Optional[float] = None  # None: 1.0, as in OpenAI
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None  # vLLM extension; 0 or -1 disables
    seed: Optional[StrictInt] = None
    stop_token_ids: Optional[list[StrictInt]] = None  # vLLM extension
    ignore_eos: StrictBool = False  # vLLM extension
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[StrictStr] = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to something this server cannot do."""
        problems: list[tuple[str, str]] = []
        if self.n != 1:
            problems.append(("n", f"n={self.n} is not supported; only n=1"))
        if self.stop:
            problems.append(("stop", "stop strings are not supported; use stop_token_ids"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value:
                problems.append((name, f"{name}={value} is not supported; only 0"))
        if self.logit_bias:
            problems.append(("logit_bias", "logit_bias is not supported"))
        return problems


CompletionPrompt = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = super().unsupported_fields()
        if self.echo:
            problems.append(("echo", "echo is not supported"))
        if self.best_of not in (None, 1):
            problems.append(("best_of", f"best_of={self.best_of} is not supported; only 1"))
        if self.suffix:
            problems.append(("suffix", "suffix is not supported"))
        return problems


class TextContentPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: StrictStr
    content: Optional[Union[StrictStr, list[TextContentPart]]] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None  # None: whatever the context leaves
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True  # vLLM extension


# ------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tp-runtime"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(BaseModel):
    """OpenAI completions style: one entry per generated token in every list."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


LogprobsT = TypeVar("LogprobsT", bound=BaseModel)
ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Choice(BaseModel, Generic[LogprobsT]):
    """What every choice carries; each kind adds its output (`text`, `message` or `delta`)."""

    index: int = 0
    logprobs: Optional[LogprobsT] = None
    finish_reason: Optional[str] = None


class _Response(BaseModel, Generic[ChoiceT]):
    """What every response and stream chunk carries; each kind fixes `object` (a
    redeclared field keeps its place, so the JSON key order stays OpenAI's)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: Optional[UsageInfo] = None


class CompletionChoice(_Choice[CompletionLogProbs]):
    text: str


class CompletionResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(_Choice[ChatChoiceLogprobs]):
    message: ChatResponseMessage


class ChatCompletionResponse(_Response[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo  # a whole (not streamed) chat response always reports it


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(_Choice[ChatChoiceLogprobs]):
    delta: DeltaMessage


class ChatCompletionStreamResponse(_Response[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


def dump(model: BaseModel) -> dict[str, Any]:
    """`model` as a JSON-ready dict (the body of every response and SSE event)."""
    return model.model_dump(mode="json")
