"""From the scheduler's requests to what the client sees: text, stop strings, and the
``n`` (or ``best_of``) samples of one prompt gathered into one `RequestOutput`.

Owned by EngineCore, on the thread that steps it. A client request is a
`ParentRequest`; each of its samples is one scheduler `Request` (its id is the
parent's when there is one sample, else ``"{index}_{parent id}"``, as vLLM names
them), and the samples share the prompt's KV blocks (engine/block_manager.py).

Stop strings are found in the detokenised text, across token boundaries: the text a
new token adds is searched together with the end of the text before it. While a
request runs, its text holds back the last ``len(longest stop string) - 1``
characters, so a stream never shows the start of a stop string that is about to
complete; the cumulative text never shrinks.

A request's `RequestOutputKind` says what it is given: every step's cumulative
state, every step's new part (DELTA: the cumulative state less what was already
given), or only the final state. A FINAL_ONLY request without stop strings is not
looked at until it finishes: its text is decoded once, then, from all its tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from config import RequestOutputKind, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.tokenizer import Tokenizer


@dataclass
class _Sample:
    """One scheduler request's text state."""

    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    shown: str = ""  # the text clients have been given (a prefix of the decoded text)
    searched: int = 0  # decoded characters already searched for stop strings


@dataclass
class ParentRequest:
    """One client request and the latest state of each of its samples."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[CompletionOutput | None] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    num_cached_tokens: int = 0  # the first sample's prefix-cache hit at its first schedule
    # DELTA: per sample, how many tokens and text characters were given, and whether
    # its finish was; whether the prompt's logprobs were.
    _given: list[tuple[int, int, bool]] = field(init=False, repr=False)
    _prompt_logprobs_given: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.samples = [None] * self.params.num_samples
        self._given = [(0, 0, False)] * self.params.num_samples

    def child_id(self, index: int) -> str:
        return self.request_id if self.params.num_samples == 1 else f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """Sample ``index``'s own parameters: one sequence, seed + index, and, when the
        best are picked by cumulative logprob, the sampled token's logprob computed.
        Only the first sample computes the prompt's logprobs."""
        params = self.params
        if params.num_samples == 1:
            return params
        logprobs = params.logprobs
        if params.num_samples > params.n and logprobs is None:
            logprobs = 0
        return dataclasses.replace(
            params, n=1, best_of=None, logprobs=logprobs,
            seed=None if params.seed is None else params.seed + index,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            max_tokens=params.max_tokens,
        )

    @property
    def finished(self) -> bool:
        return all(s is not None and s.finished for s in self.samples)

    def output(self) -> RequestOutput | None:
        """The client's view now, as the request's output kind asks; None when it has
        nothing to give: FINAL_ONLY or best_of > n unfinished (the best are known only
        at the end), or DELTA with nothing new."""
        params = self.params
        best_of = params.num_samples > params.n
        finished = self.finished
        if (best_of or params.output_kind is RequestOutputKind.FINAL_ONLY) and not finished:
            return None
        samples = [s if s is not None else CompletionOutput(i, "", [], None, None) for i, s in enumerate(self.samples)]
        if best_of:
            ranked = sorted(samples, key=lambda s: -(s.cumulative_logprob or 0.0))[: params.n]
            keep_logprobs = params.logprobs is not None
            samples = [dataclasses.replace(s, index=i, logprobs=s.logprobs if keep_logprobs else None,
                                           cumulative_logprob=s.cumulative_logprob if keep_logprobs else None)
                       for i, s in enumerate(ranked)]
        prompt_logprobs, prompt_logprob_ranks = self.prompt_logprobs, self.prompt_logprob_ranks
        if params.output_kind is RequestOutputKind.DELTA:
            samples = self._deltas(samples)
            if not samples:
                return None
            if self._prompt_logprobs_given:
                prompt_logprobs = prompt_logprob_ranks = None
            elif prompt_logprobs is not None:
                self._prompt_logprobs_given = True
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=samples,
            finished=finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            prompt_logprob_ranks=list(prompt_logprob_ranks) if prompt_logprob_ranks is not None else None,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _deltas(self, samples: list[CompletionOutput]) -> list[CompletionOutput]:
        """What is new in each sample since the last output (its token ids, text and
        logprobs; the cumulative logprob stays a total), for the samples that changed;
        records it as given."""
        deltas = []
        for s in samples:
            tokens, chars, finish_given = self._given[s.index]
            if len(s.token_ids) == tokens and len(s.text) == chars and (finish_given or not s.finished):
                continue
            deltas.append(dataclasses.replace(
                s, text=s.text[chars:], token_ids=s.token_ids[tokens:],
                logprobs=s.logprobs[tokens:] if s.logprobs is not None else None))
            self._given[s.index] = (len(s.token_ids), len(s.text), s.finished)
        return deltas


class OutputProcessor:
    """Detokenises, applies stop strings, and gathers samples into parents."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self._samples: dict[str, _Sample] = {}

    def add(self, parent: ParentRequest) -> list[tuple[str, SamplingParams]]:
        """Register ``parent``; returns its samples' (request id, parameters) for the
        scheduler. Raises ValueError for a duplicate id."""
        if parent.request_id in self.parents:
            raise ValueError(f"request id {parent.request_id!r} is already in use")
        children = [(parent.child_id(i), parent.child_params(i)) for i in range(parent.params.num_samples)]
        for index, (child_id, params) in enumerate(children):
            detokenizer = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                           if self.tokenizer is not None and params.detokenize else None)
            self._samples[child_id] = _Sample(parent, index, params, detokenizer)
        self.parents[parent.request_id] = parent
        return children

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [] if parent is None else [parent.child_id(i) for i in range(parent.params.num_samples)]

    def remove(self, parent_id: str) -> None:
        for child_id in self.child_ids(parent_id):
            self._samples.pop(child_id, None)
        self.parents.pop(parent_id, None)

    def process(self, request: Request) -> tuple[ParentRequest, bool]:
        """Update ``request``'s sample from its new tokens. Returns its parent and
        whether a stop string just ended the request (the caller finishes it in the
        scheduler; a request already finished gets finish reason "stop")."""
        sample = self._samples[request.request_id]
        params = sample.params
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop and not request.is_finished():
            return sample.parent, False  # nothing to show or search until it ends
        text, stopped = self._text(sample, request)
        if stopped and request.is_finished():
            request.status = RequestStatus.FINISHED_STOPPED
        finished = request.is_finished() or stopped
        parent = sample.parent
        parent.samples[sample.index] = CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            finish_reason=("stop" if stopped else request.finish_reason) if finished else None,
            stop_reason=request.stop_reason,
        )
        if sample.index == 0 and request.num_cached_tokens > 0:
            parent.num_cached_tokens = request.num_cached_tokens
        if request.prompt_logprobs is not None:
            parent.prompt_logprobs = request.prompt_logprobs
            parent.prompt_logprob_ranks = request.prompt_logprob_ranks
        return parent, stopped

    def _text(self, sample: _Sample, request: Request) -> tuple[str, bool]:
        """The text to show and whether a stop string was found (then
        ``request.stop_reason`` is set)."""
        if sample.detokenizer is None:
            return "", False
        finished = request.is_finished()
        full = sample.detokenizer.update(request.output_token_ids, finished)
        stops = sample.params.stop
        if not stops:
            sample.shown = full
            return full, False
        longest = max(len(s) for s in stops)
        start = max(0, sample.searched - longest + 1)
        sample.searched = len(full)
        hits = [(i, s) for s in stops if (i := full.find(s, start)) >= 0]
        if hits:
            index, stop = min(hits)
            request.stop_reason = stop
            end = index + len(stop) if sample.params.include_stop_str_in_output else index
            sample.shown = full[: max(end, len(sample.shown))]
            return sample.shown, True
        if finished:
            sample.shown = full
        else:  # hold back what could still be the start of a stop string
            sample.shown = full[: max(len(sample.shown), len(full) - (longest - 1))]
        return sample.shown, False
