"""The batched, on-device Sampler: the same tokens and logprobs as sampling each row
alone, whatever else is in the batch, and only ids and asked-for logprobs cross to the
host.

The reference below samples one row at a time, straight from SamplingParams' contract.
The Sampler must match it bit for bit on the CPU. Each of its ops works along the
vocab only, so batching changes nothing. The `cuda` tests check that the same requests
give the same tokens with the logits on a GPU.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from config import SamplingParams
from worker import sampler as sampler_module
from worker.logits_processors import RequestHistory, apply_logits_processors
from worker.outputs import ScheduledRequest
from worker.sampler import Sampler, prompt_logprobs, request_step_seed
from worker.sampling_metadata import SamplingMetadata

VOCAB = 300
HISTORY = ([5, 7, 7, 11, 250], [7, 13, 13, 299])  # (prompt, outputs) of every request with a history


def sreq(req_id: str, num_output_tokens: int = 0, bad_words: list[list[int]] | None = None,
         **params: object) -> ScheduledRequest:
    sampling_params = SamplingParams(**params)  # type: ignore[arg-type]
    sampling_params.bad_words_token_ids = bad_words or []
    return ScheduledRequest(req_id=req_id, token_ids=[1], start_pos=0, block_ids=[0], sample=True,
                            sampling_params=sampling_params, num_output_tokens=num_output_tokens)


# ----------------------------------------------------------------- the per-row reference


def reference_processed(row: torch.Tensor, request: ScheduledRequest, history: tuple[list[int], list[int]] | None
                        ) -> torch.Tensor:
    """SamplingParams' processors, in their order, on one row."""
    p, row = request.sampling_params, row.clone()
    tokens = history[0] + history[1] if history else []
    if p.allowed_token_ids is not None:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[[t for t in p.allowed_token_ids if t < VOCAB]] = True
        row[~keep] = -math.inf
    for *head, last in p.bad_words_token_ids:
        if not head or tokens[len(tokens) - len(head):] == head:
            row[last] = -math.inf
    if request.num_output_tokens < p.min_tokens:
        row[[t for t in p.all_stop_token_ids if t < VOCAB]] = -math.inf
    for token, bias in p.logit_bias.items():
        if token < VOCAB:
            row[token] += torch.tensor(bias, dtype=torch.float32)
    if history and p.repetition_penalty != 1.0:
        for token in sorted(set(tokens)):
            value = row[token]
            value = value * p.repetition_penalty if value < 0 else value / p.repetition_penalty
            row[token] = torch.nan_to_num(value, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if history and (p.frequency_penalty or p.presence_penalty):
        for token in set(history[1]):
            count = torch.tensor(float(history[1].count(token)))
            row[token] -= p.frequency_penalty * count + p.presence_penalty * torch.tensor(1.0)
    return row


def reference_token(row: torch.Tensor, request: ScheduledRequest, engine_seed: int) -> int:
    """Greedy argmax, or temperature, top-k, top-p, min-p and an inverse-CDF draw."""
    p = request.sampling_params
    if p.is_greedy:
        return int(torch.argmax(row))
    scaled = torch.nan_to_num(row / p.temperature, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if 0 < p.top_k < VOCAB:
        scaled[scaled < torch.topk(scaled, p.top_k).values[-1]] = -math.inf
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered
        for position in range(1, VOCAB):
            if before[position] >= p.top_p:
                probs[order[position]] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0:
        return int(torch.argmax(scaled))
    generator = torch.Generator().manual_seed(request_step_seed(request, engine_seed))
    target = torch.rand(1, dtype=torch.float64, generator=generator).item() * total
    for token in range(VOCAB):
        if cdf[token] > target:
            return token
    return int(torch.nonzero(probs).max())


def reference_logprobs(row: torch.Tensor, k: int | None, token: int) -> dict[int, float] | None:
    if k is None:
        return None
    logprobs = torch.log_softmax(row, dim=-1)
    result = {}
    if k:
        top = torch.topk(logprobs, k)
        result = dict(zip(top.indices.tolist(), top.values.tolist()))
    result[token] = logprobs[token].item()
    return result


def reference(logits: torch.Tensor, requests: list[ScheduledRequest], engine_seed: int = 0
              ) -> tuple[list[int], list[dict[int, float] | None]]:
    tokens, logprobs = [], []
    for row, request in zip(logits, requests):
        history = HISTORY if request.sampling_params.needs_history else None
        token = reference_token(reference_processed(row, request, history), request, engine_seed)
        tokens.append(token)
        logprobs.append(reference_logprobs(row, request.sampling_params.logprobs, token))
    return tokens, logprobs


def sampler_for(requests: list[ScheduledRequest]) -> Sampler:
    sampler = Sampler()
    for request in requests:
        if request.sampling_params.needs_history:
            sampler.add_history(request.req_id, *HISTORY)
    return sampler


# ----------------------------------------------------------------- requests and logits

MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.0, logprobs=3, repetition_penalty=1.3),
    dict(seed=1, temperature=0.8, top_k=20, top_p=0.9, logprobs=2),
    dict(seed=2, temperature=1.3, min_p=0.05, frequency_penalty=0.7, presence_penalty=-0.4),
    dict(seed=3, temperature=0.5, top_p=0.5, logit_bias={4: 8.0, 9: -100.0, VOCAB + 3: 1.0}, logprobs=0),
    dict(seed=4, top_k=5, allowed_token_ids=[1, 2, 3, 40, 41, VOCAB + 1], logprobs=3),
    dict(temperature=0.0, bad_words=[[13, 299, 40], [13, 99], [17]], min_tokens=9, stop_token_ids=[2]),
    dict(temperature=0.9, repetition_penalty=0.8, top_k=VOCAB - 1),  # unseeded: the request id's stream
    dict(seed=5, temperature=2.0, top_p=1e-6, logprobs=1),
]


def mixed_requests(step: int = 0) -> list[ScheduledRequest]:
    return [sreq(f"req-{i}", step + i, **params) for i, params in enumerate(MIXED)]  # type: ignore[arg-type]


def mixed_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), VOCAB, generator=g) * 3
    logits[1, :40] = logits[1, 40]  # ties for the argmax and the top-k
    return logits


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", range(4))
def test_batched_sampler_matches_the_per_row_reference_on_a_mixed_batch(seed: int) -> None:
    logits = mixed_logits(seed)
    for step in range(3):
        requests = mixed_requests(step)
        tokens, logprobs = sampler_for(requests)(logits, requests, engine_seed=seed)
        assert (tokens, logprobs) == reference(logits, requests, engine_seed=seed)


def test_drawing_in_cpu_row_chunks_gives_the_same_as_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the drawing rows go through a few at a time (cache-sized chunks); the
    chunk size changes nothing, fallback rows included."""
    requests = mixed_requests(1)
    logits = mixed_logits(9)
    logits[3] = float("nan")
    whole = sampler_for(requests)(logits, requests)
    for rows_per_chunk in (1, 2, 4):
        monkeypatch.setattr(sampler_module, "CPU_SAMPLING_CHUNK_ELEMENTS", rows_per_chunk * VOCAB)
        assert sampler_for(requests)(logits, requests) == whole == reference(logits, requests)


def test_allowed_ids_all_past_the_vocab_mask_the_whole_row() -> None:
    request = sreq("a", temperature=0.0, allowed_token_ids=[VOCAB, VOCAB + 7], logprobs=1)
    logits = mixed_logits(2)[:1]
    assert Sampler()(logits, [request]) == reference(logits, [request])


def test_logits_processors_match_the_per_row_reference_bit_for_bit() -> None:
    requests = mixed_requests(2)
    logits = mixed_logits(3)
    histories = [RequestHistory(*HISTORY) if r.sampling_params.needs_history else None for r in requests]
    meta = SamplingMetadata.build(requests, histories, [0] * len(requests), VOCAB, logits.device)
    assert meta.processors is not None
    processed = logits.clone()
    apply_logits_processors(processed, meta.tensors)
    for row, (request, history) in enumerate(zip(requests, histories)):
        expected = reference_processed(logits[row], request, HISTORY if history else None)
        assert torch.equal(processed[row], expected), (row, request.sampling_params)


def test_rows_without_mass_fall_back_to_the_argmax_and_leave_the_others_alone() -> None:
    requests = mixed_requests()
    logits = mixed_logits(7)
    logits[3] = float("nan")  # softmax of NaN: no mass to draw from
    logits[7, 100] = float("inf")  # the largest float after nan_to_num: the only mass
    tokens, logprobs = sampler_for(requests)(logits, requests)
    assert (tokens, logprobs) == reference(logits, requests)
    assert tokens[3] == 0 and tokens[7] == 100


def test_a_requests_token_does_not_depend_on_the_rest_of_its_batch() -> None:
    requests, logits = mixed_requests(3), mixed_logits(11)
    alone = [sampler_for([r])(logits[i:i + 1], [r]) for i, r in enumerate(requests)]
    order = list(range(len(requests)))
    random.Random(0).shuffle(order)
    extra = sreq("extra", 0, seed=9, temperature=1.0, logprobs=4)
    batch = [requests[i] for i in order] + [extra]
    rows = torch.cat([logits[order], torch.randn(1, VOCAB)])
    tokens, logprobs = sampler_for(batch)(rows, batch)
    for position, i in enumerate(order):
        assert ([tokens[position]], [logprobs[position]]) == alone[i]


class HostReads(TorchFunctionMode):
    """Records every read into host memory (`tolist`, `item`, `float()`, `.cpu()`, ...)
    of data derived from `source`: a tensor is derived when an op had a derived
    input (all the op's tensors and outputs become derived, a conservative taint)."""

    READS = frozenset({"tolist", "item", "numpy", "__float__", "__int__", "__bool__", "__index__", "cpu"})

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.derived = [source]
        self.reads: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        derived = any(t is d for t in tensors for d in self.derived)
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in tree_leaves((args[1:], kwargs)))
        if derived and (name in self.READS or to_host):
            self.reads.append((name, tensors[0].numel()))
        out = func(*args, **kwargs)
        if derived:
            self.derived += tensors + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_only_ids_and_asked_for_logprobs_cross_to_the_host_in_one_transfer() -> None:
    requests = mixed_requests()
    logits = mixed_logits(5)
    sampler = sampler_for(requests)
    with HostReads(logits) as reads:
        sampler(logits, requests)
    max_k = max(r.sampling_params.logprobs or 0 for r in requests)
    assert len(reads.reads) == 1, reads.reads
    name, count = reads.reads[0]
    assert name == "tolist" and count <= len(requests) * (3 + 2 * max_k) < VOCAB


def test_prompt_logprobs_read_the_host_once_and_match_log_softmax() -> None:
    logits = mixed_logits(6)
    next_tokens = [3, 40, 41, 0, 299, 7, 7, 8, 9]
    with HostReads(logits) as reads:
        result = prompt_logprobs(logits, next_tokens, 2)
    assert [name for name, _ in reads.reads] == ["tolist"] and reads.reads[0][1] == len(next_tokens) * 6
    expected = torch.log_softmax(logits, dim=-1)
    for row, ((entry, rank), token) in enumerate(zip(result, next_tokens)):
        assert entry == reference_logprobs(logits[row], 2, token)
        assert rank == int((expected[row] > expected[row, token]).sum()) + 1


class AtenOps(TorchDispatchMode):
    """The aten ops run, with their outputs' sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, max(sizes, default=0)))
        return out


def test_logits_are_copied_only_when_a_row_processes_them_and_never_changed() -> None:
    logits = mixed_logits(8)
    original = logits.clone()
    rows_x_vocab = len(MIXED) * VOCAB
    greedy = [sreq(f"g{i}", temperature=0.0, logprobs=None) for i in range(len(MIXED))]
    with AtenOps() as ops:
        Sampler()(logits, greedy)
    assert max(size for _, size in ops.ops) < rows_x_vocab  # an argmax: nothing the logits' size
    drawing = [sreq(f"d{i}", seed=i, top_p=0.8) for i in range(len(MIXED))]
    with AtenOps() as ops:
        Sampler()(logits, drawing)
    assert "clone" not in [name for name, _ in ops.ops]
    requests = mixed_requests()
    with AtenOps() as ops:
        sampler_for(requests)(logits, requests)
    assert [name for name, _ in ops.ops].count("clone") == 1
    assert torch.equal(logits, original)


# ----------------------------------------------------------------- on a GPU

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def separated_logits(rows: int) -> torch.Tensor:
    """A few tokens of clearly different probability per row and the rest far below, so
    that float rounding on another device cannot move a draw across a CDF boundary."""
    logits = torch.full((rows, VOCAB), -30.0)
    for row in range(rows):
        logits[row, [row, 50 + row, 100 + row, 200 + row]] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    return logits


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("seed", range(3))
def test_cuda_greedy_rows_give_the_cpu_tokens(seed: int) -> None:
    requests = [sreq(f"g{i}", i, temperature=0.0, **extra) for i, extra in enumerate(
        [{}, {"logprobs": 3}, {"repetition_penalty": 1.3}, {"logit_bias": {5: 3.0}}, {"allowed_token_ids": [1, 9]},
         {"bad_words": [[17]], "frequency_penalty": 0.5}])]  # type: ignore[arg-type]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    on_cpu = sampler_for(requests)(logits, requests)
    on_gpu = sampler_for(requests)(logits.cuda(), requests)
    assert on_gpu[0] == on_cpu[0]
    assert on_gpu[1][1].keys() == on_cpu[1][1].keys()
    assert all(abs(on_gpu[1][1][t] - v) < 1e-5 for t, v in on_cpu[1][1].items())


@pytest.mark.cuda
@requires_cuda
def test_cuda_seeded_draws_give_the_cpu_tokens_on_well_separated_distributions() -> None:
    logits = separated_logits(8)
    for step in range(20):
        requests = [sreq(f"s{i}", step, seed=i, **extra) for i, extra in enumerate(
            [{}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.2}, {"temperature": 0.7, "logprobs": 2},
             {"temperature": 1.5, "top_k": 2, "top_p": 0.9}, {"presence_penalty": 1.0}, {"temperature": 0.0}])]
        on_cpu = sampler_for(requests)(logits, requests)
        on_gpu = sampler_for(requests)(logits.cuda(), requests)
        assert on_gpu[0] == on_cpu[0], step
        assert on_gpu[1][4].keys() == on_cpu[1][4].keys()


@pytest.mark.cuda
@requires_cuda
def test_cuda_sampling_syncs_once_and_prompt_logprobs_once() -> None:
    """CUDA's sync debug mode warns at every synchronizing call: a step's sampling
    (processors, draws, logprobs) has exactly one, its `.tolist()`."""
    import warnings

    requests = mixed_requests()
    logits = mixed_logits(4).cuda()
    sampler = sampler_for(requests)
    sampler(logits, requests)  # warm-up: lazy CUDA initialisation may sync
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler(logits, requests)
            sampling_syncs = len(caught)
            prompt_logprobs(logits, list(range(len(MIXED))), 3)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert sampling_syncs == 1, [str(w.message) for w in caught]
    assert len(caught) == 2, [str(w.message) for w in caught]
