"""`hermes`: Hermes-style calls, as Qwen2.5 and Qwen3 write them:
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number of them,
with text around them as content. An unclosed call at the end of a finished output
counts when its JSON is whole (the model stopped at the end tag's token)."""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.protocol_tools import FunctionDefinition
from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
    call_from_object,
)
from engine.entrypoints.openai.tool_parsers.partial_json import read_object, skip_whitespace
from engine.parser_registry import held_tail


def strict_tool_tags(tools: list[FunctionDefinition], begin: str, end: str, trigger: str) -> dict[str, Any] | None:
    """An xgrammar structural tag whose calls are ``begin(name) + arguments + end``, the
    arguments pinned to the parameters' schema for strict tools (free JSON for the
    others), opened only at ``trigger``; None when no tool is strict."""
    if not any(tool.strict for tool in tools):
        return None
    tags = [{"begin": begin.format(name=json.dumps(tool.name)),
             "content": {"type": "json_schema",
                         "json_schema": tool.parameters if tool.strict and tool.parameters else {"type": "object"}},
             "end": end} for tool in tools]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": False}}


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def structural_tag(self, tools: list[FunctionDefinition]) -> dict[str, Any] | None:
        return strict_tool_tags(tools, '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>",
                                self.start_tag)

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        parsed = ParsedOutput()
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                tail = text[pos:]
                parsed.content += tail if finished else tail[:len(tail) - held_tail(tail, (self.start_tag,))]
                return parsed
            parsed.content += text[pos:start]
            body = skip_whitespace(text, start + len(self.start_tag))
            end = text.find(self.end_tag, body)
            stop = end if end >= 0 else len(text)
            if body >= stop:
                if end >= 0:
                    parsed.valid = False  # an empty call
                return parsed
            if text[body] != "{":
                parsed.valid = False
                return parsed
            obj = read_object(text[:stop], body)
            call = call_from_object(obj.values, obj.finished, obj.end is not None)
            if not obj.valid or call is None or (end >= 0 and obj.end is None):
                parsed.valid = False
                return parsed
            parsed.calls.append(call)
            if end < 0:
                return parsed
            pos = end + len(self.end_tag)
