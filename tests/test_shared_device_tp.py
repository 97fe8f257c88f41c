"""TP > 1 on one GPU: the communicator choice, the host-staged collectives, device
binding and the KV budget of ranks that share a device, the collective timeout, and the
liveness mark at the device sync point.

The host-staged communicator runs its own code on CPU tensors (the staging copies are
then host-to-host), so its collectives and a TP=2 model on it are checked here against
the CPU communicator and transformers, in real gloo processes. The GPU checks (TP 2
sharing one GPU generates TP 1's greedy tokens; the ranks' budgets add up) carry the
`cuda` marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed.device_communicators import get_device_communicator_cls
from distributed.device_communicators.cpu_communicator import CpuCommunicator
from distributed.device_communicators.cuda_communicator import CudaCommunicator
from distributed.device_communicators.host_staged_communicator import HostStagedCommunicator
from distributed.parallel_state import device_sync_point, get_tp_group, observe_collectives
from tests.shared_device_helpers import (COLLECTIVE_CASES, collective_timeout, host_staged_vs_cpu,
                                         shared_gpu_budgets, sync_point_marks, worker_binding)
from worker.platform import cuda_device_binding, shared_device_kv_budget

MiB = 1 << 20
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- the choice


def test_tp_communicator_picks_the_communicator_class() -> None:
    assert get_device_communicator_cls("cuda", "nccl") is CudaCommunicator
    assert get_device_communicator_cls("cuda", "auto") is CudaCommunicator
    assert get_device_communicator_cls("cuda", "gloo") is HostStagedCommunicator
    assert get_device_communicator_cls("cpu", "gloo") is CpuCommunicator
    assert get_device_communicator_cls("cpu", "auto") is CpuCommunicator
    assert HostStagedCommunicator.dist_backend == "gloo" and CudaCommunicator.dist_backend == "nccl"
    # Only NCCL's collectives return before they are done: its wait is at the device sync.
    assert CudaCommunicator.completes_at_device_sync
    assert not HostStagedCommunicator.completes_at_device_sync and not CpuCommunicator.completes_at_device_sync
    with pytest.raises(ValueError, match="nccl"):
        get_device_communicator_cls("cpu", "nccl")
    with pytest.raises(ValueError, match="unknown tp_communicator"):
        get_device_communicator_cls("cuda", "mpi")


def test_ranks_bind_devices_round_robin_only_when_they_may_share() -> None:
    # 3 ranks on 2 GPUs with gloo: cuda:0 holds ranks 0 and 2, cuda:1 rank 1.
    assert [cuda_device_binding(r, 3, 2, shares_devices=True) for r in range(3)] == [(0, 2), (1, 1), (0, 2)]
    assert [cuda_device_binding(r, 2, 1, shares_devices=True) for r in range(2)] == [(0, 2), (0, 2)]
    assert [cuda_device_binding(r, 2, 2, shares_devices=False) for r in range(2)] == [(0, 1), (1, 1)]
    with pytest.raises(RuntimeError, match="local_rank 1 needs a CUDA device of its own.*tp_communicator='gloo'"):
        cuda_device_binding(1, 2, 1, shares_devices=False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        cuda_device_binding(0, 1, 0, shares_devices=True)


def test_kv_budget_is_todays_rule_alone_and_split_when_shared() -> None:
    GiB = 1 << 30
    total, free, peak = 100 * GiB, 70 * GiB, 2 * GiB
    assert shared_device_kv_budget(total, free, 0.9, 1, peak) == int(total * 0.9) - (total - free) - peak
    # Two ranks on one device that measured 30 GiB and (a peer's profile memory not yet
    # released) 34 GiB in use, with peaks of 2 and 3 GiB: the steady 30 GiB, both caches
    # and both peaks at once fit in 75 GiB.
    budgets = [shared_device_kv_budget(total, total - 30 * GiB, 0.75, 2, 2 * GiB),
               shared_device_kv_budget(total, total - 34 * GiB, 0.75, 2, 3 * GiB)]
    assert budgets == [(75 - 30) * GiB // 2 - 2 * GiB, (75 - 34) * GiB // 2 - 3 * GiB]
    assert 30 * GiB + sum(budgets) + 5 * GiB <= 75 * GiB


# ---------------------------------------------------------------- the staged collectives


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "gloo"])
def test_host_staged_collectives_equal_the_cpu_communicators(tp_runner, shm: bool) -> None:
    results = tp_runner(host_staged_vs_cpu, 2, shm)
    for rank, out in enumerate(results):
        assert out["staged_uses_shm"] is shm and out["cpu_uses_shm"] is shm
        for shape, dtype in COLLECTIVE_CASES:
            case = out[f"{shape}-{dtype}"]
            assert case == {"in_place": True, "reduce_equal": True, "transposed_equal": True,
                            "gather_equal": True}, f"rank {rank}, {shape} {dtype}"
        assert out["fused_norm"] is None  # the norm stays on the tensor's device


@pytest.mark.slow
def test_tp2_model_on_the_host_staged_communicator_matches_transformers(tp_runner, tiny_models, hf_logits) -> None:
    ids, expected = hf_logits("llama")
    results = tp_runner(host_staged_vs_cpu, 2, True, str(tiny_models["llama"]), ids)
    for rank, out in enumerate(results):
        assert out["communicator"] == "HostStagedCommunicator"
        assert out["collectives"] > 0
        torch.testing.assert_close(out["logits"], expected, atol=1e-4, rtol=1e-4, msg=lambda m, r=rank: f"rank {r}: {m}")


# ---------------------------------------------------------------- timeout and liveness


@pytest.mark.slow
def test_a_collective_that_waits_past_the_timeout_raises(tp_runner) -> None:
    from distributed.device_communicators.shm_allreduce import load_all_reduce_kernel

    load_all_reduce_kernel()  # built before the ranks start: its build must not eat their 2 s
    timeout_s = 2.0
    waited = tp_runner(collective_timeout, 2, timeout_s)[0]
    for path in ("shm", "gloo"):
        message, seconds = waited[path]
        assert message != "no error", path
        assert timeout_s * 0.9 <= seconds <= timeout_s * 3, (path, seconds)
    assert "waited over 2 s for TP rank(s) [1]" in waited["shm"][0]


def test_device_sync_point_is_a_no_op_at_world_size_one() -> None:
    assert get_tp_group().world_size == 1
    calls: list[str] = []
    observe_collectives(lambda: calls.append("enter"), lambda: calls.append("exit"))
    with device_sync_point():
        pass
    assert calls == [] and device_sync_point() is device_sync_point()


def test_device_sync_point_marks_the_liveness_board_where_collectives_complete_there(tp_runner) -> None:
    for out in tp_runner(sync_point_marks, 2):
        # CPU communicator: the collective is marked, the sync point is not.
        assert out["cpu_marked"] == 0.0 and out["cpu_sync_events"] == []
        assert out["cpu_collective_events"] == ["enter", "exit"]
        # NCCL's class: the sync point is "in a collective", nested with one inside it.
        assert out["marked"] and out["marked_after_nested"] and out["sum"] == [2.0, 2.0, 2.0]
        assert out["after"] == 0.0 and out["events"] == ["enter", "enter", "exit", "exit"]
        assert out["after_raise"] == 0.0 and out["raise_events"] == ["enter", "exit"]


# ---------------------------------------------------------------- on a GPU


def _greedy(model: Path, prompts: list[list[int]], **overrides) -> tuple[list[list[int]], list[dict]]:
    from config import SamplingParams
    from engine.arg_utils import create_engine_config
    from engine.core import EngineCore

    config = create_engine_config(model=str(model), device="cuda", dtype="float32", attention_backend="TORCH_SDPA",
                                  kv_cache_memory_bytes=32 * MiB, max_model_len=128, max_num_batched_tokens=32,
                                  use_tqdm_on_load=False, **overrides)
    with EngineCore(config) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        return [o.token_ids for o in outs], core.collective_rpc(worker_binding)


@pytest.mark.cuda
@pytest.mark.slow
@requires_cuda
def test_tp2_sharing_one_gpu_generates_tp1s_greedy_tokens(tiny_models) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (1, 9, 40)]  # 40: chunked prefill
    expected, _ = _greedy(tiny_models["llama"], prompts)
    tokens, ranks = _greedy(tiny_models["llama"], prompts, tensor_parallel_size=2, tp_communicator="gloo")
    assert tokens == expected
    assert [r["backend"] for r in ranks] == ["gloo", "gloo"]
    if torch.cuda.device_count() == 1:
        assert ranks == [{"device": "cuda:0", "ranks_on_device": 2, "backend": "gloo"}] * 2


@pytest.mark.cuda
@pytest.mark.slow
@requires_cuda
def test_kv_budgets_of_ranks_sharing_a_gpu_add_up_to_the_utilization(tp_runner, tiny_models) -> None:
    if torch.cuda.device_count() != 1:
        pytest.skip("the ranks share a device only where there is one")
    utilization = 0.3
    free, total = torch.cuda.mem_get_info()
    in_use_before = total - free  # other processes' memory (this one's CUDA context too) counts
    ranks = tp_runner(shared_gpu_budgets, 2, str(tiny_models["llama"]), utilization)
    assert [(r["device"], r["ranks_on_device"]) for r in ranks] == [(0, 2), (0, 2)]
    budgets = [r["budget"] for r in ranks]
    assert all(b > 0 for b in budgets), budgets
    assert sum(budgets) <= utilization * total - in_use_before, (budgets, total, in_use_before)
    # With both caches allocated, the device plus both ranks' peaks at once stays under
    # utilization × total (2 MiB a rank: the allocator rounds a large block up to it).
    in_use = max(r["in_use_with_caches"] for r in ranks)
    peaks = sum(r["peak"] for r in ranks)
    assert in_use + peaks <= utilization * total + 2 * 2 * MiB, (in_use, peaks, total, budgets)
