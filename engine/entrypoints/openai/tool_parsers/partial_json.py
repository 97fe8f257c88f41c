"""Reading JSON that a model is still writing: where a value ends, and the keys of an
object read so far. The tool parsers stream a call's arguments as the model's own text
(the raw JSON of the value), so what a stream sends is always a prefix of what the
whole response holds; nothing here re-serialises a value.

Pure functions over `str`; no state, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def scan_string(text: str, pos: int) -> int | None:
    """The index after the JSON string that starts at ``text[pos] == '"'``; None if it
    does not end within ``text``."""
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return i + 1
        i += 1
    return None


def scan_value(text: str, pos: int) -> int | None:
    """The index after the JSON value that starts at ``pos`` (no leading whitespace);
    None if it does not end within ``text``. A bare number or literal ends at the next
    delimiter, so one at the very end of ``text`` counts as unfinished."""
    if pos >= len(text):
        return None
    char = text[pos]
    if char == '"':
        return scan_string(text, pos)
    if char in _CLOSE:
        stack = [_CLOSE[char]]
        i = pos + 1
        while i < len(text):
            char = text[i]
            if char == '"':
                end = scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in _CLOSE:
                stack.append(_CLOSE[char])
            elif char in "}]":
                if char != stack[-1]:
                    return i + 1  # mismatched: let json.loads name the error
                stack.pop()
                if not stack:
                    return i + 1
            i += 1
        return None
    i = pos
    while i < len(text) and text[i] not in _WHITESPACE + ",}]":
        i += 1
    return i if i < len(text) else None


@dataclass
class PartialObject:
    """An object as read so far: each key's raw value text (a finished value whole, the
    last one possibly still growing), and where the object ends (None: not yet)."""

    values: dict[str, str]
    finished: set[str]
    end: int | None
    valid: bool = True


def read_object(text: str, pos: int) -> PartialObject:
    """Read the object that starts at ``text[pos] == '{'`` as far as ``text`` goes. A
    value still being written is given as its text so far, trailing whitespace left out
    (it may yet be followed by the object's end). ``valid`` is False once the text can
    no longer be a JSON object."""
    result = PartialObject({}, set(), None)
    i = pos + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return result
        if text[i] == "}":
            result.end = i + 1
            return result
        if text[i] == ",":
            i = skip_whitespace(text, i + 1)
            if i >= len(text):
                return result
        if text[i] != '"':
            result.valid = False
            return result
        key_end = scan_string(text, i)
        if key_end is None:
            return result
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return result
        if text[i] != ":":
            result.valid = False
            return result
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return result
        end = scan_value(text, i)
        if end is None:
            result.values[key] = text[i:].rstrip(_WHITESPACE)
            return result
        result.values[key] = text[i:end]
        result.finished.add(key)
        i = end
