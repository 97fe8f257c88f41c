"""Functions that run inside the spawned ranks of tests/test_shared_device_tp.py (through
`tests.conftest.run_tp`, which calls `fn(rank, world_size, port, *args)`): the
host-staged communicator next to the CPU one, the device sync point's liveness marks,
the collective timeout, and (on a GPU) the KV budgets of ranks that share a device.
They live in an importable module because spawn pickles them by qualified name.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# (shape, dtype) all-reduced and gathered by both communicators: the half-precision
# dtypes the shared-memory kernel and its torch-op path take, an integer dtype that goes
# to gloo, and float32 rows larger than one 4 MiB slot (several rounds).
COLLECTIVE_CASES = [((3, 5), "float32"), ((4, 96), "bfloat16"), ((6, 7), "float16"), ((5, 2), "int64"),
                    ((2, 600_000), "float32")]


def _rank_input(rank: int, index: int, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + index)
    if dtype_name == "int64":
        return torch.randint(-50, 50, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype_name))


def _init_gloo(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def host_staged_vs_cpu(rank: int, world_size: int, port: int, shm: bool, model_dir: str | None = None,
                       input_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """COLLECTIVE_CASES through HostStagedCommunicator and CpuCommunicator on one gloo
    group (with the shared-memory path when `shm`, gloo alone otherwise): whether the
    staged all-reduce wrote the sum into its own input (also a transposed view) equal
    to the CPU one's, and whether its all-gathers equal the CPU one's. Then, with
    `model_dir`, the staged communicator as the TP group: this rank's logits of the
    checkpoint for `input_ids` (for the transformers oracle) and how many collectives
    the model ran through it."""
    from distributed.device_communicators.cpu_communicator import CpuCommunicator
    from distributed.device_communicators.host_staged_communicator import HostStagedCommunicator
    from distributed.parallel_state import destroy_distributed_environment, set_tensor_parallel_group

    os.environ["TP_CPU_SHM_ALLREDUCE"] = "1" if shm else "0"
    _init_gloo(rank, world_size, port)
    group = dist.group.WORLD
    staged = HostStagedCommunicator(rank, world_size, group)
    cpu = CpuCommunicator(rank, world_size, group)
    out: dict[str, Any] = {"staged_uses_shm": staged.shm is not None, "cpu_uses_shm": cpu.shm is not None}
    try:
        for index, (shape, dtype_name) in enumerate(COLLECTIVE_CASES):
            x = _rank_input(rank, index, shape, dtype_name)
            expected = cpu.all_reduce(x.clone())
            reduced = x.clone()
            address = reduced.data_ptr()
            returned = staged.all_reduce(reduced)
            transposed = x.clone().t()  # not contiguous: the sum must land in this view's layout
            staged.all_reduce(transposed)
            out[f"{shape}-{dtype_name}"] = {
                "in_place": returned is reduced and reduced.data_ptr() == address,
                "reduce_equal": torch.equal(reduced, expected),
                "transposed_equal": torch.equal(transposed, expected.t()),
                "gather_equal": all(torch.equal(staged.all_gather(x, dim), cpu.all_gather(x, dim)) for dim in (0, -1)),
            }
        weight = torch.ones(96, dtype=torch.bfloat16)
        out["fused_norm"] = staged.all_reduce_rms_norm(_rank_input(rank, 0, (4, 96), "bfloat16"), None, weight,
                                                       1e-5, 0)
        cpu.destroy()
        if model_dir is not None:
            assert input_ids is not None
            out.update(_staged_model_logits(rank, world_size, staged, model_dir, input_ids))
        return out
    finally:
        set_tensor_parallel_group(rank, world_size, staged)
        destroy_distributed_environment()


def _staged_model_logits(rank: int, world_size: int, staged: Any, model_dir: str,
                         input_ids: torch.Tensor) -> dict[str, Any]:
    from distributed.parallel_state import get_tp_group, observe_collectives, set_tensor_parallel_group
    from engine.arg_utils import create_engine_config
    from model_loader import get_model
    from tests.tp_helpers import compute_logits_on_rank

    set_tensor_parallel_group(rank, world_size, staged)
    calls = [0]
    observe_collectives(lambda: calls.__setitem__(0, calls[0] + 1), lambda: None)
    config = create_engine_config(model=model_dir, dtype="float32", device="cpu", tensor_parallel_size=world_size,
                                  use_tqdm_on_load=False)
    logits = compute_logits_on_rank(get_model(config), input_ids)
    return {"logits": logits, "collectives": calls[0],
            "communicator": type(get_tp_group().communicator._inner).__name__}


def sync_point_marks(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """What `device_sync_point()` writes on this rank's row of a real liveness board
    (executor.liveness), through the hooks `observe_collectives` installs: first with
    the CPU communicator (whose collectives complete in the call: no mark), then with
    CudaCommunicator over the same gloo group (the class whose NCCL collectives complete
    at the device sync: marked, nesting with a collective inside, cleared on a raise)."""
    from distributed import init_distributed_environment, tensor_model_parallel_all_reduce
    from distributed.device_communicators.cuda_communicator import CudaCommunicator
    from distributed.parallel_state import (destroy_distributed_environment, device_sync_point, get_tp_group,
                                            observe_collectives, set_tensor_parallel_group)
    from executor.liveness import IN_COLLECTIVE, StatusBoard, WorkerStatus

    init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"), "gloo",
                                 timeout=timedelta(seconds=60))
    cpu_communicator = get_tp_group().communicator
    board = StatusBoard(world_size)  # one board per rank here; a worker maps the engine's
    status = WorkerStatus(board.name, world_size, rank)
    row = board.row(rank)
    events: list[str] = []

    def on_enter() -> None:
        events.append("enter")
        status.enter_collective()

    def on_exit() -> None:
        events.append("exit")
        status.exit_collective()

    out: dict[str, Any] = {}
    try:
        observe_collectives(on_enter, on_exit)
        with device_sync_point():
            out["cpu_marked"] = float(row[IN_COLLECTIVE])
        out["cpu_sync_events"] = list(events)
        tensor_model_parallel_all_reduce(torch.ones(3))
        out["cpu_collective_events"] = list(events)
        events.clear()

        set_tensor_parallel_group(rank, world_size, CudaCommunicator(rank, world_size, dist.group.WORLD))
        observe_collectives(on_enter, on_exit)
        with device_sync_point():
            out["marked"] = float(row[IN_COLLECTIVE]) > 0
            out["sum"] = tensor_model_parallel_all_reduce(torch.ones(3)).tolist()
            out["marked_after_nested"] = float(row[IN_COLLECTIVE]) > 0
        out["after"] = float(row[IN_COLLECTIVE])
        out["events"] = list(events)
        events.clear()
        try:
            with device_sync_point():
                raise ValueError("the sync failed")
        except ValueError:
            pass
        out["after_raise"] = float(row[IN_COLLECTIVE])
        out["raise_events"] = list(events)
        return out
    finally:
        status.close()
        board.close()
        cpu_communicator.destroy()
        destroy_distributed_environment()


def collective_timeout(rank: int, world_size: int, port: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 all-reduces through the shared-memory path and then through gloo (int64)
    while rank 1 never joins (it stays alive, so only the timeout can end the wait):
    each call's error and the seconds it waited. Rank 1 returns {}."""
    from distributed import (destroy_distributed_environment, init_distributed_environment,
                             tensor_model_parallel_all_reduce)

    # Meet first, with a generous timeout of our own: the short one then only has to
    # cover the group's set-up, not the ranks' start-up skew.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=120))
    init_distributed_environment(world_size, rank, f"tcpstore://127.0.0.1:{port}", torch.device("cpu"), "gloo",
                                 timeout=timedelta(seconds=timeout_s))
    try:
        if rank != 0:
            time.sleep(3 * timeout_s + 2)
            return {}
        out: dict[str, Any] = {}
        for name, x in (("shm", torch.ones(4)), ("gloo", torch.ones(4, dtype=torch.int64))):
            start = time.monotonic()
            try:
                tensor_model_parallel_all_reduce(x)
            except RuntimeError as e:
                out[name] = (str(e), time.monotonic() - start)
            else:
                out[name] = ("no error", time.monotonic() - start)
        return out
    finally:
        destroy_distributed_environment()
        del store


def shared_gpu_budgets(rank: int, world_size: int, port: int, model_dir: str, utilization: float) -> dict[str, Any]:
    """On a GPU: a Worker per rank at tp_communicator="gloo" (every rank on one device
    when there is one), its KV budget from the profile run; then it allocates that
    budget, and once every rank has, the device's memory in use, and the rank's profile
    peak measured again with the cache allocated."""
    from engine.arg_utils import create_engine_config
    from worker.worker import Worker

    config = create_engine_config(model=model_dir, dtype="float32", device="cuda", tensor_parallel_size=world_size,
                                  tp_communicator="gloo", attention_backend="TORCH_SDPA", enforce_eager=True,
                                  gpu_memory_utilization=utilization, max_model_len=128,
                                  max_num_batched_tokens=128, use_tqdm_on_load=False)
    worker = Worker(config, local_rank=rank, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}")
    try:
        worker.init_device()
        worker.load_model()
        budget = worker.determine_available_memory()
        cache = torch.empty(budget, dtype=torch.uint8, device=worker.device)
        dist.barrier()
        free, total = torch.cuda.mem_get_info()
        dist.barrier()  # every rank measured before any profiles again
        runner = worker.model_runner
        assert runner is not None
        peak = worker.platform.profile_peak_bytes(lambda: runner.profile_run(128))
        del cache
        return {"budget": budget, "in_use_with_caches": total - free, "total": total, "peak": peak,
                "device": worker.device.index, "ranks_on_device": getattr(worker.platform, "ranks_on_device", None)}
    finally:
        worker.shutdown()


def worker_binding(worker: Any) -> dict[str, Any]:
    """Sent to an engine's workers (collective_rpc): the device it bound, how many ranks
    share it, and its process group's backend."""
    return {"device": str(worker.device), "ranks_on_device": getattr(worker.platform, "ranks_on_device", None),
            "backend": dist.get_backend() if dist.is_initialized() else None}
