"""ModelRunner: owns this rank's model and turns a scheduler step into sampled tokens.

Runs inside the worker process of one TP rank (or in-process for the uni executor).
Every rank receives the same `SchedulerOutput`, runs the same forward pass (the
collectives line up), gets the same all-gathered logits and samples the same tokens;
when every token of the step is a plain argmax (`Sampler.argmax_suffices`), the ranks
exchange one (value, id) pair per row instead of the logits (`compute_greedy_tokens`).
Only the output rank's result travels back to the engine. Platform-specific attention
lives in the attention backend named by the config; the runner only lays the step out
(`StepInputs`, `AttentionMetadata`) and tells the backend which requests finished.
A pure-decode step that fits a captured size replays a CUDA graph instead
(`worker/cuda_graph.py`); on the CPU, its recorded ops (`worker/cpu_graph_runner.py`). Logits are sampled where they are; only the sampled ids and
the logprobs asked for come to the host, and that is where a rank waits for the step's
NCCL collectives (`device_sync_point`, so liveness sees a rank waiting for its peers).
A step with structured-output requests carries their grammar bitmask, or is told it
follows (`grammar_follows`: the engine fills it while this forward runs, and
`grammar_source` reads it once the logits are ready); the sampler applies it to their
rows first (worker/grammar_bitmask.py). Such a step never takes the argmax-only path,
since the mask needs the whole row of logits.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from config import SamplingParams
from distributed import device_sync_point
from distributed.utils import cdiv
from model_loader import get_model, get_model_loader
from model_loader.utils import process_weights_after_loading
from models.layers.attention import Attention, AttentionBackend, AttentionMetadata, get_attn_backend
from worker.cpu_graph_runner import CpuGraphRunner
from worker.cuda_graph import CudaGraphRunner
from worker.grammar_bitmask import GrammarBitmask
from worker.kv_cache import KVCacheConfig, KVCacheMemory, KVCacheSpec, allocate_kv_cache
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from worker.sampler import Sampler, prompt_logprobs
from worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from config import EngineConfig

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
        # Pure-decode steps by CUDA graph (or the same padded buffers, eagerly): set up
        # by `capture_model` where the config enables graphs.
        self.cuda_graphs: CudaGraphRunner | None = None
        # The CPU's: each decode batch size recorded on first use, then replayed.
        self.cpu_graphs: CpuGraphRunner | None = None
        # Each running request's SamplingParams, sent once at admission (ScheduledRequest).
        self._sampling_params: dict[str, SamplingParams] = {}
        # The token each request sampled in its latest step: what a placeholder stands for.
        self._last_sampled: dict[str, int] = {}
        # Where a `grammar_follows` step's bitmask comes from: set by the process that
        # serves the executor's calls (executor/worker_proc.py reads the next broadcast
        # message); called on this rank's thread, once per such step, before sampling.
        self.grammar_source: Callable[[], bytes] | None = None

    def load_model(self, checkpoint: str | None = None) -> None:
        """Build and load this rank's model, from `checkpoint` (a directory in the
        config's load format) instead of `config.model` when given."""
        config = self.config
        if checkpoint is not None:
            config = copy.copy(config)
            config.model_config = dataclasses.replace(config.model_config, model=checkpoint)
        self.model = get_model(config)
        self.attn_backend = get_attn_backend(self.config.attention_config.backend, len(self._attention_layers()))

    @torch.no_grad()
    def update_weights(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new values into the model in place: every weight from the checkpoint
        directory `source` (the config's load format; WeightLoadError naming what is
        missing), or the named, unsharded checkpoint tensors in `source` (any subset;
        each weight_loader takes this rank's slice). A weight the CPU holds packed is
        unpacked by its weight_loader when its first new values arrive and packed again
        at the end (`process_weights_after_loading` packs what is plain and leaves the
        rest): each layer holds one form of its weight at any time, plus, for one layer
        at a time, the copy being converted; layers `source` does not name stay packed
        as they were. Raises ValueError under quantisation, whose processed weights
        cannot take checkpoint values again."""
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
        if self.cpu_graphs is not None:  # recorded with the weights' old tensors: record again
            self.cpu_graphs.release()

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("load_model() must run before the model is used")
        return self.model

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self._require_model().modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A dummy full-causal forward of `num_tokens` tokens plus logits for every
        sequence's last token, while holding the largest workspace one attention call of
        the backend allocates (at max_model_len of context; zeroed, so that the CPU's
        resident memory shows it), then a sampling of those rows with every filter on:
        the largest footprint a step can have."""
        model = self._require_model()
        assert self.attn_backend is not None
        max_len = self.config.model_config.max_model_len
        workspace = max((self.attn_backend.workspace_bytes(layer, max_len) for layer in self._attention_layers()),
                        default=0)
        held = torch.zeros(workspace, dtype=torch.uint8, device=self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % max_len
        hidden = model(input_ids, positions)
        num_seqs = min(self.config.scheduler_config.max_num_seqs, num_tokens)
        logits = model.compute_logits(hidden[-num_seqs:]).float()
        # The sampler's temporaries at its most expensive (top-k, top-p, min-p, logprobs:
        # several [rows, vocab] tensors; 6 x 128 MiB at 256 rows of a 128k vocab).
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20, seed=0)
        Sampler()(logits, [ScheduledRequest(req_id=f"_profile{i}", token_ids=[0], start_pos=0, block_ids=[0],
                                            sample=True, sampling_params=params) for i in range(num_seqs)])
        del held

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

    def capture_model(self) -> float:
        """Capture the decode CUDA graphs the config enables (CUDA only; TRITON_ATTN),
        after the KV cache is bound; returns the seconds it took (0.0 with none). On the
        CPU, set up its graphs, which record each batch size at its first step."""
        sizes = self.config.compilation_config.cudagraph_capture_sizes
        cpu_max_batch = self.config.compilation_config.cpu_graph_max_batch
        supports = getattr(self.attn_backend, "supports_cpu_graphs", None)
        if self.device.type == "cpu" and cpu_max_batch and supports is not None:
            assert self.kv_cache_config is not None and self.attn_backend is not None
            if not supports(self.kv_cache_config.dtype):
                return 0.0
            block_size = self.kv_cache_config.block_size
            self.cpu_graphs = CpuGraphRunner(self._require_model(), self.attn_backend, cpu_max_batch,
                                             cdiv(self.config.model_config.max_model_len, block_size), block_size)
            return 0.0
        if not sizes or self.device.type != "cuda":
            return 0.0
        assert self.kv_cache_config is not None and self.attn_backend is not None
        block_size = self.kv_cache_config.block_size
        max_blocks = cdiv(self.config.model_config.max_model_len, block_size)
        self.cuda_graphs = CudaGraphRunner(self._require_model(), self.attn_backend, sizes, max_blocks, block_size,
                                           self.device)
        return self.cuda_graphs.capture()

    def cuda_graph_pool_estimate(self, peak_bytes: int, profiled_tokens: int) -> int:
        """What the decode graphs' memory pool will hold, from the profile run's peak at
        `profiled_tokens` tokens: activations grow about linearly with the tokens of a
        step, and the pool holds those of the largest captured batch (0 without graphs)."""
        sizes = self.config.compilation_config.cudagraph_capture_sizes
        if not sizes or self.device.type != "cuda":
            return 0
        return int(peak_bytes * min(1.0, sizes[-1] / profiled_tokens))

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs (CUDA's and the CPU's): they hold the addresses of
        the weights and the KV cache, which sleep mode is about to release (wake-up
        captures again)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
            self.cuda_graphs = None
        if self.cpu_graphs is not None:
            self.cpu_graphs.release()
            self.cpu_graphs = None

    def release_model(self) -> None:
        """Drop the model and the backend's per-request state (sleep level 2); the
        caches stay allocated or released as they are. `load_model()` builds it again."""
        self.release_cuda_graphs()
        self.model = None
        self.attn_backend = None

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
        hidden, sample_rows = self._forward(scheduler_output)
        prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output)
        sampled_reqs = [r for r in scheduler_output.scheduled if r.sample]
        if not sampled_reqs:
            return ModelRunnerOutput([], [], [], prompt_logprobs)
        req_ids = [r.req_id for r in sampled_reqs]
        grammar = None
        bitmask = scheduler_output.grammar_bitmask
        if scheduler_output.grammar_follows:  # made by the engine while the forward ran
            if self.grammar_source is None:
                raise RuntimeError("this step's grammar bitmask follows it, but this rank has no grammar_source "
                                   "(only an executor with supports_grammar_overlap sends one)")
            bitmask = self.grammar_source()
        if bitmask is not None:  # structured outputs: these rows are masked
            row_of = {req_id: row for row, req_id in enumerate(req_ids)}
            grammar = GrammarBitmask([row_of[r] for r in scheduler_output.structured_output_req_ids], bitmask)
        if (grammar is None and hasattr(model, "compute_greedy_tokens")
                and self.sampler.argmax_suffices(sampled_reqs)):
            # The argmax alone: at TP > 1 the ranks exchange one (value, id) per row
            # instead of all-gathering [rows, vocab] logits.
            with device_sync_point():
                tokens = model.compute_greedy_tokens(hidden[sample_rows]).tolist()
            self._last_sampled.update(zip(req_ids, tokens))
            return ModelRunnerOutput(req_ids, tokens, [None] * len(tokens), prompt_logprobs)
        # The logits stay on the device; only the sampled ids (and asked-for logprobs)
        # come to the host, where the step's collectives are waited for.
        logits = model.compute_logits(hidden[sample_rows]).float()
        with device_sync_point():
            tokens, logprobs = self.sampler(logits, sampled_reqs, self.config.seed, grammar)
        self._last_sampled.update(zip(req_ids, tokens))
        return ModelRunnerOutput(req_ids, tokens, logprobs, prompt_logprobs)

    def _forward(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """The step's hidden states (a replayed CUDA graph's or CPU graph's for a
        pure-decode step that fits one, else an eager forward) and the rows that sample."""
        step = self._step_inputs(scheduler_output)
        if self.cpu_graphs is not None and step.is_pure_decode:
            decode = step.as_decode_inputs()
            if self.cpu_graphs.accepts(decode):
                hidden = self.cpu_graphs.run(decode)
                if hidden is not None:
                    return hidden, step.sample_rows
        graphs = self.cuda_graphs
        if graphs is not None and step.is_pure_decode:
            decode = step.as_decode_inputs()
            padded = graphs.padded_size(decode)
            if padded is not None:
                return graphs.run(decode, padded), step.sample_rows
        input_ids, positions, md = self._eager_inputs(step)
        return self._require_model()(input_ids, positions, md), step.sample_rows

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                                          AttentionMetadata, list[int]]:
        """An eager step's input ids, positions, the backend's metadata, and the rows
        that sample."""
        step = self._step_inputs(scheduler_output)
        return (*self._eager_inputs(step), step.sample_rows)

    def _step_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The step laid out on the host; the backend hears which requests finished."""
        assert self.kv_cache_config is not None and self.attn_backend is not None
        self.attn_backend.requests_finished(scheduler_output.finished_req_ids)
        return StepInputs.from_scheduler_output(scheduler_output, self.kv_cache_config.block_size)

    def _eager_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        assert self.attn_backend is not None
        input_ids, positions, common = step.to_device(self.device)
        return input_ids, positions, self.attn_backend.build_metadata(common)

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
                logits = model.compute_logits(rows).float()
                for entry, rank in prompt_logprobs(logits, prompt[lo + 1: hi + 1], k):
                    entries.append(entry)
                    ranks.append(rank)
            result[req.req_id] = (req.start_pos + 1, entries, ranks)
        return result


# vLLM's name, for users who look for it.
GPUModelRunner = ModelRunner
