"""`StructuredOutputRequest` (vLLM's name): one sample's grammar state, on its `Request`.

Created by `StructuredOutputManager.new_request` when `EngineCore.add_request` queues a
sample (each of a request's n / best_of samples gets its own matcher over the shared
compiled grammar). Used by the scheduler only, on the thread that steps the core: it
fills the sample's bitmask row when the sample is scheduled to sample, and accepts each
token it appends. The matcher always stands after exactly the sample's kept output
tokens (`num_accepted == len(output_token_ids)`); `sync` restores that where the engine
re-runs a request from its tokens (preemption, a replaced worker group). A reasoning
model's thinking (up to its end token) is taken in without the grammar.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """``reasoning_end_token_ids``: the grammar applies only after the first of these in
    the output (a reasoning model's thinking comes first, unconstrained: its row of the
    bitmask allows everything until then); None: from the first token."""

    def __init__(self, backend: StructuredOutputBackend, grammar: StructuredOutputGrammar,
                 reasoning_end_token_ids: list[int] | None = None) -> None:
        self.backend = backend
        self.grammar = grammar
        self.reasoning_end = frozenset(reasoning_end_token_ids or ())
        # Where the grammar starts in the output: 0 without reasoning, else just past the
        # end of the thinking once it is seen (None until then).
        self.grammar_start: int | None = None if self.reasoning_end else 0
        self.num_accepted = 0  # output tokens taken in (thinking included)
        self.rejected = False  # a sampled token the grammar refused (the mask was not honoured)

    def accept_token(self, token_id: int) -> bool:
        """Take in the sample's next output token. False when the grammar refuses it (the
        matcher stays where it was and the request should end: it can no longer match)."""
        if self.grammar_start is None:  # still thinking
            self.num_accepted += 1
            if token_id in self.reasoning_end:
                self.grammar_start = self.num_accepted
            return True
        if self.grammar.accept_token(token_id):
            self.num_accepted += 1
            return True
        if not self.rejected:
            logger.warning("a sampled token (%d) is not allowed by its request's grammar: the request ends "
                           "here (%d tokens matched)", token_id, self.num_accepted)
        self.rejected = True
        return False

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was taken: the request is done."""
        return self.grammar_start is not None and self.grammar.is_terminated()

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to the state after ``output_token_ids``, the tokens the engine
        kept: roll back what it discarded, take in what it has not seen."""
        kept = len(output_token_ids)
        if self.num_accepted > kept:
            if self.grammar_start is not None and kept >= self.grammar_start:
                self.grammar.rollback(self.num_accepted - kept)
                self.num_accepted = kept
            else:  # back into the thinking (or before it ended): start over
                self.grammar.reset()
                self.grammar_start = None if self.reasoning_end else 0
                self.num_accepted = 0
        for token in output_token_ids[self.num_accepted:]:
            if not self.accept_token(token):
                break

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.grammar_start is None:
            bitmask[row] = -1  # thinking: every token allowed
        else:
            self.grammar.fill_bitmask(bitmask, row)
