"""distributed/: the TP group handle, the collectives, the per-platform communicator,
and the splitting rules every layer shares."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

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

pytestmark = pytest.mark.slow


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


SIZES = [1, 3, 1023, 65536, (4 << 20) // 4 + 5, 16 << 20]  # elements; the last is 64 MiB of float32


@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_all_reduce_and_gather_equal_gloo_and_are_bit_identical_on_every_rank(world_size):
    from tests.tp_helpers import tp_shm_vs_gloo

    results = run_tp(tp_shm_vs_gloo, world_size, SIZES, ["float32", "bfloat16"], timeout=600)
    assert all(r.pop("uses_kernel") for r in results), "the C all-reduce round is not active"
    for key, first in results[0].items():
        dtype = key.split("-")[0]
        # gloo adds in its own order (and bf16 in bf16); ours in rank order, bf16 in float32.
        tolerance = (1e-6 if dtype == "float32" else 1e-2) * max(1.0, first["scale"]) * world_size
        for rank, result in enumerate(results):
            r = result[key]
            assert r["max_diff"] <= tolerance, (key, rank, r["max_diff"])
            assert r["ints_equal"], (key, rank)  # small integers sum exactly in any order
            assert r["rank_order_sum"], (key, rank)  # float32 sums in rank order, rounded once
            assert r["digest"] == first["digest"], (key, rank)  # bit-identical across ranks
            assert r["gather_equal"], (key, rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_all_gather_copies_every_rank_s_rows_into_place_one_kernel_round_per_slot(world_size):
    """The C all-gather round: any dtype, any dim, equal to gloo's parts concatenated on
    every rank; rows that fit a slot take one round per slot's worth of them, rows that
    do not take the torch-op round (one per slot's worth of elements)."""
    import math

    from tests.tp_helpers import GATHER_CASES, tp_shm_gathers

    results = run_tp(tp_shm_gathers, world_size)
    slot_bytes = {r.pop("slot_bytes") for r in results}.pop()
    for shape, dtype_name, dim in GATHER_CASES:
        key = f"{shape}-{dtype_name}-{dim}"
        size = getattr(torch, dtype_name).itemsize
        row_bytes = math.prod(shape[dim:]) * size
        outer = math.prod(shape) * size // row_bytes
        if row_bytes <= slot_bytes:
            rounds = kernel_rounds = math.ceil(outer / (slot_bytes // row_bytes))
        else:
            rounds, kernel_rounds = math.ceil(math.prod(shape) * size / slot_bytes), 0
        for rank, result in enumerate(results):
            assert result[key]["equal"], (key, rank)
            assert (result[key]["rounds"], result[key]["kernel_rounds"]) == (rounds, kernel_rounds), (key, rank)
            assert result[key]["digest"] == results[0][key]["digest"], (key, rank)
    assert math.ceil(300 / (slot_bytes // (40 * 100 * 4))) == 2  # the middle-dim case spans two rounds


def test_shm_all_reduce_torch_path_gives_the_kernels_bits(monkeypatch):
    """Where the C round cannot be built (or TP_CPU_SHM_ALLREDUCE_KERNEL=0), the torch ops
    run the same protocol and give the same bits."""
    from tests.tp_helpers import tp_shm_vs_gloo

    sizes = [1, 1023, 65536, (4 << 20) // 4 + 5]
    with_kernel = run_tp(tp_shm_vs_gloo, 2, sizes, ["float32", "bfloat16"], timeout=600)
    monkeypatch.setenv("TP_CPU_SHM_ALLREDUCE_KERNEL", "0")
    without = run_tp(tp_shm_vs_gloo, 2, sizes, ["float32", "bfloat16"], timeout=600)
    assert [r.pop("uses_kernel") for r in with_kernel] == [True, True]
    assert [r.pop("uses_kernel") for r in without] == [False, False]
    for rank in range(2):
        for key, result in with_kernel[rank].items():
            assert result["digest"] == without[rank][key]["digest"], (rank, key)
            assert without[rank][key]["rank_order_sum"], (rank, key)
            assert without[rank][key]["gather_equal"] and result["gather_equal"], (rank, key)


def _our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("tp-allreduce-")}


@pytest.mark.parametrize("fused_norm", [False, True], ids=["all_reduce", "fused_all_reduce_norm"])
def test_a_rank_killed_during_an_all_reduce_is_named_within_seconds_and_leaves_no_segment(fused_norm):
    from tests.conftest import free_port
    from tests.tp_helpers import tp_rank_dies_in_all_reduce

    before = _our_segments()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=tp_rank_dies_in_all_reduce, args=(rank, 2, port, queue, fused_norm), daemon=True)
             for rank in range(2)]
    try:
        for p in procs:
            p.start()
        message, waited = queue.get(timeout=120)
        assert "TP rank 1" in message and "died" in message, message
        assert waited < 10
        procs[1].join(timeout=10)
        assert procs[1].exitcode == -signal.SIGKILL
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    assert _our_segments() <= before  # the name went as soon as both ranks had mapped it


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_greedy_tokens_equal_the_argmax_of_the_gathered_logits_on_every_rank(world_size):
    """compute_greedy_tokens exchanges one (value, id) per row instead of the logits: it must
    give the argmax of the gathered logits exactly, the first maximum on ties across
    ranks, with padded vocabulary columns (250 -> 256) and ranks whose whole range is
    padding (a 10-token vocabulary at TP=4) never chosen."""
    from tests.tp_helpers import tp_greedy_tokens_vs_logits

    results = run_tp(tp_greedy_tokens_vs_logits, world_size, [10, 250, 320], ["float32", "bfloat16"], timeout=300)
    for key, first in results[0].items():
        vocab = int(key.split("-")[1])
        assert first["tokens"][0] == 0 and first["tokens"][1] == 1, key  # ties: the first maximum
        assert all(0 <= t < vocab for t in first["tokens"]), key
        for rank, result in enumerate(results):
            assert result[key]["dtype"] == "torch.int64"
            assert result[key]["tokens"] == result[key]["expected"] == first["tokens"], (key, rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_all_reduce_norm_gives_the_unfused_bits_on_every_rank(world_size):
    """A norm that takes the row-parallel all-reduce (`all_reduce_input`) runs it, the
    residual add and the RMSNorm in one shared-memory kernel call per slot's worth of
    rows, and gives exactly what the all-reduce followed by the norm gives, the same bits
    on every rank; the sum lands in the input, as the unfused add-norm leaves it. A dtype
    the kernel does not take falls back without sending anything."""
    from tests.tp_helpers import tp_fused_all_reduce_norm

    rows = [1, 32, (4 << 20) // (96 * 2) + 7]  # the last spans two slots in bfloat16
    results = run_tp(tp_fused_all_reduce_norm, world_size, rows, ["float32", "bfloat16"], timeout=600)
    total = sum(range(1, world_size + 1))
    for rank, result in enumerate(results):
        assert result.pop("float16_fused") is None
        assert result.pop("float16_untouched")
        assert result.pop("sum_after_fallback") == [float(total)] * 5
        for key, r in result.items():
            dtype, count, _ = key.split("-")
            row_bytes = 96 * (2 if dtype == "bfloat16" else 4)
            assert r["rounds"] == -(-int(count) // ((4 << 20) // row_bytes)), key
            assert r["normed_equal"] and r["summed_equal"] and r["summed_in_place"], (key, rank)
            assert r["digest"] == results[0][key]["digest"], (key, rank)


@pytest.mark.parametrize("world_size", [1, 2])
def test_row_parallel_partial_sums_carry_the_bias_on_rank_0_only(world_size):
    """With `reduce_results=False` each rank returns its partial sum and only rank 0's
    holds the bias, so the all-reduce the caller runs counts it once."""
    from tests.tp_helpers import tp_row_parallel_partial_sums

    results = run_tp(tp_row_parallel_partial_sums, world_size, timeout=120)
    for rank, r in enumerate(results):
        assert r["sum_matches"], rank
        assert r["bias_here"] == (rank == 0) and r["bias_is_the_difference"] == (rank == 0), (rank, r)
