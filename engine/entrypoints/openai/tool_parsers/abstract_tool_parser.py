"""`ToolParser`: tool calls out of a model's text (vLLM's `vllm/tool_parsers`), whole
or streamed, and the registry of parsers by the name `--tool-call-parser` takes.

The chat handler builds one parser per choice of a request (it holds that choice's
stream state) and calls it on the event loop. A subclass writes only `parse(text,
finished)`: the calls and the text around them in the output so far. The base class
turns that into vLLM's two calls:

* `extract_tool_calls(model_output, request)`: the whole output's calls, or none and
  the output as content when a call does not parse (as vLLM answers);
* `extract_tool_calls_streaming(previous_text, current_text, delta_text, ...)`: what
  the new text adds: content, a call's id and name (its first piece), then its
  arguments in pieces. Each call's arguments are the model's own JSON text, so the
  pieces join into exactly the whole response's `arguments`.

Content is the text outside the calls (None when blank); a stream holds back blank
text and a tail that may be the start of a call's tag until it knows which it is.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
)
from engine.parser_registry import ParserRegistry


def make_tool_call_id() -> str:
    """vLLM's tool call id: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedCall:
    """One call as read so far: its name once whole, its arguments' JSON text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """An output as read so far. ``valid`` is False once it cannot be what the format
    says (then the whole output is content)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    valid: bool = True


@dataclass
class ExtractedToolCallInformation:
    """vLLM's result of a whole output: whether calls were made, the calls, the content."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


@dataclass
class DeltaToolMessage:
    """What one streamed step adds: content text and call pieces."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class _SentCall:
    id: str
    arguments: int = 0


def call_from_object(values: dict[str, str], finished: set[str], complete: bool,
                     arguments_keys: Sequence[str] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from an object read by `partial_json.read_object`: ``name`` and the first
    of ``arguments_keys`` (``{}`` when a finished call has none). None when the finished
    object has no string name."""
    name = None
    if "name" in finished:
        decoded = json.loads(values["name"])
        name = decoded if isinstance(decoded, str) else None
    if complete and name is None:
        return None
    key = next((k for k in arguments_keys if k in values), None)
    arguments = values[key] if key is not None else ("{}" if complete else "")
    return ParsedCall(name, arguments, complete)


class ToolParser:
    """Base class of the tool parsers; see the module docstring for the contract."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._content_sent = 0
        self._calls_sent: list[_SentCall] = []

    def adjust_request(self, request: Any) -> Any:
        """Change what the request asks of the engine, before it is sent (Mistral's
        parser needs its special tokens in the text); the default changes nothing."""
        return request

    def structural_tag(self, tools: list[FunctionDefinition]) -> dict[str, Any] | None:
        """An xgrammar structural tag that makes every call of this format parse and
        pins the arguments of the tools marked ``strict`` (vLLM's default
        ``--tool-strict-level auto``); None when the format has no trigger to hang it on."""
        return None

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        """The calls and content in ``text``; ``finished`` says the output is whole."""
        raise NotImplementedError

    def _parsed(self, text: str, finished: bool) -> ParsedOutput:
        parsed = self.parse(text, finished)
        if finished and any(not call.complete for call in parsed.calls):
            parsed.valid = False  # cut off in the middle of a call
        if finished:
            for call in parsed.calls:
                try:
                    json.loads(call.arguments)
                except json.JSONDecodeError:
                    parsed.valid = False
        return parsed if parsed.valid else ParsedOutput(content=text)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        """The whole output's calls; a call that does not parse makes it all content."""
        parsed = self._parsed(model_output, True)
        calls = [ToolCall(id=make_tool_call_id(), function=FunctionCall(name=call.name or "",
                                                                        arguments=call.arguments))
                 for call in parsed.calls]
        content = parsed.content if parsed.content.strip() else None
        return ExtractedToolCallInformation(bool(calls), calls, content)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request: Any = None, *,
                                     finished: bool = False) -> DeltaToolMessage | None:
        """What ``current_text`` adds to what this parser has streamed so far (it keeps
        that state, so call it with every step of one output in order); None when
        nothing new is certain yet. ``finished`` (the last call) releases held text."""
        parsed = self.parse(current_text, finished)
        if not parsed.valid and not self._calls_sent:
            parsed = ParsedOutput(content=current_text)  # not calls after all: all content
        delta = DeltaToolMessage()
        content = parsed.content
        shown = (content if content.strip() else "") if finished else content[:len(content.rstrip())]
        if len(shown) > self._content_sent:
            delta.content = shown[self._content_sent:]
            self._content_sent = len(shown)
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            piece = None
            if index == len(self._calls_sent):
                self._calls_sent.append(_SentCall(make_tool_call_id()))
                piece = DeltaToolCall(index=index, id=self._calls_sent[index].id, type="function",
                                      function=DeltaFunctionCall(name=call.name, arguments=""))
            sent = self._calls_sent[index]
            if len(call.arguments) > sent.arguments:
                piece = piece or DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=""))
                assert piece.function is not None
                piece.function.arguments = call.arguments[sent.arguments:]
                sent.arguments = len(call.arguments)
            if piece is not None:
                delta.tool_calls.append(piece)
        return delta if delta.content is not None or delta.tool_calls else None

    @property
    def streamed_calls(self) -> int:
        """How many calls this parser's stream has begun."""
        return len(self._calls_sent)


class ToolParserManager:
    """Tool parsers by the name `--tool-call-parser` takes (vLLM's names)."""

    _registry: ClassVar[ParserRegistry[ToolParser]] = ParserRegistry("tool call parser")
    tool_parsers = _registry.parsers
    register_module = _registry.register_module
    get_tool_parser = _registry.get
