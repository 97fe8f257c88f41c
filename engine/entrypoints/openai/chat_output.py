"""One chat choice's output as the client sees it: the thinking apart (the reasoning
parser), then the tool calls out of the answer (a tool parser, or the reader of a
constrained tool choice), whole or streamed.

The chat handler builds one `ChoiceOutputParser` per choice of a request, on the event
loop, and feeds it that choice's text in order; it holds the stream's state, so it is
never shared. Streamed pieces join into exactly the whole message: the reasoning and
content texts, and each call's arguments (the model's own JSON text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall
from engine.entrypoints.openai.tool_parsers import ToolParser
from engine.reasoning import ReasoningParser


@dataclass
class ChoiceMessage:
    """A whole choice's parts: thinking, answer text, calls (each None or empty when absent)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """What one streamed step of a choice adds."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.reasoning is not None or self.content is not None or bool(self.tool_calls)


class ChoiceOutputParser:
    """Splits one choice's text. ``reasoning_parser`` is None when the server has none,
    the prompt already closed the thinking, or the output is constrained from its first
    token; ``include_reasoning`` False drops the thinking (the answer is still only what
    follows it). ``tool_parser`` is None when the request makes no tool calls;
    ``max_calls`` (1 when ``parallel_tool_calls`` is false) keeps only the first calls,
    as vLLM does."""

    def __init__(self, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None,
                 include_reasoning: bool = True, max_calls: int | None = None) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.include_reasoning = include_reasoning
        self.max_calls = max_calls
        self._text = ""
        self._content = ""

    def whole(self, text: str) -> ChoiceMessage:
        """The message of a finished output."""
        reasoning, content = self.reasoning_parser.split(text) if self.reasoning_parser else (None, text)
        message = ChoiceMessage(reasoning if self.include_reasoning else None, content)
        if self.tool_parser is not None:
            info = self.tool_parser.extract_tool_calls(content or "")
            if info.tools_called:
                message.content, message.tool_calls = info.content, info.tool_calls[:self.max_calls]
        return message

    def delta(self, text: str, finished: bool) -> ChoiceDelta:
        """What the choice's text, now ``text``, adds to what was streamed; ``finished``
        on the output's last step releases any text held back."""
        previous, self._text = self._text, text
        result = ChoiceDelta()
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.extract_reasoning_streaming(previous, text, text[len(previous):],
                                                                     finished=finished)
            content_delta = split.content if split is not None else None
            if split is not None and self.include_reasoning:
                result.reasoning = split.reasoning
        else:
            content_delta = text[len(previous):] or None
        before, self._content = self._content, self._content + (content_delta or "")
        if self.tool_parser is None:
            result.content = content_delta
            return result
        tools = self.tool_parser.extract_tool_calls_streaming(before, self._content, content_delta or "",
                                                              finished=finished)
        if tools is not None:
            result.content = tools.content
            result.tool_calls = [c for c in tools.tool_calls if self.max_calls is None or c.index < self.max_calls]
        return result

    @property
    def called_tools(self) -> bool:
        """Whether this choice's stream has begun a tool call."""
        return self.tool_parser is not None and self.tool_parser.streamed_calls > 0
