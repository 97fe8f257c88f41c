"""SamplingMetadata (vLLM's name): a step's per-row sampling parameters, built once
on the host and moved to the logits' device in two small copies.

The Sampler builds it on every rank from the same requests, histories and engine seed,
so it is the same on every rank. The host part says which rows do what: greedy or
drawn, top-k, top-p, min-p, logprobs. These are Python lists, so the Sampler never has
to read a device tensor to branch. The device part holds the same parameters as small
tensors: temperatures, top-k/top-p/min-p values, each drawn row's uniform, and the
logits processors' entries. All ints travel in one int64 tensor and all floats in one
float64 tensor, each copied with non_blocking=True (from pinned memory on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.logits_processors import LogitsProcessorInputs, RequestHistory

if TYPE_CHECKING:  # engine sits above worker; only the message's shape is needed here
    from worker.outputs import ScheduledRequest


def draw_uniform(seed: int) -> float:
    """The uniform in [0, 1) that a request draws its token at, from a CPU generator
    seeded with `seed`: the same float64 on every rank and device, whatever the batch."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return torch.rand(1, dtype=torch.float64, generator=generator).item()


def to_device(ints: dict[str, list[int] | torch.Tensor], floats: dict[str, list[float] | torch.Tensor],
              device: torch.device) -> dict[str, torch.Tensor]:
    """The named non-empty host arrays (lists, or 1-D CPU tensors) as tensors on
    `device`: int64 and float64 views of one int64 and one float64 tensor, so each dtype
    is copied once (or not at all, when all its arrays are empty), with
    non_blocking=True. Empty arrays are left out. On CUDA the host side is pinned. The
    copy is then truly asynchronous, and the caching host allocator keeps the pinned
    block until the copy is done."""
    pin = device.type == "cuda"
    result: dict[str, torch.Tensor] = {}
    for arrays, dtype in ((ints, torch.int64), (floats, torch.float64)):
        host = {name: torch.as_tensor(values, dtype=dtype) for name, values in arrays.items() if len(values)}
        if not host:
            continue
        packed = torch.cat(list(host.values())) if len(host) > 1 else next(iter(host.values()))
        packed = (packed.pin_memory() if pin else packed).to(device, non_blocking=True)
        start = 0
        for name, values in host.items():
            result[name] = packed[start:start + values.numel()]
            start += values.numel()
    return result


@dataclass
class SamplingMetadata:
    """What each row of a step's logits needs.

    Host lists (global rows index the logits; local rows index `random_rows`):
      * `greedy_rows`: the exact argmax (first maximum) of the processed logits.
      * `random_rows`: temperature, then top-k (`top_k_rows`, local, ascending, with k
        `top_k[j]` in (1, vocab)), top-p (`top_p_rows`, local, ascending, p < 1), min-p
        (if `uses_min_p`), then a draw at `uniforms[j]`.
      * `logprob_rows` with `logprob_ks[j]` top logprobs each (0: only the sampled one);
        `logprob_groups` maps each k > 0 to its positions in `logprob_rows`, in order of
        first appearance (a batched topk gives each row what topk of that row alone
        gives, ties included, whereas a slice of a larger k might not).
      * `processors`: the logits processors' entries, or None when no row has any.
    `tensors` holds the same values on the device, those that are not empty:
    "greedy_rows" (only beside drawing rows), "random_rows", "logprob_rows" (int64),
    "temperature", "top_p", "min_p" (float32, [n, 1]), "top_k" (int64, [n, 1]),
    "uniforms" (float64, [n]), "logprob_group.{k}" (int64), and the processors' "lp.*"
    entries.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: list[int]
    random_rows: list[int]
    top_k_rows: list[int]
    top_k: list[int]
    top_p_rows: list[int]
    uses_min_p: bool
    uniforms: list[float]
    logprob_rows: list[int]
    logprob_ks: list[int]
    logprob_groups: dict[int, list[int]]
    processors: LogitsProcessorInputs | None
    tensors: dict[str, torch.Tensor]

    @classmethod
    def build(cls, requests: list[ScheduledRequest], histories: list[RequestHistory | None], seeds: list[int | None],
              vocab_size: int, device: torch.device) -> SamplingMetadata:
        """The metadata of rows `requests` (row i is requests[i], with `histories[i]` and,
        for a row that draws, the generator seed `seeds[i]`). Makes the step's two
        host-to-device copies."""
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        top_k_rows: list[int] = []
        top_p_rows: list[int] = []
        logprob_rows: list[int] = []
        logprob_ks: list[int] = []
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        uniforms: list[float] = []
        processors = LogitsProcessorInputs(len(requests), vocab_size)
        processes_logits = False
        for row, (request, history, seed) in enumerate(zip(requests, histories, seeds, strict=True)):
            params = request.sampling_params
            if params.processes_logits:
                processes_logits = True
                processors.add_request(row, params, request.num_output_tokens, history)
            if params.logprobs is not None:
                logprob_rows.append(row)
                logprob_ks.append(params.logprobs)
            if params.is_greedy:
                greedy_rows.append(row)
                continue
            assert seed is not None, "a row that draws needs its generator seed"
            if 0 < params.top_k < vocab_size:
                top_k_rows.append(len(random_rows))
                top_k.append(params.top_k)
            if params.top_p < 1.0:
                top_p_rows.append(len(random_rows))
                top_p.append(params.top_p)
            random_rows.append(row)
            temperature.append(params.temperature)
            min_p.append(params.min_p)
            uniforms.append(draw_uniform(seed))
        logprob_groups: dict[int, list[int]] = {}
        for position, k in enumerate(logprob_ks):
            if k > 0:
                logprob_groups.setdefault(k, []).append(position)
        ints: dict[str, list[int] | torch.Tensor] = {
            f"logprob_group.{k}": positions for k, positions in logprob_groups.items()}
        mixed = bool(greedy_rows) and bool(random_rows)
        ints |= {"greedy_rows": greedy_rows if mixed else [], "random_rows": random_rows, "logprob_rows": logprob_rows,
                "top_k_rows": top_k_rows, "top_k": top_k, "top_p_rows": top_p_rows}
        floats: dict[str, list[float] | torch.Tensor] = {"temperature": temperature, "top_p": top_p,
                                                          "min_p": min_p, "uniforms": uniforms}
        if processes_logits:
            processor_ints, processor_floats = processors.host_arrays()
            ints.update(processor_ints)
            floats.update(processor_floats)
        tensors = to_device(ints, floats, device)
        for name in ("temperature", "top_p", "min_p"):  # float32, as the logits they divide and compare
            if name in tensors:
                tensors[name] = tensors[name].to(torch.float32)[:, None]
        if "top_k" in tensors:
            tensors["top_k"] = tensors["top_k"][:, None]
        return cls(len(requests), vocab_size, greedy_rows, random_rows, top_k_rows, top_k,
                   top_p_rows, any(p > 0.0 for p in min_p), uniforms, logprob_rows, logprob_ks, logprob_groups,
                   processors if processes_logits else None, tensors)
