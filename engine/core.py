"""EngineCore: from a config to ready workers with a sized KV cache, then the step loop.

`EngineCore(config)` returns only when every rank has loaded its shard and allocated
the same number of KV blocks, or raises with nothing left running. Shutdown is
idempotent and also runs at garbage collection and at interpreter exit.

Async scheduling (vLLM's): with an executor that runs steps in the background (mp),
`step()` plans and sends step N+1 before it waits for step N, so the ranks go from one
step to the next without waiting for the engine to take in N's result and schedule.
Each call still returns the outputs of one step; a step may be in flight between calls.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import time
import weakref
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, Sequence

from config import ConfigError, EngineConfig, RequestOutputKind, SamplingParams
from distributed.utils import cdiv
from engine.arg_utils import create_engine_config
from engine.block_hash import prefix_cache_salt
from engine.block_manager import KVBlockManager
from engine.output_processor import OutputProcessor, ParentRequest
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.tokenizer import load_tokenizer
from engine.worker_restart import WorkerRestarter
from executor.abstract import Executor, RPCMethod
from executor.errors import EngineDeadError
from worker.kv_cache import KVCacheConfig, KVCacheTooSmallError
from worker.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

GiB = 1 << 30
STARTUP_PHASES = ("spawn", "distributed_init", "load", "profile", "kv_alloc")

Prompt = str | Sequence[int]


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        """Either an EngineConfig or its flat keywords (`EngineCore(model=..., tensor_parallel_size=2)`).
        The config is resolved first (engine/arg_utils.py), before any process starts."""
        config = create_engine_config(config, **kwargs)
        self.config = config
        start = time.perf_counter()
        executor_class = Executor.get_class(config)
        self.async_scheduling = self._resolve_async_scheduling(executor_class)
        # The step sent ahead (async scheduling): its output and the executor's Future.
        self._in_flight: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        self.model_executor: Executor = executor_class(config)
        # The finalizer holds the executor, not self, so the core can be collected.
        self._finalizer = weakref.finalize(self, self.model_executor.shutdown)
        try:
            self.kv_cache_config = self._initialize_kv_caches()
            self.startup_timings = self._gather_startup_timings(time.perf_counter() - start)
            # Inside the try: a bad tokenizer.json must not leave the workers running.
            # A separate --tokenizer directory is a HF tokenizer's, whatever the model's load format.
            self.tokenizer = (load_tokenizer(config.tokenizer) if config.tokenizer
                              else load_tokenizer(config.model, config.load_format))
            self.scheduler = Scheduler(
                max_num_seqs=config.scheduler_config.max_num_seqs,
                max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                max_model_len=config.scheduler_config.max_model_len,
                block_manager=KVBlockManager(
                    self.kv_cache_config.num_blocks,
                    self.kv_cache_config.block_size,
                    enable_caching=config.cache_config.enable_prefix_caching,
                    hash_salt=self._prefix_cache_salt(),
                ),
                eos_token_id=self._eos_token_ids(),
                num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
            )
        except BaseException:
            self.shutdown()
            raise
        self._worker_restarter = WorkerRestarter(self)
        self._request_counter = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._sleep_level: int | None = None  # None while awake
        self._undelivered: list[RequestOutput] = []  # finished while going to sleep; the next step() returns them
        self.last_step_num_tokens = 0  # tokens (prompt and decode) the last step() ran: 0 if none, for the metrics
        self.last_step_num_steps = 0  # model steps it ran (num_scheduler_steps): 0 if none

    # ------------------------------------------------------------------ start-up

    def _resolve_async_scheduling(self, executor_class: type[Executor]) -> bool:
        """`async_scheduling` None: on wherever the executor runs steps in the
        background. True with one that cannot is a ConfigError naming both."""
        wanted = self.config.scheduler_config.async_scheduling
        supported = executor_class.supports_async_scheduling
        if wanted and not supported:
            raise ConfigError(
                f"async_scheduling=True needs an executor that runs steps in the background "
                f"(distributed_executor_backend='mp'); {executor_class.__name__} runs each step on the engine's "
                "thread"
            )
        return supported if wanted is None else wanted

    def _initialize_kv_caches(self) -> KVCacheConfig:
        spec = self.model_executor.get_kv_cache_spec()
        block_bytes = spec.block_bytes
        override = self.config.cache_config.num_gpu_blocks_override
        if override is not None:  # the caller knows the block count it wants: no profile run
            available = [override * block_bytes] * self.config.parallel_config.world_size
        else:
            available = self.model_executor.determine_available_memory()
        num_blocks = min(available) // block_bytes
        max_len = self.config.model_config.max_model_len
        needed = cdiv(max_len, self.config.cache_config.block_size)
        if num_blocks < max(1, needed):
            raise KVCacheTooSmallError(
                f"the KV cache does not fit one sequence of max_model_len={max_len}: it needs {needed} blocks of "
                f"{block_bytes} bytes ({needed * block_bytes} bytes per rank), but the smallest rank can spare "
                f"{min(available)} bytes (per rank: {available}), i.e. {num_blocks} blocks. Raise "
                f"gpu_memory_utilization (now {self.config.cache_config.gpu_memory_utilization}) or "
                f"kv_cache_memory_bytes (now {self.config.cache_config.kv_cache_memory_bytes}), or lower "
                f"max_model_len or max_num_batched_tokens (now {self.config.scheduler_config.max_num_batched_tokens})."
            )
        kv_cache_config = KVCacheConfig.from_spec(spec, num_blocks)
        self.model_executor.initialize_from_config(kv_cache_config)
        return kv_cache_config

    def _gather_startup_timings(self, total: float) -> dict[str, Any]:
        """Each phase's time (the slowest rank's; "spawn" the executor's), "total", and
        "per_rank" (each rank's own phases). Logs, as vLLM does at start-up, the weights
        and KV cache of each rank in GiB, the KV capacity in tokens and the maximum
        concurrency at max_model_len, then the phase timings."""
        per_rank = self.model_executor.worker_timings()
        timings: dict[str, Any] = {"total": total, "spawn": self.model_executor.startup_timings.get("spawn", 0.0)}
        for phase in STARTUP_PHASES[1:]:
            timings[phase] = max(rank.get(phase, 0.0) for rank in per_rank)
        timings["per_rank"] = per_rank
        kv = self.kv_cache_config
        # Each rank's parameter bytes, as it measured them after loading (packed CPU copies aside).
        weights = self.collective_rpc(lambda worker: getattr(worker, "model_memory_usage", None))
        if len(weights) != len(per_rank):  # external_launcher: only this rank answers
            weights = [None] * len(per_rank)
        logger.info(
            "Memory per rank: %s; KV cache %.4f GiB each (%d blocks of %d tokens)",
            ", ".join(f"rank {r}: weights {w / GiB:.4f} GiB" if w is not None else f"rank {r}: weights unknown"
                      for r, w in enumerate(weights)),
            kv.num_blocks * kv.block_bytes / GiB, kv.num_blocks, kv.block_size,
        )
        max_len = self.config.scheduler_config.max_model_len
        device = "GPU" if self.config.device_config.device_type == "cuda" else "CPU"
        logger.info("%s KV cache size: %s tokens; maximum concurrency for %d tokens per request: %.2fx",
                    device, f"{kv.num_tokens:,}", max_len, kv.num_tokens / max_len)
        logger.info(
            "EngineCore ready in %.2fs (tp=%d, num_blocks=%d): %s (the slowest rank's); per rank: %s",
            total,
            self.config.tensor_parallel_size,
            kv.num_blocks,
            " | ".join(f"{p} {timings[p]:.3f}s" for p in STARTUP_PHASES),
            "; ".join(f"rank {r}: " + ", ".join(f"{p} {t:.3f}s" for p, t in rank.items())
                      for r, rank in enumerate(per_rank)),
        )
        return timings

    def _prefix_cache_salt(self) -> bytes:
        """What, besides the tokens, decides a block's K/V: cached blocks are named under it."""
        mc = self.config.model_config
        return prefix_cache_salt(mc.model, mc.revision, str(mc.dtype), mc.quantization, self.config.load_format,
                                 str(self.kv_cache_config.dtype))

    def _eos_token_ids(self) -> list[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return list(self.tokenizer.eos_token_ids)
        eos = getattr(self.config.model_config.hf_config, "eos_token_id", None)
        return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]

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

    def to_token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt as validated token ids (strings through the tokenizer). Reads only
        immutable state, so any thread may call it. Raises ValueError."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is a string but {self.config.model} has no tokenizer "
                    "(a tokenizer.json, or one inside a GGUF); pass token ids"
                )
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (its ``n`` or ``best_of`` samples); returns its id. Its
        prompt is truncated as ``truncate_prompt_tokens`` says. ``cache_salt`` keeps
        its cached KV blocks apart from those of requests with another salt (vLLM's
        field, for tenants that must not share a cache). Raises ValueError for an
        invalid prompt, a duplicate id, or bad words / stop strings without a tokenizer."""
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        params = self._with_model_stops(sampling_params or SamplingParams())
        self.check_num_samples(params)
        prompt_ids = self.truncate_prompt(self.to_token_ids(prompt), params)
        parent = ParentRequest(request_id, prompt_ids, params)
        children = self.output_processor.add(parent)
        added: list[str] = []
        try:
            for child_id, child_params in children:
                request = Request(child_id, prompt_ids, child_params)
                request.cache_salt = cache_salt
                request.sibling_group = request_id if len(children) > 1 else None
                self.scheduler.add_request(request)
                added.append(child_id)
        except BaseException:
            for child_id in added:
                self.scheduler.abort_request(child_id)
            self.output_processor.remove(request_id)
            raise
        return request_id

    def check_num_samples(self, params: SamplingParams) -> None:
        """A request runs at most max_num_seqs samples (n, or best_of): more could never
        run in one step, and a huge fan-out would hold every other request back.
        Raises ValueError naming the field."""
        limit = self.config.scheduler_config.max_num_seqs
        if params.num_samples > limit:
            name = "best_of" if params.best_of is not None else "n"
            raise ValueError(f"{name} must be at most max_num_seqs={limit} (the sequences one step runs), "
                             f"got {params.num_samples}")

    def truncate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """``prompt_ids`` cut to ``params.truncate_prompt_tokens`` (-1: max_model_len),
        keeping its end (its start with ``truncation_side="right"``)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.config.scheduler_config.max_model_len
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if params.truncation_side == "right" else prompt_ids[-keep:]

    def _with_model_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what needs the model: the bad words' token ids (each word as
        is and after a space, as it reads inside a text) and the EOS ids that
        ``min_tokens`` holds back. Raises ValueError if they need a tokenizer it lacks."""
        if (params.bad_words or params.stop) and self.tokenizer is None:
            field_name = "bad_words" if params.bad_words else "stop"
            raise ValueError(f"{field_name} need a tokenizer, and {self.config.model} has none; "
                             "use stop_token_ids / logit_bias instead")
        bad_ids: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer else []
                if ids and ids not in bad_ids:
                    bad_ids.append(ids)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self._eos_token_ids())
        vocab = self.config.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias))):
            bad = [t for t in ids or [] if t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        return dataclasses.replace(params, bad_words_token_ids=bad_ids, all_stop_token_ids=sorted(stops))

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
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            if self.async_scheduling:
                step = self._run_step_async()
            else:
                scheduler_output = self.scheduler.schedule()
                if not scheduler_output.scheduled:
                    return []
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
        return self._apply(*step)

    def _run_step_async(self) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Wait for the step in flight (sent by the previous call, or now), after sending
        the one that follows it; None when there is nothing to run."""
        if self._in_flight is None:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.scheduled:
                return None
            self._in_flight = scheduler_output, self.model_executor.execute_model(scheduler_output, non_block=True)
        scheduler_output, future = self._in_flight
        self._in_flight = None
        # Planned on what this step will leave: its sampled tokens are placeholders.
        following = self.scheduler.schedule()
        if following.scheduled:
            self._in_flight = following, self.model_executor.execute_model(following, non_block=True)
        return scheduler_output, future.result()

    def rerun_running_requests(self) -> int:
        """After a failed step or a replaced worker group: preempt every running request
        by recompute (re-run later from its tokens), drop the step in flight and every
        cached block (a step that failed may not have written their K/V). Returns how
        many requests were running. Call from the thread that steps the core."""
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

    # ------------------------------------------------------------------ sleep mode

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def sleep(self, level: int = 1, abort: bool = False) -> list[dict[str, Any]]:
        """Pause (level 0) or hand memory back: level 1 frees the KV cache and moves the
        weights to host memory (where they are not there already: on the CPU they
        stay), level 2 frees both and `wake_up` reloads the weights. Sleeping again
        at a deeper level deepens it; at the same or a lower level it changes nothing.

        Unfinished requests are run to completion first (at level 0 they just pause),
        or, with `abort=True`, finish at once as aborted; either way their final
        outputs come from the next `step()`. Requests added while asleep wait. Returns
        each rank's report (bytes freed per pool, memory before and after, seconds);
        level 0 returns none. Raises RuntimeError unless `enable_sleep_mode`."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: build the engine with EngineConfig(enable_sleep_mode=True) "
                               "(engine.serve --enable-sleep-mode)")
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level={level!r} must be 0, 1 or 2")
        start = time.perf_counter()
        if abort:
            self._undelivered += self._abort_all()
        current = self._sleep_level
        if level == 0:
            self._sleep_level = current or 0
            logger.info("sleep(level=0): scheduling paused")
            return []
        self._sleep_level = None  # a paused engine may still drain
        try:
            while self.scheduler.has_unfinished_requests():
                self._undelivered += self._step()
        finally:
            self._sleep_level = max(level, current or 0)
        level = self._sleep_level
        reports = self.collective_rpc("sleep", args=(level,))
        self.reset_prefix_cache()  # the cached blocks' K/V is gone
        self._log_memory(f"sleep(level={level})", reports, time.perf_counter() - start)
        return reports

    def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Restore the memory pools in `tags` ("weights", "kv_cache"; default both),
        weights first; the engine runs again once both are back (two calls let an RL
        loop load new weights before the cache returns). Waking what is awake changes
        nothing. Returns each rank's report (bytes restored per pool, seconds)."""
        if tags is not None:
            unknown = [t for t in tags if t not in ("weights", "kv_cache")]
            if unknown:
                raise ValueError(f"wake_up tags {unknown} are not memory pools; valid tags: ['weights', 'kv_cache']")
        if self._sleep_level is None:
            return []
        if self._sleep_level == 0:
            self._sleep_level = None
            logger.info("wake_up: scheduling resumed")
            return []
        start = time.perf_counter()
        reports = self.collective_rpc("wake_up", args=(list(tags) if tags is not None else None,))
        if all(state == "awake" for report in reports for state in report["state"].values()):
            self._sleep_level = None
        self._log_memory(f"wake_up(tags={list(tags) if tags else 'all'})", reports, time.perf_counter() - start)
        return reports

    def update_weights(
        self, source: str | os.PathLike | Mapping[str, Any] | Iterable[tuple[str, Any]]
    ) -> list[dict[str, Any]]:
        """Load new weights into the running model on every rank, as RL loops do after
        each training step: every weight from a checkpoint directory (same
        architecture and load format), or named, unsharded checkpoint tensors (any
        subset: each rank takes its slice). Drops the prefix cache. Requests already
        running continue with the K/V they computed. The weights must be awake.
        Returns each rank's report (seconds)."""
        start = time.perf_counter()
        if isinstance(source, (str, os.PathLike)):
            payload: Any = os.fspath(source)
            if not os.path.isdir(payload):
                raise ValueError(f"update_weights: {payload!r} is not a checkpoint directory")
        else:
            payload = list(source.items()) if isinstance(source, Mapping) else list(source)
        reports = self.collective_rpc("update_weights", args=(payload,))
        self._worker_restarter.note_weights(payload if isinstance(payload, str) else None)
        self.reset_prefix_cache()
        logger.info("update_weights from %s in %.2fs (slowest rank %.2fs)",
                    payload if isinstance(payload, str) else f"{len(payload)} tensors", time.perf_counter() - start,
                    max(r["seconds"] for r in reports))
        return reports

    def _log_memory(self, what: str, reports: list[dict[str, Any]], seconds: float) -> None:
        for r in reports:
            pools = ", ".join(f"{tag} {n / GiB:.2f} GiB" for tag, n in r["bytes"].items()) or "nothing"
            logger.info("%s rank %d: %s (memory in use %.2f -> %.2f GiB) in %.2fs", what, r["rank"], pools,
                        r["memory_before"] / GiB, r["memory_after"] / GiB, r["seconds"])
        logger.info("%s done in %.2fs", what, seconds)

    def _abort_all(self) -> list[RequestOutput]:
        """End every unfinished request as aborted; returns their final outputs."""
        parents = {}
        for request in list(self.scheduler.requests.values()):
            self.scheduler.abort_request(request.request_id)
            parent, _ = self.output_processor.process(request)
            parents[parent.request_id] = parent
        outputs = self._outputs(parents.values())
        for parent in parents.values():  # a best_of parent has no output to give until all ended
            self.output_processor.remove(parent.request_id)
        return outputs

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order.
        Only each request's final output is made (vLLM's LLM asks for FINAL_ONLY too),
        on copies: the caller's SamplingParams are left as they are."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        final_only: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final_only:
                final_only[id(sp)] = copy.copy(sp)
                final_only[id(sp)].output_kind = RequestOutputKind.FINAL_ONLY
        params = [final_only[id(sp)] for sp in params]
        if self._sleep_level is not None:
            raise RuntimeError(f"the engine is sleeping (level {self._sleep_level}); call wake_up() first")
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.add_request(prompt, sp))
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            # A refused prompt or an interrupted loop must not leave the others running.
            for request_id in ids:
                if request_id not in final:
                    self.abort_request(request_id)
            raise
        return [final[i] for i in ids]

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop every worker and free every resource. Idempotent."""
        self._finalizer()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
