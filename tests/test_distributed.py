"""distributed/: the TP group handle, the collectives, the per-platform communicator,
and the splitting rules every layer shares."""

from __future__ import annotations

import pytest
import torch

from distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    kv_heads_per_rank,
    set_tensor_parallel_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from distributed.device_communicators import get_device_communicator_cls
from distributed.device_communicators.cpu_communicator import CpuCommunicator
from distributed.device_communicators.cuda_communicator import CudaCommunicator
from distributed.utils import cdiv
from tests.conftest import run_tp
from tests.tp_helpers import tp_collectives


def test_without_a_group_the_process_is_rank_0_of_1_and_collectives_are_identity():
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (0, 1)
    x = torch.randn(3, 4)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def test_a_group_of_several_ranks_needs_a_communicator():
    with pytest.raises(ValueError, match="needs a device communicator"):
        set_tensor_parallel_group(0, 2, None)
    with pytest.raises(ValueError, match="outside"):
        set_tensor_parallel_group(2, 2, None)


def test_communicator_is_chosen_by_platform():
    assert get_device_communicator_cls("cpu") is CpuCommunicator and CpuCommunicator.dist_backend == "gloo"
    assert get_device_communicator_cls("cuda") is CudaCommunicator and CudaCommunicator.dist_backend == "nccl"
    with pytest.raises(ValueError, match="no device communicator"):
        get_device_communicator_cls("xpu")


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_collectives_sum_and_concatenate_in_rank_order(world_size):
    results = run_tp(tp_collectives, world_size)
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    parts = [base + 10 * r for r in range(world_size)]
    for result in results:
        assert result["communicator"] == "CpuCommunicator"
        assert torch.equal(result["reduced"], sum(parts))
        assert torch.equal(result["gathered_last"], torch.cat(parts, dim=-1))
        assert torch.equal(result["gathered_first"], torch.cat(parts, dim=0))


def test_splitting_rules():
    assert divide(12, 4, "heads") == 3
    with pytest.raises(ValueError, match=r"heads \(10\) is not divisible by tensor_parallel_size \(4\)"):
        divide(10, 4, "heads")
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(2, 4) == 1  # replicated: one head a rank
    assert kv_heads_per_rank(2, 2) == 1
    with pytest.raises(ValueError, match="replicated evenly"):
        kv_heads_per_rank(4, 6)
    with pytest.raises(ValueError, match="not divisible"):
        kv_heads_per_rank(6, 4)
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
