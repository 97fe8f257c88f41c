"""EngineCore: from a config to ready workers with a sized KV cache, then the step loop.

`EngineCore(config)` returns only when every rank has loaded its shard and allocated
the same number of KV blocks, or raises with nothing left running. Shutdown is
idempotent and also runs at garbage collection and at interpreter exit.

Async scheduling (vLLM's): with an executor that runs steps in the background (mp),
`step()` plans and sends step N+1 before it waits for step N, so the ranks go from one
step to the next without waiting for the engine to take in N's result and schedule.
Each call still returns the outputs of one step; a step may be in flight between calls.

Around the step loop, each in a file of its own: start-up and KV sizing
(engine/startup.py), request validation (engine/processor.py), sleep mode and weight
updates (engine/sleep_mode.py), the offline `generate` (engine/llm.py), and the
replacement of a failed worker group (engine/worker_restart.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
import weakref
from concurrent.futures import Future
from typing import Any, Iterable

from config import EngineConfig, SamplingParams
from engine.arg_utils import create_engine_config
from engine.llm import LLMMixin
from engine.output_processor import OutputProcessor, ParentRequest
from engine.outputs import RequestOutput
from engine.processor import EngineCoreRequest, Processor, Prompt
from engine.request import Request, RequestStatus
from engine.sleep_mode import SleepModeMixin
from engine.startup import gather_startup_timings, initialize_kv_caches, make_scheduler, resolve_async_scheduling
from engine.tokenizer import load_tokenizer
from engine.worker_restart import WorkerRestarter
from executor.abstract import Executor, RPCMethod
from executor.errors import EngineDeadError
from models.layers.file_pages import trim_heap
from worker.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore(SleepModeMixin, LLMMixin):
    """Owns the executor, the scheduler and the requests' outputs. Not thread-safe: one
    thread steps it (the caller's, or the AsyncEngine's engine loop); `processor` and
    `check_health(restart=False)` may be used from any thread."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        """Either an EngineConfig or its flat keywords (`EngineCore(model=..., tensor_parallel_size=2)`).
        The config is resolved first (engine/arg_utils.py), before any process starts."""
        config = create_engine_config(config, **kwargs)
        self.config = config
        start = time.perf_counter()
        executor_class = Executor.get_class(config)
        self.async_scheduling = resolve_async_scheduling(config, executor_class)
        # The step sent ahead (async scheduling): its output and the executor's Future.
        self._in_flight: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        # A sent step whose grammar bitmask follows it and is not sent yet (structured outputs).
        self._grammar_owed: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        self._start_executor(executor_class)
        try:
            self.kv_cache_config = initialize_kv_caches(self.model_executor, config)
            self.startup_timings = gather_startup_timings(self.model_executor, config, self.kv_cache_config,
                                                          time.perf_counter() - start)
            # Inside the try: a bad tokenizer.json must not leave the workers running.
            # A separate --tokenizer directory is a HF tokenizer's, whatever the model's load format.
            self.tokenizer = (load_tokenizer(config.tokenizer) if config.tokenizer
                              else load_tokenizer(config.model, config.load_format))
            self.processor = Processor(config, self.tokenizer)
            # The engine's grammars (engine/structured_output/): compiled by the processor, matched here.
            self.structured_output_manager = self.processor.structured_output_manager
            self.scheduler = make_scheduler(config, self.kv_cache_config, self.processor.eos_token_ids,
                                            defer_grammar=executor_class.supports_grammar_overlap)
        except BaseException:
            self.shutdown()
            raise
        self._worker_restarter = WorkerRestarter(self)
        self._request_counter = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._sleep_level: int | None = None  # None while awake (engine/sleep_mode.py)
        self._undelivered: list[RequestOutput] = []  # finished while going to sleep; the next step() returns them
        self.last_step_num_tokens = 0  # tokens (prompt and decode) the last step() ran: 0 if none, for the metrics
        self.last_step_num_steps = 0  # model steps it ran (num_scheduler_steps): 0 if none
        self._heap_used = False  # a step ran since the last trim_host_memory()

    # ------------------------------------------------------------------ the executor

    def _start_executor(self, executor_class: type[Executor]) -> None:
        self.model_executor: Executor = executor_class(self.config)
        # The finalizer holds the executor, not self, so the core can be collected.
        self._finalizer = weakref.finalize(self, self.model_executor.shutdown)

    def replace_executor(self) -> Executor:
        """Shut the worker group down and start a fresh one from the same config (the
        worker restarter, on the thread that steps the core); returns it, its KV cache
        not yet allocated. If the fresh one fails to start, its error is raised and the
        core keeps the old, shut-down executor, so that `shutdown()` still works."""
        old = self.model_executor
        self._finalizer.detach()
        old.shutdown()
        try:
            self._start_executor(Executor.get_class(self.config))
        except BaseException:
            self._finalizer = weakref.finalize(self, old.shutdown)  # idempotent; keeps shutdown() working
            raise
        return self.model_executor

    @property
    def is_shut_down(self) -> bool:
        """True once `shutdown()` ran (or the core was collected)."""
        return not self._finalizer.alive

    # ------------------------------------------------------------------ RPC

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run a Worker method (by name) or `fn(worker, *args, **kwargs)` on every rank."""
        return self.model_executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)

    def check_health(self, restart: bool = True) -> None:
        """Raise EngineDeadError if the workers are gone. With max_worker_restarts, a dead
        group is replaced here instead (`restart`: only from the thread that steps the
        core); another thread passes restart=False and is not told of a failure that the
        stepping thread will heal."""
        try:
            self.model_executor.check_health()
        except EngineDeadError as e:
            if not restart:
                if not self._worker_restarter.can_restart():
                    raise
                return
            if not self._worker_restarter.restart(e):
                raise

    @property
    def num_worker_restarts(self) -> int:
        """How many times a failed worker group was replaced (max_worker_restarts)."""
        return self._worker_restarter.count

    def save_sharded_state(self, path: str, max_size: int | None = None) -> None:
        """Write a `load_format="sharded_state"` checkpoint of the loaded model to `path`.

        Every rank writes its own shard to `model-rank-{rank}-part-{part}.safetensors`
        (parts of at most `max_size` bytes; shared tensors once); config.json,
        generation_config.json and tokenizer files are copied alongside. Sharded-state
        files of an earlier save in `path` are removed first. Load the result with the
        same tensor_parallel_size."""
        from model_loader.sharded_state_loader import copy_model_metadata_files, remove_sharded_state_files

        if max_size is not None and max_size <= 0:
            raise ValueError(f"max_size={max_size!r} must be > 0 bytes (or None for one part per rank)")
        os.makedirs(path, exist_ok=True)
        remove_sharded_state_files(path)
        self.collective_rpc("save_sharded_state", args=(os.fspath(path), max_size))
        copy_model_metadata_files(self.config.model, path)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Prompt | EngineCoreRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (its ``n`` or ``best_of`` samples); returns its id. A plain
        prompt is validated here (engine/processor.py: ValueError for an invalid prompt,
        too many samples, or bad words / stop strings without a tokenizer) and truncated
        as ``truncate_prompt_tokens`` says; an `EngineCoreRequest` was validated by the
        processor already and is queued as it is (the other arguments are then unused).
        ``cache_salt`` keeps its cached KV blocks apart from those of requests with
        another salt (vLLM's field, for tenants that must not share a cache). Raises
        ValueError for a prompt the scheduler cannot hold or a duplicate id."""
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
        else:
            request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
            request = self.processor.process_inputs(request_id, prompt, sampling_params, cache_salt)
        parent = ParentRequest(request.request_id, request.prompt_token_ids, request.sampling_params)
        children = self.output_processor.add(parent)
        added: list[str] = []
        try:
            for child_id, child_params in children:
                child = Request(child_id, request.prompt_token_ids, child_params)
                child.cache_salt = request.cache_salt
                if request.structured_output_grammar is not None:  # each sample matches on its own
                    child.structured_output_request = self.structured_output_manager.new_request(
                        request.structured_output_grammar, child_params.structured_outputs.reasoning_end_token_ids)
                child.sibling_group = request.request_id if len(children) > 1 else None
                self.scheduler.add_request(child)
                added.append(child_id)
        except BaseException:
            for child_id in added:
                self.scheduler.abort_request(child_id)
            self.output_processor.remove(request.request_id)
            raise
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        """End a request (every sample of it) as aborted; unknown ids are a no-op."""
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort_request(child_id)
        self.output_processor.remove(request_id)

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block, so no later prompt reuses K/V computed before
        (call it after the weights change). Running requests keep their blocks.
        Returns how many blocks were cached. Call from the thread that steps the core."""
        dropped = self.scheduler.block_manager.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def cache_config_info(self) -> dict[str, object]:
        """vLLM's CacheConfig.metrics_info: the cache config's fields, the block count
        start-up chose (`num_gpu_blocks`, vLLM's name, on the CPU too) and the KV dtype."""
        info: dict[str, object] = dataclasses.asdict(self.config.cache_config)
        info["num_gpu_blocks"] = self.kv_cache_config.num_blocks
        info["cache_dtype"] = str(self.kv_cache_config.dtype).removeprefix("torch.")
        return info

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it on every rank, and return the requests that advanced
        (first any that finished while the engine went to sleep). With async scheduling
        the batch that returns may be the one the previous call sent, and the next one
        is sent before this returns. While the engine sleeps nothing is scheduled."""
        outputs, self._undelivered = self._undelivered, []
        self.last_step_num_tokens = self.last_step_num_steps = 0
        if self._sleep_level is None:
            outputs += self._step()
            self._heap_used = self._heap_used or self.last_step_num_tokens > 0
        return outputs

    def trim_host_memory(self) -> None:
        """If a step ran since the last call (and none is in flight), every rank and this
        process hand their C heap's free pages back to the system: glibc keeps what a
        batch's activations freed (about 95 MB after 16 prompts of an 853M Llama's prefill),
        resident for as long as the process lives otherwise. The AsyncEngine's loop calls it
        once it has been idle a health-check interval; an offline caller may, between
        `generate` calls (not done there: the next batch faults the pages in again, 1.6%
        of a 2.7 s generate of 32 short prompts). Raises EngineDeadError if a rank died."""
        if not self._heap_used or self._in_flight is not None or self._sleep_level is not None:
            return
        self._heap_used = False
        self.collective_rpc("trim_host_memory")
        trim_heap()

    def _step(self) -> list[RequestOutput]:
        try:
            if self.async_scheduling:
                step = self._run_step_async()
            else:
                scheduler_output = self.scheduler.schedule()
                if not scheduler_output.scheduled:
                    return []
                if scheduler_output.grammar_follows:
                    # In flight (so that a failure below collects it) while its mask is filled.
                    self._in_flight = scheduler_output, self._send_step(scheduler_output)
                    self._send_grammar()  # filled while the ranks run the forward
                    (scheduler_output, future), self._in_flight = self._in_flight, None
                    step = scheduler_output, future.result()
                else:
                    step = scheduler_output, self.model_executor.execute_model(scheduler_output)
        except EngineDeadError as e:
            if not self._worker_restarter.restart(e):  # self-healing (engine/worker_restart.py)
                self.rerun_running_requests()  # none of their steps will ever report
                raise
            return []  # a fresh group: the interrupted requests are re-run from their tokens
        except BaseException:
            # A worker raised (or the wait was interrupted): no result of a step scheduled
            # so far will be applied.
            self.rerun_running_requests()
            raise
        if step is None:
            return []
        outputs = self._apply(*step)
        try:
            self._send_grammar()  # the step sent ahead, whose mask needed this one's tokens
        except BaseException:
            # The ranks fail the step sent ahead with the error: collected here, as a failed step.
            self._undelivered += outputs  # the next step() returns them
            self.rerun_running_requests()
            raise
        return outputs

    def _run_step_async(self) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Wait for the step in flight (sent by the previous call, or now), after sending
        the one that follows it; None when there is nothing to run. A step sent ahead
        whose grammar bitmask follows it gets it once this one is applied (`_step`)."""
        if self._in_flight is None:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.scheduled:
                return None
            self._in_flight = scheduler_output, self._send_step(scheduler_output)
            self._send_grammar()  # nothing is outstanding before it: the matchers are current
        scheduler_output, future = self._in_flight
        self._in_flight = None
        # Planned on what this step will leave: its sampled tokens are placeholders.
        following = self.scheduler.schedule()
        if following.scheduled:
            self._in_flight = following, self._send_step(following)
        return scheduler_output, future.result()

    def _send_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send a step without waiting for it; a bitmask that follows it is owed from now
        until `_send_grammar`, which must come before anything collects the step."""
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        if scheduler_output.grammar_follows:
            self._grammar_owed = scheduler_output, future
        return future

    def _send_grammar(self, error: str | None = None) -> None:
        """Fill the owed bitmask from the matchers as they stand (after every applied
        token) and send it, while the ranks run that step's forward; or send `error`,
        which fails the step on every rank (also what a failure to fill it sends, before
        it is raised here). Nothing when none is owed."""
        if self._grammar_owed is None:
            return
        scheduler_output, future = self._grammar_owed
        self._grammar_owed = None
        if error is None:
            try:
                bitmask = self.scheduler.grammar_bitmask(scheduler_output)
            except Exception as e:
                self.model_executor.send_grammar_bitmask(future, None, f"{type(e).__name__}: {e}")
                raise
            self.model_executor.send_grammar_bitmask(future, bitmask)
        else:
            self.model_executor.send_grammar_bitmask(future, None, error)

    def rerun_running_requests(self) -> int:
        """After a failed step or a replaced worker group: preempt every running request
        by recompute (re-run later from its tokens), drop the step in flight and every
        cached block (a step that failed may not have written their K/V). Returns how
        many requests were running. Call from the thread that steps the core."""
        try:  # a rank waiting in the step sent ahead for its bitmask fails it instead
            self._send_grammar(error="the step before it failed")
        except Exception:  # noqa: BLE001 - a dead group: nobody waits
            pass
        if self._in_flight is not None:
            future, self._in_flight = self._in_flight[1], None
            try:
                future.result()  # collected, so that no later step is sent as queued behind it
            except Exception:  # noqa: BLE001 - planned on the failed step: its result is void anyway
                pass
        rerun = self.scheduler.preempt_all_running()
        self.scheduler.block_manager.reset_prefix_cache()
        return rerun

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Take one step's result into the scheduler and the requests' outputs."""
        self.last_step_num_steps = scheduler_output.num_steps
        self.last_step_num_tokens = scheduler_output.num_batched_tokens * scheduler_output.num_steps
        parents: dict[str, ParentRequest] = {}
        for request in self.scheduler.update_from_output(scheduler_output, runner_output):
            parent, stopped = self.output_processor.process(request)
            if stopped and not request.is_finished():
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            parents[parent.request_id] = parent
        return self._outputs(parents.values())

    def _outputs(self, parents: Iterable[ParentRequest]) -> list[RequestOutput]:
        """The parents' outputs (none for a best_of request still running); finished
        parents are forgotten."""
        outputs = []
        for parent in parents:
            output = parent.output()
            if output is not None:
                outputs.append(output)
            if parent.finished:
                self.output_processor.remove(parent.request_id)
        return outputs

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop every worker and free every resource. Idempotent."""
        self._finalizer()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
