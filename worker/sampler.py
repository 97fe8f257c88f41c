"""Token sampling that is identical on every TP rank, independent of batching, and
done on the logits' own device.

Each request draws from its own ``torch.Generator`` seeded from
``(request seed, num_output_tokens)``. The seed never depends on the batch
composition, the request's row, the rank, or how often it was preempted, so a
request yields the same tokens however it is scheduled. The uniforms are drawn on the
host (one float64 per drawing row) and travel with the step's parameters
(worker/sampling_metadata.py). Everything over [rows, vocab] runs batched on the
device (worker/logits_processors.py, worker/sampling_ops.py). Only the sampled ids
and the logprobs a request asked for come back, in one `.tolist()`.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left
from typing import TYPE_CHECKING

import torch

from worker.grammar_bitmask import GrammarBitmask, apply_grammar_bitmask
from worker.logits_processors import RequestHistory, apply_logits_processors
from worker.sampling_metadata import SamplingMetadata, to_device
from worker.sampling_ops import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    draw_by_inverse_cdf,
    fallback_token,
    scale_by_temperature,
)

if TYPE_CHECKING:  # engine sits above worker; only the message's shape is needed here
    from worker.outputs import ScheduledRequest

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1  # torch.Generator.manual_seed wants a non-negative int64 here
# On the CPU the drawing rows go through in chunks of about this many logits (1 MiB of
# float32; 8 rows of a 32k vocab). Each row's result is the same either way, as every
# op works along the vocab. Whole-batch temporaries of several MiB each spill out of
# cache between ops and are handed back to the OS and faulted in again on every step.
# At 32 x 32000 that made the one-chunk draw slower than the old row-by-row one, while
# chunks of one row pay per-op overhead. Other devices take all rows at once.
CPU_SAMPLING_CHUNK_ELEMENTS = 1 << 18


def stable_hash(*parts: int | str) -> int:
    """A process-independent 63-bit hash (unlike the salted builtin ``hash``)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, str):
            data = part.encode("utf-8")
            h.update(b"s" + struct.pack("<Q", len(data)) + data)
        else:
            h.update(b"i" + struct.pack("<Q", part & _MASK64))
    return int.from_bytes(h.digest(), "little") & _MASK63


def request_step_seed(request: ScheduledRequest, engine_seed: int = 0) -> int:
    """Seed of ``request``'s generator for the token it samples this step."""
    seed = request.sampling_params.seed
    base = seed if seed is not None else engine_seed ^ stable_hash(request.req_id)
    return stable_hash(base, request.num_output_tokens)


def to_host(parts: list[torch.Tensor]) -> list[float]:
    """`parts` flattened into one float64 list with a single device-to-host transfer
    (one sync). Token ids and ranks are exact in float64, and float32 values widen exactly."""
    if not parts:
        return []
    return torch.cat([part.reshape(-1).to(torch.float64) for part in parts]).tolist()


class Sampler:
    """Turns last-position logits into one token (and optional logprobs) per request.

    Holds each request's ``RequestHistory`` (penalties, bad words, prompt logprobs) between
    steps: ``add_history`` when the scheduler sends one (at admission), ``drop`` when
    the request finishes or is preempted. Identical on every rank, as every rank
    samples the same tokens from the same all-gathered logits; nothing here communicates.
    """

    def __init__(self) -> None:
        self._histories: dict[str, RequestHistory] = {}

    def add_history(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        self._histories[req_id] = RequestHistory(list(prompt_token_ids), list(output_token_ids))

    def history(self, req_id: str) -> RequestHistory | None:
        return self._histories.get(req_id)

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._histories.pop(req_id, None)

    def argmax_suffices(self, requests: list[ScheduledRequest]) -> bool:
        """Whether every request's token is the plain argmax of its raw logits and nothing
        else is needed: greedy, no logits processor, no logprobs, no history kept here
        (which `__call__` would extend). The runner then asks the model for the argmax
        alone (`compute_greedy_tokens`). Depends only on the step's requests and what
        was sent with them, so it is the same on every rank."""
        return all(
            r.sampling_params.is_greedy and not r.sampling_params.processes_logits
            and r.sampling_params.logprobs is None and r.req_id not in self._histories
            for r in requests
        )

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[ScheduledRequest],
        engine_seed: int = 0,
        grammar: GrammarBitmask | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample one token per row of ``logits`` (``[len(requests), vocab]``, float32
        or castable, on any device; left unchanged).

        Rows whose parameters process logits get processed first, all in one copy of
        the logits; before them, the rows ``grammar`` names (structured outputs) have
        the tokens their grammar forbids masked (worker/grammar_bitmask.py). Greedy
        rows (temperature 0 or top_k 1) take the argmax of what is left, the first
        maximum. The others apply temperature, then top-k, then top-p (always keeping
        the most likely token), then min-p, then draw with the request's own uniform.
        Logprobs come from ``log_softmax`` of the raw logits: the top ``logprobs`` ids
        plus the sampled id, or None when the request did not ask. Raises ValueError
        for a shape that does not match, and RuntimeError for a request whose token
        history was never sent.

        Device temporaries, in float32 [n, vocab] units, for R rows, of which S draw,
        P use top-p, G are greedy beside drawing rows, and L ask for logprobs:
          * the processed copy, R, only when some row processes logits or has a
            grammar (plus a bool [R, vocab] mask when a row has allowed_token_ids, and
            the grammar's mask: C for C constrained rows on the CPU, R/32 on CUDA);
          * the temperature-scaled rows, S, which softmax turns into the probabilities,
            S, kept until the transfer for the rare host fallback;
          * while top-p runs: sorted values, int64 order and cumsum, 4P, then two bool
            masks;
          * while drawing: the float64 CDF, 2S;
          * the greedy rows' copy, G, and the logprobs, L (2L when not every row asks).
        The peak is about R + 5S, during top-p. On the CPU the drawing temporaries other
        than the probabilities exist one chunk of rows at a time
        (`CPU_SAMPLING_CHUNK_ELEMENTS`). Host reads: one `.tolist()` of O(R + the
        logprobs asked for) floats, plus one sync per flagged row (`fallback_token`: NaN
        logits, or a uniform at the very top of a CDF).
        """
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_requests={len(requests)}, vocab], got {tuple(logits.shape)}"
            )
        if not requests:
            return [], []
        histories = [self._histories.get(r.req_id) for r in requests]
        for request, history in zip(requests, histories):
            if history is None and request.sampling_params.needs_history:
                raise RuntimeError(f"request {request.req_id!r} needs its token history, which was never sent")
        seeds = [None if r.sampling_params.is_greedy else request_step_seed(r, engine_seed) for r in requests]
        meta = SamplingMetadata.build(requests, histories, seeds, logits.shape[1], logits.device)
        raw = logits.float()
        processed = raw
        if meta.processors is not None or grammar is not None:
            processed = raw.clone()
            if grammar is not None:  # first: the grammar decides which tokens exist at all
                apply_grammar_bitmask(processed, grammar)
            if meta.processors is not None:
                apply_logits_processors(processed, meta.tensors)
        tokens, fallback_rows, probs = self._sample(processed, meta)
        parts = [tokens] if fallback_rows is None else [tokens, fallback_rows]
        logprob_parts = self._logprob_parts(raw, tokens, meta)
        host = to_host(parts + logprob_parts)
        token_ids = [int(t) for t in host[:meta.num_rows]]
        changed = self._fallbacks(host, processed, probs, token_ids, meta)
        all_logprobs = self._unpack_logprobs(host, raw, token_ids, changed, meta)
        for token, history in zip(token_ids, histories):
            if history is not None:
                history.output_token_ids.append(token)
        return token_ids, all_logprobs

    @staticmethod
    def _sample(processed: torch.Tensor, meta: SamplingMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor] | None]:
        """Every row's token on the device. For the drawing rows it also gives the flags
        of the rows `fallback_token` must decide, and their probabilities, in chunks of
        rows. Both are None when no row draws."""
        t = meta.tensors
        if not meta.random_rows:
            # max(dim).indices is argmax (the first maximum on ties, as documented), ~3x faster on CPU.
            return processed.max(dim=-1).indices, None, None
        num_random = len(meta.random_rows)
        chunk = num_random
        if processed.device.type == "cpu":
            chunk = max(1, CPU_SAMPLING_CHUNK_ELEMENTS // meta.vocab_size)
        drawn, flags, probs = [], [], []
        for lo in range(0, num_random, chunk):
            tokens, fallback_rows, chunk_probs = _draw_rows(processed, meta, lo, min(lo + chunk, num_random))
            drawn.append(tokens)
            flags.append(fallback_rows)
            probs.append(chunk_probs)
        all_drawn = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
        all_flags = flags[0] if len(flags) == 1 else torch.cat(flags)
        if num_random == meta.num_rows:
            return all_drawn, all_flags, probs
        tokens = torch.empty(meta.num_rows, dtype=torch.long, device=processed.device)
        greedy_rows = t["greedy_rows"]
        tokens.index_copy_(0, greedy_rows, processed.index_select(0, greedy_rows).max(dim=-1).indices)
        tokens.index_copy_(0, t["random_rows"], all_drawn)
        return tokens, all_flags, probs

    @staticmethod
    def _logprob_parts(raw: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata) -> list[torch.Tensor]:
        """On the device, for the rows that asked: each sampled token's logprob, then the
        top ids and values of each group of rows asking for the same k
        (`meta.logprob_groups`)."""
        if not meta.logprob_rows:
            return []
        rows = meta.tensors["logprob_rows"]
        count = len(meta.logprob_rows)
        every_row = count == meta.num_rows
        logprobs = torch.log_softmax(raw if every_row else raw.index_select(0, rows), dim=-1)
        sampled = tokens if every_row else tokens.index_select(0, rows)
        parts = [logprobs.gather(1, sampled[:, None])]
        for k, members in meta.logprob_groups.items():
            group = logprobs if len(members) == count else logprobs.index_select(
                0, meta.tensors[f"logprob_group.{k}"])
            top = group.topk(min(k, meta.vocab_size), dim=-1)
            parts += [top.indices, top.values]
        return parts

    @staticmethod
    def _fallbacks(host: list[float], processed: torch.Tensor, probs: list[torch.Tensor] | None,
                   token_ids: list[int], meta: SamplingMetadata) -> set[int]:
        """Decide the flagged drawing rows on the host (`fallback_token`), in place in
        `token_ids`. Returns the rows whose token changed."""
        if probs is None:
            return set()
        changed = set()
        flags = host[meta.num_rows:meta.num_rows + len(meta.random_rows)]
        for local, flag in enumerate(flags):
            if not flag:
                continue
            row = meta.random_rows[local]
            temperature = meta.tensors["temperature"][local:local + 1]
            scaled_row = scale_by_temperature(processed[row:row + 1], None, temperature)[0]
            chunk = probs[0].shape[0]
            token = fallback_token(probs[local // chunk][local % chunk], scaled_row, meta.uniforms[local])
            if token != token_ids[row]:
                token_ids[row] = token
                changed.add(row)
        return changed

    @staticmethod
    def _unpack_logprobs(host: list[float], raw: torch.Tensor, token_ids: list[int], changed: set[int],
                         meta: SamplingMetadata) -> list[dict[int, float] | None]:
        """Each row's logprobs dict from the transferred values: its top-k (in topk's
        order), then its sampled token. A token changed by a fallback gets its logprob
        from the raw row instead (one more sync, for that row only)."""
        result: list[dict[int, float] | None] = [None] * meta.num_rows
        if not meta.logprob_rows:
            return result
        offset = meta.num_rows + len(meta.random_rows)  # past the tokens and the fallback flags
        count = len(meta.logprob_rows)
        sampled, offset = host[offset:offset + count], offset + count
        entries: list[dict[int, float]] = [{} for _ in range(count)]
        for k, members in meta.logprob_groups.items():
            width = min(k, meta.vocab_size)
            size = len(members) * width
            ids, values = host[offset:offset + size], host[offset + size:offset + 2 * size]
            offset += 2 * size
            for n, local in enumerate(members):
                entries[local] = {int(i): v for i, v in zip(ids[n * width:(n + 1) * width],
                                                             values[n * width:(n + 1) * width])}
        for local, row in enumerate(meta.logprob_rows):
            token = token_ids[row]
            value = sampled[local]
            if row in changed:
                value = float(torch.log_softmax(raw[row], dim=-1)[token])
            entries[local][token] = value
            result[row] = entries[local]
        return result


def _draw_rows(processed: torch.Tensor, meta: SamplingMetadata, lo: int, hi: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drawing rows `lo:hi` (positions in `meta.random_rows`): temperature, top-k, top-p,
    min-p and the draw, batched. Gives their tokens, fallback flags and probabilities."""
    t = meta.tensors
    if hi - lo == meta.num_rows:  # every row draws, in one chunk: no copy of the rows
        scaled = scale_by_temperature(processed, None, t["temperature"])
    else:
        scaled = scale_by_temperature(processed, t["random_rows"][lo:hi], t["temperature"][lo:hi])
    first, last = bisect_left(meta.top_k_rows, lo), bisect_left(meta.top_k_rows, hi)
    if last > first:
        apply_top_k(scaled, t["top_k_rows"][first:last] - lo, t["top_k"][first:last], max(meta.top_k[first:last]))
    probs = torch.softmax(scaled, dim=-1)
    del scaled
    first, last = bisect_left(meta.top_p_rows, lo), bisect_left(meta.top_p_rows, hi)
    if last > first:
        apply_top_p(probs, t["top_p_rows"][first:last] - lo, t["top_p"][first:last])
    if meta.uses_min_p:
        apply_min_p(probs, t["min_p"][lo:hi])
    tokens, fallback_rows = draw_by_inverse_cdf(probs, t["uniforms"][lo:hi])
    return tokens, fallback_rows, probs


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[tuple[dict[int, float], int]]:
    """For each row of ``logits`` ([rows, vocab], any device) the logprob of the prompt
    token that follows it (``next_tokens``), with the top-``k``, and that token's rank
    (1 = likeliest). Computed on the logits' device; one transfer brings back
    O(rows * (k + 2)) values. Temporaries: the [rows, vocab] float32 logprobs and a
    bool [rows, vocab] comparison."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = to_device({"ids": next_tokens}, {}, logprobs.device)["ids"]
    actual = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > actual).sum(dim=-1) + 1
    parts = [actual, ranks]
    width = min(k, logprobs.shape[-1]) if k > 0 else 0
    if width:
        top = torch.topk(logprobs, width)
        parts += [top.indices, top.values]
    host = to_host(parts)
    rows = len(next_tokens)
    top_ids, top_values = host[2 * rows:2 * rows + rows * width], host[2 * rows + rows * width:]
    result = []
    for i, token in enumerate(next_tokens):
        entry = {int(t): v for t, v in zip(top_ids[i * width:(i + 1) * width], top_values[i * width:(i + 1) * width])}
        entry[token] = host[i]
        result.append((entry, int(host[rows + i])))
    return result
