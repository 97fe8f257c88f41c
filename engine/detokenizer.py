"""Incremental detokenisation: text for a growing list of output ids, in O(new tokens).

Decoding the whole output at every step is quadratic over a long generation. Instead
each request keeps a short window of ids that have already produced text: a new token
is decoded together with that window, and the text it adds is the difference. Text
whose last character is incomplete (a multi-byte character split across tokens, shown
as U+FFFD) is held back until the rest arrives, or until the request finishes.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One per request, owned by the engine thread."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0  # window start: context that makes the next decode correct
        self._read_offset = 0  # ids before this have produced their text

    def update(self, token_ids: list[int], finished: bool = False) -> str:
        """The text of `token_ids` (which only ever grows); `finished` flushes held-back text."""
        if len(token_ids) == self._read_offset:
            return self.text
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(token_ids[self._prefix_offset : self._read_offset], skip)
        new_text = self.tokenizer.decode(token_ids[self._prefix_offset :], skip)
        if finished or (len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT)):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self.text
