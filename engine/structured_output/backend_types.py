"""The structured-output backend interface (vLLM's `v1/structured_output/backend_types.py`).

A backend turns a request's `StructuredOutputsParams` into a compiled grammar (once per
distinct constraint: `StructuredOutputManager` caches them) and makes one
`StructuredOutputGrammar` (a matcher: the grammar plus how far one sample got) per
sample of a request. Everything here runs in the engine process: compilation on the
thread that processes the request (the server's request thread, or the caller's),
matchers on the thread that steps the core. Workers never see a grammar, only the
token bitmask the scheduler fills from the matchers (xgrammar's layout: int32 words,
bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from config import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One sample's progress through a compiled grammar. Not thread-safe: used only by
    the thread that steps the core (the scheduler)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and no change) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (tokens the engine discarded)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of the int32 ``bitmask``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token was accepted: nothing may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start, as if no token was accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one engine's tokenizer and vocabulary.

    ``vocab_size`` is the width of the model's logits (the bitmask covers it: ids past
    the tokenizer's vocabulary are never allowed). Implementations are thread-safe for
    `compile` (the manager serialises it anyway)."""

    vocab_size: int

    @abstractmethod
    def compile(self, params: StructuredOutputsParams, any_whitespace: bool) -> Any:
        """The compiled grammar of ``params`` (opaque to callers). Raises ValueError whose
        message starts with the field at fault (``structured_outputs.json``, ...) for a
        constraint that does not compile or uses a feature this backend cannot enforce."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over ``compiled`` (one per sample of a request)."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` host tensor, every token allowed."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
