"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Every field that vLLM's completions and chat requests know is declared here, and is
either honoured or, when set to anything but its default, refused with a 400 naming it
(`unsupported_fields()`); nothing vLLM knows is silently dropped. Fields vLLM does not
know either are kept in `model_extra` and logged once per request by the handler, as
vLLM does. An explicit `null` means the field's default. Integer fields are strict
(`true` is not 1); float fields accept JSON integers.
"""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from engine.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall

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
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def ignored_fields(self) -> list[str]:
        """Fields vLLM does not know either: ignored, and logged by the handler."""
        return sorted(self.model_extra or {})


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage in every chunk


def _refused(problems: list[tuple[str, str]], request: BaseModel, defaults: dict[str, Any], why: str) -> None:
    for name, default in defaults.items():
        value = getattr(request, name)
        if value != default and not (default is None and value in ([], {}, "")):
            problems.append((name, f"{name}={value!r} is not supported: {why}"))


# Fields that need what this server does not have, by what they need. Set to anything
# but the value on the right, each is a 400 that names it.
_NO_BEAM_SEARCH = {"use_beam_search": False, "length_penalty": 1.0}
_NO_LOGITS_PROCESSORS = {"logits_processors": None}
_NO_MULTIMODAL = {"prompt_embeds": None, "mm_payload": None, "return_mm_kwargs": None}
_NO_DISAGGREGATION = {"kv_transfer_params": None, "ec_transfer_params": None, "session_id": None}
_NO_EXTENSIONS = {"watermarking": None, "logprob_token_ids": None, "vllm_xargs": None, "repetition_detection": None,
                  "thinking_token_budget": None, "routed_experts_prompt_start": 0, "return_token_offsets": None,
                  "stream_interval": None}


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: Optional[StrictStr] = None
    temperature: Optional[float] = None  # None: the generation config's, else 1.0
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None  # 0 or -1 disables
    min_p: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr]] = Field(default_factory=list)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    logit_bias: dict[str, float] = Field(default_factory=dict)
    min_tokens: StrictInt = 0
    allowed_token_ids: Optional[list[StrictInt]] = None
    bad_words: list[StrictStr] = Field(default_factory=list)
    prompt_logprobs: Optional[StrictInt] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: Optional[StrictInt] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    user: Optional[StrictStr] = None  # an end-user id for the caller's own records, as in OpenAI
    priority: StrictInt = 0
    request_id: Optional[StrictStr] = None
    cache_salt: Optional[StrictStr] = None
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    # Honoured (structured_outputs_request.py); the guided_* fields are refused there.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[Any] = None
    # Refused unless at their defaults (see unsupported_fields):
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    logits_processors: Optional[Any] = None
    prompt_embeds: Optional[Any] = None
    mm_payload: Optional[Any] = None
    return_mm_kwargs: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    ec_transfer_params: Optional[Any] = None
    session_id: Optional[Any] = None
    watermarking: Optional[Any] = None
    logprob_token_ids: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    repetition_detection: Optional[Any] = None
    thinking_token_budget: Optional[Any] = None
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Optional[Any] = None
    stream_interval: Optional[Any] = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to something this server cannot do."""
        from engine.entrypoints.openai.structured_outputs_request import structured_output_problems

        problems = structured_output_problems(self)  # guided_*, and a constraint of the wrong shape
        _refused(problems, self, _NO_LOGITS_PROCESSORS, "logits processors by name are not implemented")
        _refused(problems, self, _NO_BEAM_SEARCH, "beam search is not implemented")
        _refused(problems, self, _NO_MULTIMODAL, "this server serves text-only models")
        _refused(problems, self, _NO_DISAGGREGATION, "disaggregated serving is not implemented")
        _refused(problems, self, _NO_EXTENSIONS, "this extension is not implemented")
        if self.stream_interval == 1:
            problems[:] = [p for p in problems if p[0] != "stream_interval"]
        if not self.spaces_between_special_tokens:
            problems.append(("spaces_between_special_tokens",
                             "spaces_between_special_tokens=false is not supported (fast tokenizers decode "
                             "special tokens without added spaces either way)"))
        if self.priority != 0:
            problems.append(("priority", f"priority={self.priority} is not supported: the scheduler is "
                                         "first-come first-served (priority scheduling is not enabled)"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed when stream is true"))
        return problems


CompletionPrompt = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt
    max_tokens: StrictInt = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None
    add_special_tokens: StrictBool = True

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = super().unsupported_fields()
        if self.suffix:
            problems.append(("suffix", "suffix is not supported: it needs a fill-in-the-middle model"))
        return problems


class ChatMessage(_Request):
    role: StrictStr
    content: Optional[Union[StrictStr, list[dict[str, Any]]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[Any]] = None  # an assistant's calls (checked by chat_messages.py)
    tool_call_id: Optional[StrictStr] = None  # a tool result's call
    reasoning: Optional[StrictStr] = None  # an assistant's thinking, for templates that render it
    reasoning_content: Optional[StrictStr] = None  # the same, under its older name

    def text(self) -> str:
        """The message's text; raises ValueError for a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported: this server serves "
                                 "text-only models; send {'type': 'text', 'text': ...} parts")
            texts.append(part["text"])
        return "".join(texts)


_NO_TOOLS = {"reasoning_effort": None, "documents": None, "media_io_kwargs": None, "mm_processor_kwargs": None,
             "return_prompt_text": None}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None  # None: whatever the context leaves
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the chat template renders the specials itself
    chat_template: Optional[StrictStr] = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Tool calling: checked by protocol_tools.resolve_tools (a 400 naming tools[i]... or tool_choice).
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # false: no `reasoning` in the reply (with --reasoning-parser)
    # Refused unless at their defaults:
    reasoning_effort: Optional[Any] = None
    documents: Optional[Any] = None
    media_io_kwargs: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    return_prompt_text: Optional[Any] = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        problems = super().unsupported_fields()
        _refused(problems, self, _NO_TOOLS, "reasoning effort, documents and multimodal input are not implemented")
        if self.chat_template is not None:
            problems.append(("chat_template", "a chat template in the request is not accepted (running "
                                              "client-sent templates needs vLLM's --trust-request-chat-template); "
                                              "start the server with --chat-template instead"))
        if self.continue_final_message and self.add_generation_prompt:
            problems.append(("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                                                       "both be true; set add_generation_prompt to false"))
        return problems


# ------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: Optional[int] = None  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None  # with --enable-prompt-tokens-details


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
    """OpenAI completions style: one entry per token in every list (echoed prompt
    tokens first, the first of which has no logprob)."""

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


class Logprob(BaseModel):
    """vLLM's prompt-logprob entry: one per token id."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = list[Optional[dict[str, Logprob]]]

LogprobsT = TypeVar("LogprobsT", bound=BaseModel)
ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Choice(BaseModel, Generic[LogprobsT]):
    """What every choice carries; each kind adds its output (`text`, `message` or `delta`)."""

    index: int = 0
    logprobs: Optional[LogprobsT] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


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
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids
    token_ids: Optional[list[int]] = None  # with return_token_ids


class CompletionResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None  # with --reasoning-parser (vLLM 0.32's name)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Choice[ChatChoiceLogprobs]):
    message: ChatResponseMessage
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionResponse(_Response[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo  # a whole (not streamed) chat response always reports it
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionStreamChoice(_Choice[ChatChoiceLogprobs]):
    delta: DeltaMessage
    token_ids: Optional[list[int]] = None  # with return_token_ids: this chunk's


class ChatCompletionStreamResponse(_Response[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


def dump(model: BaseModel) -> dict[str, Any]:
    """`model` as a JSON-ready dict (the body of every response and SSE event); the
    optional vLLM extras (prompt logprobs, token ids) appear only when set. They live on
    a response and its choices only, so only those are looked at (not the logprobs)."""
    data = model.model_dump(mode="json")
    _drop_unset_extras(data)
    for choice in data.get("choices") or ():
        _drop_unset_extras(choice)
    return data


_EXTRAS = ("prompt_logprobs", "prompt_token_ids", "token_ids")


def _drop_unset_extras(data: dict[str, Any]) -> None:
    for key in _EXTRAS:
        if key in data and data[key] is None:
            del data[key]
