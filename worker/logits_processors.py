"""What a request's sampling parameters do to its logits before a token is drawn.

Called by the Sampler on every rank with the same inputs, so every rank processes
the same row the same way. Each processor is computed the way transformers'
logits processor of the same name computes it (or OpenAI's definition, for the
frequency and presence penalties, which transformers lacks), so that the oracle
can check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # engine sits above worker; only the message's shape is needed here
    from config import SamplingParams


@dataclass
class RequestHistory:
    """The tokens a request has seen on this rank: its prompt (sent once at admission)
    and the outputs sampled since, appended by the Sampler."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def apply_logits_processors(
    row: torch.Tensor, params: SamplingParams, num_output_tokens: int, history: RequestHistory | None
) -> torch.Tensor:
    """A processed copy of one request's float32 logits ``row`` ([vocab]).

    ``history`` must be given when ``params.needs_history``; ``num_output_tokens`` is
    how many tokens the request has generated before this one."""
    row = row.clone()
    vocab = row.numel()
    if params.allowed_token_ids is not None:
        mask = torch.ones(vocab, dtype=torch.bool)
        mask[[t for t in params.allowed_token_ids if t < vocab]] = False
        row.masked_fill_(mask, float("-inf"))
    if params.bad_words_token_ids:
        _ban_bad_words(row, params.bad_words_token_ids, history)
    if num_output_tokens < params.min_tokens:
        stop_ids = [t for t in params.all_stop_token_ids if t < vocab]
        if stop_ids:
            row[stop_ids] = float("-inf")
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        row[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=row.dtype)
    if history is not None:
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(history.prompt_token_ids + history.output_token_ids, dtype=torch.long).unique()
            scores = row[seen]
            penalized = torch.where(scores < 0, scores * params.repetition_penalty,
                                    scores / params.repetition_penalty)
            # A tiny penalty can overflow float32: the largest float is "most likely".
            row[seen] = torch.nan_to_num(penalized, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
        if (params.frequency_penalty or params.presence_penalty) and history.output_token_ids:
            counts = torch.bincount(torch.tensor(history.output_token_ids, dtype=torch.long), minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _ban_bad_words(row: torch.Tensor, bad_words: list[list[int]], history: RequestHistory | None) -> None:
    """transformers' NoBadWordsLogitsProcessor: a one-token word is always banned; a
    longer one has its last token banned when the tokens so far end with the rest."""
    tokens = (history.prompt_token_ids + history.output_token_ids) if history is not None else []
    banned = []
    for word in bad_words:
        *head, last = word
        if not head or (len(tokens) >= len(head) and tokens[len(tokens) - len(head):] == head):
            banned.append(last)
    banned = [t for t in banned if t < row.numel()]
    if banned:
        row[banned] = float("-inf")


def filter_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """transformers' MinPLogitsWarper on probabilities: drop every token less likely
    than ``min_p`` times the likeliest one (which always stays)."""
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)
