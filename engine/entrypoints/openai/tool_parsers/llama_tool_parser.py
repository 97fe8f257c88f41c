"""`llama3_json`: Llama 3.1 / 3.2's JSON calls: the output is one or more objects
``{"name": "f", "parameters": {...}}`` (``arguments`` is read too), separated by
``;``, optionally after ``<|python_tag|>``. An output that does not open with ``{``
is all content."""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.protocol_tools import FunctionDefinition
from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
    call_from_object,
)
from engine.entrypoints.openai.tool_parsers.hermes_tool_parser import strict_tool_tags
from engine.entrypoints.openai.tool_parsers.partial_json import read_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


def read_call_objects(text: str, pos: int, parsed: ParsedOutput, separator: str,
                      close: str | None = None) -> int | None:
    """Read call objects from ``pos`` into ``parsed``, each followed by ``separator`` or,
    when given, ``close`` (the end of a list). Returns the index after ``close``, or
    None when the text ends first; sets ``parsed.valid`` False on anything else."""
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return None
        if close is not None and text[pos] == close and not parsed.calls:
            return pos + 1
        if text[pos] != "{":
            parsed.valid = False
            return None
        obj = read_object(text, pos)
        call = call_from_object(obj.values, obj.finished, obj.end is not None)
        if not obj.valid or call is None:
            parsed.valid = False
            return None
        parsed.calls.append(call)
        if obj.end is None:
            return None
        pos = skip_whitespace(text, obj.end)
        if pos >= len(text):
            return None
        if close is not None and text[pos] == close:
            return pos + 1
        if text[pos] != separator:
            parsed.valid = False
            return None
        pos += 1


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):

    def structural_tag(self, tools: list[FunctionDefinition]) -> dict[str, Any] | None:
        return strict_tool_tags(tools, '{{"name": {name}, "parameters": ', "}", '{"name": ')

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        rest = text.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        if not finished and PYTHON_TAG.startswith(rest):
            return ParsedOutput()  # blank, or the start of the tag: undecided
        if not rest.startswith("{"):
            return ParsedOutput(content=text)
        parsed = ParsedOutput()
        read_call_objects(rest, 0, parsed, ";")
        return parsed
