"""`pythonic`: calls as a Python list, as Llama 3.2 / 4 and others write them:
``[get_weather(city="Paris"), add(a=1, b=2)]`` (optionally between
``<|python_start|>`` and ``<|python_end|>``). Arguments are keyword arguments with
literal values; each call's arguments are their JSON. A stream gives each call whole,
once its closing parenthesis is read. An output that does not open with ``[`` is all
content."""

from __future__ import annotations

import ast
import json

from engine.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from engine.parser_registry import held_tail

_OPEN = {"(": ")", "[": "]", "{": "}"}
_WRAPPERS = ("<|python_start|>", "<|python_end|>")


def _call(source: str) -> ParsedCall | None:
    """``f(a=1, b="x")`` as a call; None if it is not a call of a name with literal keywords."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(arguments) != len(node.keywords):
            return None  # a **kwargs
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False), True)


def _items(text: str, pos: int) -> tuple[list[str], int | None]:
    """The whole items of the list whose ``[`` is at ``pos - 1``, and the index after
    its ``]`` (None if the text ends first). Quotes and brackets are skipped over."""
    items: list[str] = []
    stack: list[str] = []
    start = i = pos
    quote = None
    while i < len(text):
        char = text[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in _OPEN:
            stack.append(_OPEN[char])
        elif stack and char == stack[-1]:
            stack.pop()
        elif not stack and char in ",]":
            if text[start:i].strip():
                items.append(text[start:i])
            if char == "]":
                return items, i + 1
            start = i + 1
        i += 1
    return items, None


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        rest = text.strip()
        if not finished:
            rest = rest[:len(rest) - held_tail(rest, _WRAPPERS)]
        for wrapper in _WRAPPERS:
            rest = rest.replace(wrapper, "")
        rest = rest.strip()
        if not rest:
            return ParsedOutput(content=text if finished else "")
        if not rest.startswith("["):
            return ParsedOutput(content=text)
        items, end = _items(rest, 1)
        parsed = ParsedOutput()
        for item in items:
            call = _call(item)
            if call is None:
                parsed.valid = False
                return parsed
            parsed.calls.append(call)
        if end is None and finished:
            parsed.valid = False
        if end is not None and (rest[end:].strip() or not parsed.calls):
            parsed.valid = False
        return parsed
