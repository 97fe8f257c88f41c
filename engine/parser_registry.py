"""What the output parsers of the chat API share (the tool-call parsers in
engine/entrypoints/openai/tool_parsers/, the reasoning parsers in engine/reasoning/):
a registry of parser classes by the name a flag gives, and the held tail of a stream.

Registries are filled at import time (and by a --tool-parser-plugin file, before the
server starts); lookups happen on the event loop. Pure Python, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

ParserT = TypeVar("ParserT")


class ParserRegistry(Generic[ParserT]):
    """Parser classes by name; ``kind`` names them in errors ("tool call parser")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parsers: dict[str, type[ParserT]] = {}

    def register_module(self, name: str) -> Callable[[type[ParserT]], type[ParserT]]:
        """Class decorator: register a parser under ``name`` (a later one replaces it)."""

        def register(parser: type[ParserT]) -> type[ParserT]:
            self.parsers[name] = parser
            return parser

        return register

    def get(self, name: str) -> type[ParserT]:
        """The class named ``name``; a KeyError listing the known names otherwise."""
        if name not in self.parsers:
            raise KeyError(f"{self.kind} {name!r} is not known; choose one of {sorted(self.parsers)}")
        return self.parsers[name]


def held_tail(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could still grow into one of ``tags``
    (the longest proper prefix of a tag that ends the text); 0 when none could. A
    stream holds them back until the next text shows what they are."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest
