"""The outputs of constrained tool choices (not registered by name: the chat handler
picks them from `tool_choice`). The engine's grammar makes the output JSON of a known
shape, so it is read directly, with no model-specific format:

* "required": a JSON list of ``{"name": ..., "parameters": {...}}`` (vLLM's schema);
* a named function: the function's arguments object itself.
"""

from __future__ import annotations

from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCall, ParsedOutput, ToolParser
from engine.entrypoints.openai.tool_parsers.llama_tool_parser import read_call_objects
from engine.entrypoints.openai.tool_parsers.partial_json import scan_value, skip_whitespace


class RequiredToolParser(ToolParser):
    """tool_choice "required": one or more calls as a JSON list."""

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        parsed = ParsedOutput()
        pos = skip_whitespace(text, 0)
        if pos >= len(text):
            parsed.valid = not finished
            return parsed
        if text[pos] != "[":
            parsed.valid = False
            return parsed
        end = read_call_objects(text, pos + 1, parsed, ",", close="]")
        if end is not None and (text[end:].strip() or not parsed.calls):
            parsed.valid = False
        return parsed


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the output is that function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        end = scan_value(text, pos) if pos < len(text) else None
        if end is not None and text[end:].strip():
            return ParsedOutput(valid=False)
        arguments = text[pos:end] if end is not None else text[pos:].rstrip()
        return ParsedOutput(calls=[ParsedCall(self.name, arguments, end is not None)])
