"""ModelRunner: owns this rank's model and turns a scheduler step into sampled tokens.

Runs inside the worker process of one TP rank (or in-process for the uni executor).
Every rank receives the same `SchedulerOutput`, runs the same forward pass (the
collectives line up), gets the same all-gathered logits and samples the same tokens;
when every token of the step is a plain argmax (`Sampler.argmax_suffices`), the ranks
exchange one (value, id) pair per row instead of the logits (`compute_greedy_tokens`).
Only the output rank's result travels back to the engine. Platform-specific attention
lives in the attention backend chosen for this rank's device; the runner only lays the
step out (`AttentionMetadata`) and tells the backend which requests finished.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from model_loader import get_model, get_model_loader
from model_loader.utils import process_weights_after_loading
from models.layers.attention import Attention, AttentionBackend, AttentionMetadata, get_attn_backend
from worker.kv_cache import KVCacheConfig, KVCacheMemory, KVCacheSpec, allocate_kv_cache
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from worker.sampler import Sampler, prompt_logprobs

if TYPE_CHECKING:
    from config import EngineConfig, SamplingParams

PROMPT_LOGPROBS_ROWS = 256  # rows of prompt logits made at once: bounds the [rows, vocab] floats held


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model: nn.Module | None = None
        self.attn_backend: AttentionBackend | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_memory: KVCacheMemory | None = None  # what holds kv_caches' memory
        self.kv_cache_config: KVCacheConfig | None = None
        self.sampler = Sampler()
        # Each running request's SamplingParams, sent once at admission (ScheduledRequest).
        self._sampling_params: dict[str, SamplingParams] = {}
        # The token each request sampled in its latest step: what a placeholder stands for.
        self._last_sampled: dict[str, int] = {}

    def load_model(self, checkpoint: str | None = None) -> None:
        """Build and load this rank's model, from `checkpoint` (a directory in the
        config's load format) instead of `config.model` when given."""
        config = self.config
        if checkpoint is not None:
            config = copy.copy(config)
            config.model_config = dataclasses.replace(config.model_config, model=checkpoint)
        self.model = get_model(config)
        self.attn_backend = get_attn_backend(self.device.type, len(self._attention_layers()))

    @torch.no_grad()
    def update_weights(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new values into the model in place: every weight from the checkpoint
        directory `source` (the config's load format; WeightLoadError naming what is
        missing), or the named, unsharded checkpoint tensors in `source` (any subset;
        each weight_loader takes this rank's slice). Derived copies (the CPU's packed
        weights) are rebuilt. Raises ValueError under quantisation, whose processed
        weights cannot take checkpoint values again."""
        model = self._require_model()
        quantization = self.config.model_config.quantization
        if quantization is not None:
            raise ValueError(f"update_weights is not supported with quantization={quantization!r}")
        if isinstance(source, str):
            model_config = dataclasses.replace(self.config.model_config, model=source)
            get_model_loader(self.config.load_config).load_weights(model, model_config)
        else:
            model.load_weights(source)
        process_weights_after_loading(model)

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("load_model() must run before the model is used")
        return self.model

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self._require_model().modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A dummy full-causal forward of `num_tokens` tokens plus logits for every
        sequence's last token: the largest activation footprint a step can have."""
        model = self._require_model()
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.config.model_config.max_model_len
        hidden = model(input_ids, positions)
        num_seqs = min(self.config.scheduler_config.max_num_seqs, num_tokens)
        model.compute_logits(hidden[-num_seqs:])

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The cache this rank's layers need per block; ValueError if the layers differ
        (one tensor shape serves every layer)."""
        specs = {layer.get_kv_cache_spec() for layer in self._attention_layers()}
        if len(specs) != 1:
            raise ValueError(f"attention layers need different KV cache layouts: {specs}")
        (spec,) = specs
        return KVCacheSpec(len(self._attention_layers()), self.config.cache_config.block_size,
                           spec.num_kv_heads, spec.head_size, spec.dtype)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate one cache tensor per layer and bind each to its layer, with the
        backend's impl for it."""
        assert self.attn_backend is not None
        c = kv_cache_config
        shape = self.attn_backend.get_kv_cache_shape(c.num_blocks, c.block_size, c.num_kv_heads_per_rank, c.head_dim)
        self.kv_cache_memory = allocate_kv_cache(shape, c.dtype, len(self._attention_layers()), self.device)
        self.kv_caches = self.kv_cache_memory.tensors
        self.kv_cache_config = kv_cache_config
        self.bind_kv_caches()

    def bind_kv_caches(self) -> None:
        """Attach the allocated caches to the model's layers (again, after the model
        was rebuilt by a wake-up), each with a fresh impl of the backend."""
        assert self.attn_backend is not None
        for layer, cache in zip(self._attention_layers(), self.kv_caches, strict=True):
            layer.bind_kv_cache(cache, self.attn_backend.make_impl(layer))

    def release_model(self) -> None:
        """Drop the model and the backend's per-request state (sleep level 2); the
        caches stay allocated or released as they are. `load_model()` builds it again."""
        self.model = None
        self.attn_backend = None

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        assert self.kv_cache_config is not None and self.attn_backend is not None
        block_size = self.kv_cache_config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for req in scheduler_output.scheduled:
            n = len(req.token_ids)
            input_ids.extend(req.token_ids)
            for pos in range(req.start_pos, req.start_pos + n):
                positions.append(pos)
                slots.append(req.block_ids[pos // block_size] * block_size + pos % block_size)
            seq_lens.append(req.start_pos + n)
            query_start_loc.append(query_start_loc[-1] + n)
        # One tensor from one flat list: a tensor and a row copy per request cost a
        # 32-sequence decode step 136 µs here (warm), the flat list 14.
        max_blocks = max(len(r.block_ids) for r in scheduler_output.scheduled)
        table: list[int] = []
        for req in scheduler_output.scheduled:
            table.extend(req.block_ids)
            table.extend([0] * (max_blocks - len(req.block_ids)))
        block_tables = torch.tensor(table, dtype=torch.long, device=self.device).view(len(seq_lens), max_blocks)
        common = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            block_size=block_size,
            req_ids=tuple(r.req_id for r in scheduler_output.scheduled),
        )
        self.attn_backend.requests_finished(scheduler_output.finished_req_ids)
        md = self.attn_backend.build_metadata(common)
        # The last token of each chunk that samples is where its logits come from.
        sample_rows = [query_start_loc[i + 1] - 1 for i, r in enumerate(scheduler_output.scheduled) if r.sample]
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, md, sample_rows

    def _fill_request_state(self, scheduler_output: SchedulerOutput) -> None:
        """Give every scheduled request its SamplingParams, in place: those that came with
        its admission are kept until it finishes, and set on its later steps (each step's
        message is new: unpickled here, or built afresh by the in-process scheduler).
        A placeholder token (async scheduling) becomes the token this rank sampled for
        the request in the previous step. Raises RuntimeError for a request whose params
        never came (a scheduler that skipped its admission), or a placeholder with no
        sampled token behind it."""
        for req_id in scheduler_output.finished_req_ids:
            self._sampling_params.pop(req_id, None)
            self._last_sampled.pop(req_id, None)
        for req in scheduler_output.scheduled:
            if req.token_ids and req.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                token = self._last_sampled.get(req.req_id)
                if token is None:
                    raise RuntimeError(f"request {req.req_id!r} was scheduled after a step that sampled nothing "
                                       "for it: its placeholder token has no value")
                req.token_ids[-1] = token
            if req.sampling_params is not None:
                self._sampling_params[req.req_id] = req.sampling_params
                continue
            params = self._sampling_params.get(req.req_id)
            if params is None:
                raise RuntimeError(f"request {req.req_id!r} was scheduled without its sampling params ever "
                                   "being sent (they come with its admission)")
            req.sampling_params = params

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step (all `num_steps` of a multi-step output) and sample. Called on
        every rank with the same output; raises RuntimeError for a multi-step output
        with a request that does not decode exactly one token."""
        self._require_model()
        self.sampler.drop(scheduler_output.finished_req_ids)
        self._fill_request_state(scheduler_output)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput([], [], [])
        for req in scheduler_output.scheduled:
            if req.history is not None:
                self.sampler.add_history(req.req_id, *req.history)
        output = self._run_step(scheduler_output)
        step = scheduler_output
        for _ in range(1, scheduler_output.num_steps):
            step = self._following_step(step)
            following = self._run_step(step)
            output.later_token_ids.append(following.sampled_token_ids)
            output.later_logprobs.append(following.logprobs)
        return output

    def _following_step(self, step: SchedulerOutput) -> SchedulerOutput:
        """The next decode step of a multi-step output: each request's token sampled in
        `step`, at the position after it, with the same block table (the scheduler
        allocated every step's slot)."""
        scheduled = []
        for req in step.scheduled:
            if not req.sample or len(req.token_ids) != 1:
                raise RuntimeError(f"a multi-step output must only decode, but request {req.req_id!r} has "
                                   f"{len(req.token_ids)} tokens (sample={req.sample})")
            scheduled.append(ScheduledRequest(
                req_id=req.req_id, token_ids=[self._last_sampled[req.req_id]], start_pos=req.start_pos + 1,
                block_ids=req.block_ids, sample=True, sampling_params=req.sampling_params,
                num_output_tokens=req.num_output_tokens + 1,
            ))
        return SchedulerOutput(scheduled, [], len(scheduled))

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass of the step's tokens, and one token sampled per request that
        samples (its state already filled in)."""
        model = self._require_model()
        input_ids, positions, md, sample_rows = self._prepare_inputs(scheduler_output)
        hidden = model(input_ids, positions, md)
        prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output)
        sampled_reqs = [r for r in scheduler_output.scheduled if r.sample]
        if not sampled_reqs:
            return ModelRunnerOutput([], [], [], prompt_logprobs)
        req_ids = [r.req_id for r in sampled_reqs]
        if hasattr(model, "compute_greedy_tokens") and self.sampler.argmax_suffices(sampled_reqs):
            # The argmax alone: at TP > 1 the ranks exchange one (value, id) per row
            # instead of all-gathering [rows, vocab] logits.
            tokens = model.compute_greedy_tokens(hidden[sample_rows]).tolist()
            self._last_sampled.update(zip(req_ids, tokens))
            return ModelRunnerOutput(req_ids, tokens, [None] * len(tokens), prompt_logprobs)
        logits = model.compute_logits(hidden[sample_rows]).float().cpu()
        tokens, logprobs = self.sampler(logits, sampled_reqs, self.config.seed)
        self._last_sampled.update(zip(req_ids, tokens))
        return ModelRunnerOutput(req_ids, tokens, logprobs, prompt_logprobs)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> dict[str, tuple[int, list[dict[int, float]], list[int]]]:
        """The prompt logprobs of the prompt positions this step computed, for requests
        that asked (their history holds the prompt, so the token after a chunk's last
        position is known). Logits are made a slice of rows at a time, so that a long
        chunk never holds [chunk, vocab] floats at once; every rank makes the same
        slices, as compute_logits gathers across ranks."""
        model = self._require_model()
        result: dict[str, tuple[int, list[dict[int, float]], list[int]]] = {}
        row = 0
        for req in scheduler_output.scheduled:
            first_row, row = row, row + len(req.token_ids)
            k = req.sampling_params.prompt_logprobs
            history = self.sampler.history(req.req_id)
            if k is None or history is None:
                continue
            prompt = history.prompt_token_ids
            # Position p predicts token p + 1; the last prompt position predicts an output.
            end = min(req.start_pos + len(req.token_ids), len(prompt) - 1)
            if end <= req.start_pos:
                continue
            entries: list[dict[int, float]] = []
            ranks: list[int] = []
            for lo in range(req.start_pos, end, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
                rows = hidden[first_row + lo - req.start_pos: first_row + hi - req.start_pos]
                logits = model.compute_logits(rows).float().cpu()
                for entry, rank in prompt_logprobs(logits, prompt[lo + 1: hi + 1], k):
                    entries.append(entry)
                    ranks.append(rank)
            result[req.req_id] = (req.start_pos + 1, entries, ranks)
        return result


# vLLM's name, for users who look for it.
GPUModelRunner = ModelRunner
