"""Worker: one TP rank's device, process group, model, memory profile and KV cache.

Created inside each WorkerProc (or in-process by UniProcExecutor). The executor calls
its methods by name through `collective_rpc`, on every rank, in this order:
init_device(), load_model(), get_kv_cache_spec(), determine_available_memory() (unless
`num_gpu_blocks_override` fixes the block count), initialize_from_config(), then
execute_model() per step. Phase timings accumulate in `self.timings` (seconds).
Everything that differs between CUDA and the CPU is asked of `self.platform`. Between
steps the engine may also call sleep(level), wake_up(tags) and update_weights(source)
(sleep mode; worker/sleep_mode.py), and trim_host_memory() once idle, on every rank
alike.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from distributed import destroy_distributed_environment, init_distributed_environment, tp_collective_timeout
from distributed.parallel_state import get_tensor_model_parallel_world_size
from model_loader.sharded_state_loader import save_sharded_model
from models.layers.file_pages import trim_heap
from worker.kv_cache import KVCacheConfig, KVCacheSpec
from worker.memory import model_weight_bytes
from worker.model_runner import ModelRunner
from worker.peer_watch import PeerWatch, local_peer_pids
from worker.platform import Platform, get_platform
from worker.sleep_mode import TAGS, PoolState, ReleasedStorages, collect_garbage, unique_storages

if TYPE_CHECKING:
    from config import EngineConfig
    from worker.outputs import ModelRunnerOutput, SchedulerOutput


# Test hook (tests/reliability): "RANK:PHASE:ACTION" makes that rank, on reaching PHASE
# ("load", "profile"), "hang" (sleep for good), "raise" or "exit" (os._exit(3)); before
# acting it creates the file named by TP_FAULT_MARKER, if set, so a test knows the rank is
# there. Workers see the engine's TP_* variables (the mp executor forwards them).
FAULT_ENV = "TP_FAULT_INJECT"


def _maybe_inject_fault(rank: int, phase: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    try:
        fault_rank, fault_phase, action = spec.split(":")
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r} must be RANK:PHASE:ACTION") from None
    if int(fault_rank) != rank or fault_phase != phase:
        return
    if marker := os.environ.get("TP_FAULT_MARKER"):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "raise":
        raise RuntimeError(f"rank {rank}: fault injected at {phase} ({FAULT_ENV}={spec!r})")
    if action == "exit":
        os._exit(3)
    raise ValueError(f"{FAULT_ENV}={spec!r}: action {action!r} is not one of 'hang', 'raise', 'exit'")


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int, rank: int, distributed_init_method: str | None,
                 local_world_size: int | None = None) -> None:
        """`local_world_size`: the ranks on this host, which share its cores and memory
        (default: all of them; the external launcher passes torchrun's LOCAL_WORLD_SIZE)."""
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.world_size = config.parallel_config.world_size
        self.local_world_size = local_world_size if local_world_size is not None else self.world_size
        self.distributed_init_method = distributed_init_method
        self.platform: Platform = get_platform(config.device_config, config.parallel_config.tp_communicator)
        self.device = self.platform.device_for(local_rank)
        self.model_runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}
        self.model_memory_usage = 0
        self._memory_at_init = 0
        # Sleep mode (worker/sleep_mode.py): each pool's state and what was released.
        self._pools: dict[str, PoolState] = dict.fromkeys(TAGS, PoolState.AWAKE)
        self._released: dict[str, ReleasedStorages] = {}
        self._weights_checkpoint: str | None = None  # set by update_weights(path)
        self._peers: dict[int, PeerWatch] = {}  # the other ranks on this host (check_health)

    def init_device(self) -> None:
        """Bind the device (or the CPU threads) and join the TP process group with the
        config's `tp_communicator` (on CUDA, "gloo" lets ranks share a GPU)."""
        start = time.perf_counter()
        self.platform.set_device(self.local_rank, self.local_world_size)
        torch.manual_seed(self.config.seed)
        _, self._memory_at_init = self.platform.total_and_free_memory()
        init_distributed_environment(self.world_size, self.rank, self.distributed_init_method, self.device,
                                     self.config.parallel_config.tp_communicator, tp_collective_timeout())
        self._peers = {r: PeerWatch(pid) for r, pid in local_peer_pids(self.rank, self.world_size).items()}
        self.model_runner = ModelRunner(self.config, self.device)
        self.timings["distributed_init"] = time.perf_counter() - start

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"rank {self.rank}: init_device() must run first")
        return self.model_runner

    def load_model(self) -> None:
        """Load this rank's shard inside the "weights" memory pool."""
        runner = self._runner()
        _maybe_inject_fault(self.rank, "load")
        with self.platform.memory_pool("weights") as usage:
            runner.load_model()
        assert runner.model is not None
        self.model_memory_usage = model_weight_bytes(runner.model)
        self.timings["load"] = usage.seconds

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes this rank can give the KV cache, after a profile forward pass at
        max_num_batched_tokens. `kv_cache_memory_bytes`, when set, is returned as is,
        with no profile run.

        How the budget follows from the profile is the platform's rule
        (`Platform.kv_cache_budget`); ranks that share a GPU split it.
        """
        start = time.perf_counter()
        cache_config = self.config.cache_config
        runner = self._runner()
        if cache_config.kv_cache_memory_bytes is not None:
            # The user fixed the budget: a profile run would be measured and thrown away.
            self.timings["profile"] = time.perf_counter() - start
            return cache_config.kv_cache_memory_bytes
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        _maybe_inject_fault(self.rank, "profile")
        peak_activation = self.platform.profile_peak_bytes(lambda: runner.profile_run(num_tokens))
        available = self.platform.kv_cache_budget(
            cache_config.gpu_memory_utilization, self._memory_at_init // self.local_world_size,
            self.model_memory_usage, peak_activation,
        )
        # The decode graphs' memory pool is allocated after the cache: keep room for it.
        available -= runner.cuda_graph_pool_estimate(peak_activation, num_tokens)
        self.timings["profile"] = time.perf_counter() - start
        return max(0, available)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """What one KV block holds on this rank, from the model's attention layers."""
        return self._runner().get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged KV cache inside the "kv_cache" memory pool and attach it."""
        with self.platform.memory_pool("kv_cache") as usage:
            self._runner().initialize_kv_cache(kv_cache_config)
        self.timings["kv_alloc"] = usage.seconds

    def compile_or_warm_up_model(self) -> None:
        """Capture the decode steps' CUDA graphs where the config enables them (vLLM's
        name for this phase); nothing on the CPU. Called on every rank after
        initialize_from_config: at TP > 1 each capture runs the model's collectives."""
        self.timings["capture"] = self._runner().capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner().execute_model(scheduler_output)

    def trim_host_memory(self) -> None:
        """Hand this rank's C heap's free pages back to the system
        (`models/layers/file_pages.trim_heap`): what a batch's activations freed stays
        resident otherwise. Called on every rank by `EngineCore.trim_host_memory`, between
        steps, once the engine is idle."""
        trim_heap()

    def wait_kv_cache_committed(self) -> float:
        """Block until every page of this rank's KV cache is backed by memory (on the CPU
        the cache is committed on a background thread after start-up, while the rank
        already serves: `worker/kv_cache.py`); returns the seconds waited. For callers
        that measure memory or throughput of a settled engine."""
        start = time.perf_counter()
        kv = self._runner().kv_cache_memory
        if kv is not None:
            kv.wait_committed()
        return time.perf_counter() - start

    # ------------------------------------------------------------ sleep mode

    def sleep(self, level: int) -> dict[str, Any]:
        """Free this rank's KV cache (level 1 and 2) and its weights (level 1: copied to
        host memory where they are not there already; level 2: dropped, reloaded by
        `wake_up`). Called on every rank with the same level, between steps, when no
        request will continue. Idempotent per pool. Returns this rank's report: bytes
        freed per pool, memory in use before and after, seconds."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r} must be 1 or 2 on a worker")
        start = time.perf_counter()
        runner = self._runner()
        runner.release_cuda_graphs()  # they hold the addresses released below; wake_up captures again
        kv = runner.kv_cache_memory
        if kv is not None:
            kv.wait_committed()  # so that the memory reported before is all of it
        before = self.platform.memory_in_use()
        freed: dict[str, int] = {}
        if self._pools["kv_cache"] is PoolState.AWAKE:
            if runner.attn_backend is not None:
                runner.attn_backend.reset()
            if kv is not None:
                kv.release()
            freed["kv_cache"] = kv.nbytes if kv is not None else 0
            self._pools["kv_cache"] = PoolState.DISCARDED
        weights = self._pools["weights"]
        if level == 1 and weights is PoolState.AWAKE and self.platform.offloads_weights_to_host:
            model = runner.model
            assert model is not None
            tensors = [*model.parameters(), *model.buffers()]
            self._released["weights"] = ReleasedStorages(unique_storages(tensors), offload=True)
            freed["weights"] = self._released["weights"].nbytes
            self._pools["weights"] = PoolState.OFFLOADED
        elif level == 2 and weights is not PoolState.DISCARDED:
            self._released.pop("weights", None)  # an offloaded copy is not needed: the reload reads the checkpoint
            freed["weights"] = self.model_memory_usage
            runner.release_model()
            self._pools["weights"] = PoolState.DISCARDED
        collect_garbage()
        self.platform.release_cached_memory()
        return self._memory_report("sleep", level, freed, before, start)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restore the pools named in `tags` (default both), weights first: offloaded
        weights are copied back, dropped ones reloaded by the same loader and load
        format (from the checkpoint of the last `update_weights(path)`, else the
        config's), the KV cache is re-allocated zeroed. Pools already awake are left
        alone. Returns this rank's report, with bytes restored per pool."""
        start = time.perf_counter()
        runner = self._runner()
        before = self.platform.memory_in_use()
        restored: dict[str, int] = {}
        wanted = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are not memory pools; valid tags: {list(TAGS)}")
        if "weights" in wanted and self._pools["weights"] is not PoolState.AWAKE:
            with self.platform.memory_pool("weights"):
                if self._pools["weights"] is PoolState.OFFLOADED:
                    released = self._released.pop("weights")
                    released.restore()
                    restored["weights"] = released.nbytes
                else:
                    runner.load_model(self._weights_checkpoint)
                    assert runner.model is not None
                    self.model_memory_usage = model_weight_bytes(runner.model)
                    restored["weights"] = self.model_memory_usage
                    runner.bind_kv_caches()
            self._pools["weights"] = PoolState.AWAKE
        if "kv_cache" in wanted and self._pools["kv_cache"] is not PoolState.AWAKE:
            kv = runner.kv_cache_memory
            if kv is not None:
                with self.platform.memory_pool("kv_cache"):
                    kv.restore()
            restored["kv_cache"] = kv.nbytes if kv is not None else 0
            self._pools["kv_cache"] = PoolState.AWAKE
        if all(state is PoolState.AWAKE for state in self._pools.values()) and runner.cuda_graphs is None:
            runner.capture_model()
        return self._memory_report("wake_up", None, restored, before, start)

    def update_weights(self, source: str | list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """New weight values in place (ModelRunner.update_weights): from a checkpoint
        directory, or named unsharded tensors. A later level-2 wake-up reloads that
        directory; tensors received by value are not kept and are lost at level 2.
        Raises RuntimeError while the weights are asleep."""
        if self._pools["weights"] is not PoolState.AWAKE:
            raise RuntimeError(f"rank {self.rank}: the weights are asleep; wake_up(tags=['weights']) first")
        start = time.perf_counter()
        runner = self._runner()
        # Processing after loading may replace tensors whose addresses a graph holds.
        captured = runner.cuda_graphs is not None or runner.cpu_graphs is not None
        runner.release_cuda_graphs()
        runner.update_weights(source)
        if captured:
            runner.capture_model()
        if isinstance(source, str):
            self._weights_checkpoint = source
        return {"rank": self.rank, "seconds": time.perf_counter() - start}

    def save_sharded_state(self, path: str, max_size: int | None = None) -> list[str]:
        """Write this rank's shard of the loaded model as `load_format="sharded_state"`
        files in `path` (model_loader/sharded_state_loader.py); returns their names. Every
        rank is called with the same arguments (EngineCore.save_sharded_state). Raises
        RuntimeError before a model is loaded, ValueError under quantisation, online or
        the checkpoint's (the loader builds the unquantised module, so quantised or
        repacked tensors and their scales would not load back)."""
        runner = self.model_runner
        if runner is None or runner.model is None:
            raise RuntimeError(f"rank {self.rank}: no model is loaded, nothing to save")
        if (quantization := self.config.model_config.quantization) is not None:
            raise ValueError(
                f"save_sharded_state does not support quantization={quantization!r}; "
                "save from an engine on the unquantised checkpoint"
            )
        return save_sharded_model(runner.model, path, self.rank, self.world_size, max_size)

    def sleep_state(self) -> dict[str, str]:
        return {tag: state.value for tag, state in self._pools.items()}

    def _memory_report(self, op: str, level: int | None, nbytes: dict[str, int], before: int,
                       start: float) -> dict[str, Any]:
        return {"rank": self.rank, "op": op, "level": level, "bytes": nbytes, "memory_before": before,
                "memory_after": self.platform.memory_in_use(), "seconds": time.perf_counter() - start,
                "state": self.sleep_state()}

    def get_timings(self) -> dict[str, float]:
        return dict(self.timings)

    def check_health(self, probe_collective: bool = False) -> bool:
        """Raise RuntimeError naming what is wrong unless this rank can serve: its device
        and TP group are set up (the process group initialised, the group's size the
        config's), its model is loaded and its KV cache (once allocated) bound, unless
        asleep, and every peer rank on this host is a live process. With
        `probe_collective`, also one all-reduce over the TP group must return the world
        size (every peer alive, in the same call, its collectives in step with ours);
        every rank must then be asked together, as collective_rpc does. Returns True.
        Cheap without the probe (tens of µs), so it stays a fair no-op RPC."""
        runner = self._runner()
        if runner.model is None and self._pools["weights"] is PoolState.AWAKE:
            raise RuntimeError(f"rank {self.rank}: no model is loaded")
        kv_awake = runner.kv_cache_config is not None and self._pools["kv_cache"] is PoolState.AWAKE
        if kv_awake and (runner.kv_cache_memory is None or not runner.kv_cache_memory.allocated):
            raise RuntimeError(f"rank {self.rank}: the KV cache is not allocated")
        if self.world_size > 1:
            if not torch.distributed.is_initialized() or get_tensor_model_parallel_world_size() != self.world_size:
                raise RuntimeError(f"rank {self.rank}: not in a TP group of {self.world_size} ranks")
            dead = [(rank, peer.pid) for rank, peer in self._peers.items() if not peer.alive()]
            if dead:
                raise RuntimeError(f"rank {self.rank}: TP peer(s) gone: "
                                   + ", ".join(f"rank {r} (pid {p})" for r, p in dead))
            if probe_collective:
                self._probe_collective()
        return True

    @torch.inference_mode()  # the all-reduce's shared slots are inference tensors after a step
    def _probe_collective(self) -> None:
        from distributed.communication_op import tensor_model_parallel_all_reduce

        probe = tensor_model_parallel_all_reduce(torch.ones(1, dtype=torch.float32, device=self.device))
        if int(probe.item()) != self.world_size:
            raise RuntimeError(
                f"rank {self.rank}: a health all-reduce over the TP group gave {probe.item()}, expected "
                f"{self.world_size}: the ranks' collectives are out of step"
            )

    def shutdown(self) -> None:
        """Leave the process group, drop the model and the cache, and hand the memory
        back (a later engine in this process, under the uni executor, profiles against
        what is free); safe to call more than once.
        Waits for the KV cache's background commit (CPU): a thread still inside torch
        when the interpreter exits aborts the process."""
        runner = self.model_runner
        if runner is not None and runner.kv_cache_memory is not None:
            runner.kv_cache_memory.wait_committed()
        for peer in self._peers.values():
            peer.close()
        self._peers = {}
        destroy_distributed_environment()
        if runner is not None:
            runner.release_cuda_graphs()
            self.model_runner = None
            collect_garbage()
            self.platform.release_cached_memory()
