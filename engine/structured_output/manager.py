"""`StructuredOutputManager` (vLLM's name): the engine's grammars, compiled once each.

`EngineCore` owns one, made from its config, tokenizer, EOS ids and the model's vocab
size; the `Processor` calls `compile` for every constrained request it validates (on
the request's thread, so a bad constraint is a ValueError naming the field before
anything is queued, and compiling never stalls the step loop), and
`EngineCore.add_request` makes each sample's `StructuredOutputRequest` from the result.
The scheduler fills the step's bitmask with `step_grammar` when it plans the step.

Why the mask is filled before the step is sent, not while the model runs (as vLLM does
it, after scheduling, for a second `sample_tokens` message): here a step is one
message, one call on every rank, on every executor (mp's shared-memory broadcast, Ray
tasks, torchrun's lockstep), and the mask must be identical on every rank, so it rides
in that message. Overlapping it would need a second call per step on every executor.
It is cheap beside a step: xgrammar fills a row in about 10 µs (32 rows of a 32k
vocabulary: 0.3 ms on this 2-core VM, 2026-12-04; a row is 4 KiB of the message).

Compiled grammars are cached by `StructuredOutputsParams.cache_key()` (plus the
engine's whitespace default), least recently used first out past `cache_size` entries
(xgrammar's `memory_size_bytes` of a small schema's grammar: 10 KiB at a 4k-token
vocabulary; larger with the vocabulary and the grammar). `compile` is thread-safe: one
lock, held while compiling (the step loop never takes it), so two
threads asking for the same text compile it once. `num_compilations` counts misses.
The backend (and xgrammar with it) is built at the first constrained request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from config import EngineConfig, StructuredOutputsParams
from engine.structured_output.backend_types import StructuredOutputBackend
from engine.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, tokenizer: Any, eos_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.config = config.structured_outputs_config
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = config.model_config.vocab_size
        self.cache_size = cache_size
        self.num_compilations = 0
        self._backend: StructuredOutputBackend | None = None
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend the config names ("auto": xgrammar), built on first use (under
        the lock). Raises ValueError when the model has no tokenizer."""
        if self._backend is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer, and this model has none")
            from engine.structured_output.backend_xgrammar import XgrammarBackend  # lazily: xgrammar loads slowly

            start = time.perf_counter()
            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
            logger.info("structured outputs: xgrammar backend ready for a vocabulary of %d in %.2fs",
                        self.vocab_size, time.perf_counter() - start)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``, from the cache or compiled now. Any thread.
        Raises ValueError naming the field (``structured_outputs.json``, ...)."""
        any_whitespace = not (params.disable_any_whitespace or self.config.disable_any_whitespace)
        key = (*params.cache_key(), any_whitespace)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            start = time.perf_counter()
            compiled = self.backend.compile(params, any_whitespace)
            self.num_compilations += 1
            logger.debug("compiled a %s grammar in %.3fs", params.kind, time.perf_counter() - start)
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def new_request(self, compiled: Any, reasoning_end_token_ids: list[int] | None = None
                    ) -> StructuredOutputRequest:
        """A fresh matcher over ``compiled`` (a result of `compile`) for one sample; with
        ``reasoning_end_token_ids``, applied only after the thinking ends."""
        backend = self.backend
        return StructuredOutputRequest(backend, backend.new_grammar(compiled), reasoning_end_token_ids)


def grammar_bitmask(requests: list[StructuredOutputRequest], live: list[bool] | None = None) -> bytes:
    """The next-token bitmask of ``requests``, one int32 row each in order (xgrammar's
    layout: ceil(vocab / 32) words a row, bit t % 32 of word t // 32 for token t), as
    the bytes that travel with the step; a request ``live`` marks False gets a row
    allowing everything (it ended: its token will be dropped). The scheduler's thread;
    holds the rows only while filling them (16 KiB a row at a 128k vocabulary)."""
    bitmask = requests[0].backend.allocate_bitmask(len(requests))
    for row, request in enumerate(requests):
        if live is None or live[row]:
            request.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = -1
    return bitmask.numpy().tobytes()


def step_grammar(samples: list[tuple[str, StructuredOutputRequest | None]], defer: bool = False
                 ) -> tuple[list[str], bytes | None]:
    """For the requests that sample this step, as (request id, its matcher or None) in
    scheduled order: the ids of the constrained ones and their `grammar_bitmask`
    (``([], None)`` when none is constrained): `SchedulerOutput`'s two fields. With
    ``defer``, the ids only: the bitmask follows the step (`Scheduler.grammar_bitmask`)."""
    constrained = [(req_id, request) for req_id, request in samples if request is not None]
    if not constrained:
        return [], None
    ids = [req_id for req_id, _ in constrained]
    return ids, None if defer else grammar_bitmask([request for _, request in constrained])
