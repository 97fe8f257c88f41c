"""`mistral`: Mistral's calls after its ``[TOOL_CALLS]`` token, either as a JSON list
``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (tokenizers before v11) or as
``[TOOL_CALLS]f[ARGS]{...}`` per call (v11 and later). The text before the first call
is content. ``[TOOL_CALLS]`` is a special token, so requests keep special tokens in
the text (`adjust_request`), as vLLM does."""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from engine.entrypoints.openai.tool_parsers.llama_tool_parser import read_call_objects
from engine.entrypoints.openai.tool_parsers.partial_json import scan_value, skip_whitespace
from engine.parser_registry import held_tail

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):

    def adjust_request(self, request: Any) -> Any:
        if getattr(request, "skip_special_tokens", None) is True:
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            return ParsedOutput(content=text if finished else text[:len(text) - held_tail(text, (BOT,))])
        parsed = ParsedOutput(content=text[:start])
        pos = skip_whitespace(text, start + len(BOT))
        if pos >= len(text):
            return parsed
        if text[pos] == "[":
            if read_call_objects(text, pos + 1, parsed, ",", close="]") is not None and not parsed.calls:
                parsed.valid = False  # an empty list
            return parsed
        while True:
            args = text.find(ARGS, pos)
            if args < 0:
                return parsed  # the name is still being written
            name = text[pos:args].strip()
            value = skip_whitespace(text, args + len(ARGS))
            end = scan_value(text, value) if value < len(text) else None
            if not name:
                parsed.valid = False
                return parsed
            parsed.calls.append(ParsedCall(name, text[value:end] if end else text[value:].rstrip(), end is not None))
            if end is None:
                return parsed
            pos = skip_whitespace(text, end)
            if text.startswith(BOT, pos):
                pos += len(BOT)
            elif pos < len(text) and not BOT.startswith(text[pos:]):
                parsed.valid = False
                return parsed
            else:
                return parsed
