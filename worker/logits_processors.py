"""What a request's sampling parameters do to its logits before a token is drawn,
applied to a whole step's rows at once on the logits' own device.

The Sampler calls this on every rank with the same inputs, so every rank processes
the same rows the same way. It has two halves. On the host, `LogitsProcessorInputs`
reads each row's parameters and token history into flat (row, token id, value) lists.
They reach the device in the step's two small copies (worker/sampling_metadata.py). On
the device, `apply_logits_processors` changes only those entries, in place: a few
gathers and index_puts, plus one bool [rows, vocab] mask if some row has
`allowed_token_ids`. Nothing syncs. Each processor computes what transformers' logits
processor of the same name computes (OpenAI's definition for the frequency and
presence penalties, which transformers lacks), in the same float32 arithmetic, so a
row's values are bit for bit those of processing it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # config is below worker; only the shape is needed here
    from config import SamplingParams


@dataclass
class RequestHistory:
    """The tokens a request has seen on this rank: its prompt (sent once at admission)
    and the outputs sampled since, appended by the Sampler."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


class LogitsProcessorInputs:
    """One step's logits processing as host arrays: per-entry global row indices,
    token ids and values, plus per-row penalties. It is built once per step on the
    host. The long arrays (seen and output tokens, allowed ids) are host tensors,
    so building them is not a Python loop over each id.

    Token ids at or above the logits' vocab are left out (a tokenizer's ids past the
    model's padded vocab have no logit to change)."""

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.allowed_rows: list[int] = []  # rows where every id but the allowed ones is masked
        self.banned: tuple[list[int], list[int]] = ([], [])  # (row, id) set to -inf
        self.bias: tuple[list[int], list[int], list[float]] = ([], [], [])  # (row, id, value) added
        # (row chunks, id chunks) per processor over many ids; counts for the frequency penalty.
        self.allowed: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.repetition: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.frequency: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        # Per-row operands, gathered on the device by each entry's row.
        self.repetition_penalty = [1.0] * num_rows
        self.frequency_penalty = [0.0] * num_rows
        self.presence_penalty = [0.0] * num_rows

    def add_request(self, row: int, params: SamplingParams, num_output_tokens: int,
                    history: RequestHistory | None) -> None:
        """Record what `params` does to logits row `row`, in SamplingParams' order:
        allowed ids, bad words, min_tokens, logit_bias, repetition penalty, then the
        frequency and presence penalties. `history` must be given when
        `params.needs_history`; `num_output_tokens` is how many tokens the request has
        generated before this one."""
        vocab = self.vocab_size
        if params.allowed_token_ids is not None:
            self.allowed_rows.append(row)
            self._add_chunk(self.allowed, row, torch.tensor(params.allowed_token_ids, dtype=torch.long))
        banned: list[int] = []
        if params.bad_words_token_ids:
            banned += _banned_by_bad_words(params.bad_words_token_ids, history)
        if num_output_tokens < params.min_tokens:
            banned += params.all_stop_token_ids
        banned = [t for t in banned if t < vocab]
        self.banned[0].extend([row] * len(banned))
        self.banned[1].extend(banned)
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            self.bias[0].extend([row] * len(ids))
            self.bias[1].extend(ids)
            self.bias[2].extend(params.logit_bias[t] for t in ids)
        if history is None:
            return
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(history.prompt_token_ids + history.output_token_ids, dtype=torch.long).unique()
            self._add_chunk(self.repetition, row, seen)
            self.repetition_penalty[row] = params.repetition_penalty
        if (params.frequency_penalty or params.presence_penalty) and history.output_token_ids:
            ids, counts = torch.tensor(history.output_token_ids, dtype=torch.long).unique(return_counts=True)
            kept = self._add_chunk(self.frequency, row, ids)
            self.frequency[2].append(counts[kept])
            self.frequency_penalty[row] = params.frequency_penalty
            self.presence_penalty[row] = params.presence_penalty

    def _add_chunk(self, columns: tuple[list[torch.Tensor], ...], row: int, ids: torch.Tensor) -> torch.Tensor:
        """Append (row, id) for each id below the vocab; returns the mask of those kept."""
        kept = ids < self.vocab_size
        ids = ids[kept]
        columns[0].append(torch.full_like(ids, row))
        columns[1].append(ids)
        return kept

    def host_arrays(self) -> tuple[dict[str, list[int] | torch.Tensor], dict[str, list[float] | torch.Tensor]]:
        """The int and float arrays that `apply_logits_processors` reads back by these names
        (the per-row penalties are made whole; the entry arrays may be empty)."""
        def cat(chunks: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long)

        ints: dict[str, list[int] | torch.Tensor] = {
            "lp.allowed_rows": self.allowed_rows, "lp.allowed_row": cat(self.allowed[0]),
            "lp.allowed_id": cat(self.allowed[1]), "lp.banned_row": self.banned[0], "lp.banned_id": self.banned[1],
            "lp.bias_row": self.bias[0], "lp.bias_id": self.bias[1], "lp.rep_row": cat(self.repetition[0]),
            "lp.rep_id": cat(self.repetition[1]), "lp.freq_row": cat(self.frequency[0]),
            "lp.freq_id": cat(self.frequency[1])}
        floats: dict[str, list[float] | torch.Tensor] = {
            "lp.bias": self.bias[2], "lp.rep": self.repetition_penalty, "lp.freq": self.frequency_penalty,
            "lp.presence": self.presence_penalty, "lp.count": cat(self.frequency[2])}
        return ints, floats


def _banned_by_bad_words(bad_words: list[list[int]], history: RequestHistory | None) -> list[int]:
    """transformers' NoBadWordsLogitsProcessor: a one-token word is always banned; a
    longer one has its last token banned when the tokens so far end with the rest."""
    tokens = (history.prompt_token_ids + history.output_token_ids) if history is not None else []
    banned = []
    for word in bad_words:
        *head, last = word
        if not head or (len(tokens) >= len(head) and tokens[len(tokens) - len(head):] == head):
            banned.append(last)
    return banned


def apply_logits_processors(logits: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Process float32 `logits` ([rows, vocab], any device) in place, as the "lp.*"
    entries of `tensors` say: `LogitsProcessorInputs.host_arrays` on the logits'
    device (worker/sampling_metadata.py's `to_device`, which leaves empty arrays out).

    Rows and entries that are not named are left as they are. The stages run in
    SamplingParams' order. Each stage sees only its own (row, id) entries, so it gives
    the same values as processing each row alone. Makes no host sync. Temporaries: one
    bool [rows, vocab] mask when a row has allowed ids, else O(entries)."""
    # Constants are made on the device (a fill), never copied from the host: a
    # blocking host-to-device copy would wait for the stream.
    neg_inf = float("-inf")
    if "lp.allowed_rows" in tensors:
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        mask.index_fill_(0, tensors["lp.allowed_rows"], True)
        if "lp.allowed_row" in tensors:
            mask.index_put_((tensors["lp.allowed_row"], tensors["lp.allowed_id"]), mask.new_zeros(()))
        logits.masked_fill_(mask, neg_inf)
    if "lp.banned_row" in tensors:
        logits.index_put_((tensors["lp.banned_row"], tensors["lp.banned_id"]), logits.new_full((), neg_inf))
    if "lp.bias_row" in tensors:
        index = (tensors["lp.bias_row"], tensors["lp.bias_id"])
        logits.index_put_(index, logits[index] + tensors["lp.bias"].to(logits.dtype))
    if "lp.rep_row" in tensors:
        index = (tensors["lp.rep_row"], tensors["lp.rep_id"])
        scores, penalty = logits[index], tensors["lp.rep"].to(logits.dtype)[index[0]]
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        # A tiny penalty can overflow float32: the largest float is "most likely".
        logits.index_put_(index, torch.nan_to_num(penalized, nan=neg_inf, posinf=torch.finfo(logits.dtype).max))
    if "lp.freq_row" in tensors:
        index = (tensors["lp.freq_row"], tensors["lp.freq_id"])
        dtype, rows = logits.dtype, index[0]
        penalty = (tensors["lp.freq"].to(dtype)[rows] * tensors["lp.count"].to(dtype)
                   + tensors["lp.presence"].to(dtype)[rows])
        logits.index_put_(index, logits[index] - penalty)
