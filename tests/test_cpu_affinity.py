"""Pinned CPU ranks (worker/cpu_affinity.py): each rank runs on the cores it was given,
with one torch thread per core, and engines with disjoint binds share no core."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from config import ConfigError
from engine.arg_utils import create_engine_config
from engine.core import EngineCore
from worker.cpu_affinity import CpuBindError, allowed_cpus, cpu_binds, spare_cpus

CORES = allowed_cpus()
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to pin two ranks apart")


def test_auto_splits_the_cores_into_equal_contiguous_groups():
    assert cpu_binds("auto", 2, [0, 1, 2, 3, 4]) == [{0, 1}, {2, 3}]
    assert cpu_binds("auto", 1, [2, 5]) == [{2, 5}]
    assert cpu_binds("auto", 4, [0, 1]) is None  # fewer cores than ranks: no pinning
    assert cpu_binds("none", 2, [0, 1]) is None


def test_explicit_binds_are_parsed_and_checked():
    assert cpu_binds("0-1,3|2", 2, [0, 1, 2, 3]) == [{0, 1, 3}, {2}]
    with pytest.raises(CpuBindError, match=r"names 1 cpu set\(s\) for 2 rank\(s\)"):
        cpu_binds("0-1", 2, [0, 1])
    with pytest.raises(CpuBindError, match=r"rank 1's cpu\(s\) \[7\] are not available"):
        cpu_binds("0|7", 2, [0, 1])
    with pytest.raises(CpuBindError, match=r"ranks 0 and 1 share cpu\(s\) \[1\]"):
        cpu_binds("0-1|1", 2, [0, 1])
    with pytest.raises(CpuBindError, match="'x' is not a cpu number"):
        cpu_binds("x|1", 2, [0, 1])


def test_a_bad_bind_is_a_config_error_naming_the_field(tiny_models):
    with pytest.raises(ConfigError, match="cpu_threads_bind="):
        create_engine_config(model=str(tiny_models["llama"]), device="cpu", tensor_parallel_size=2,
                             cpu_threads_bind=f"0|{max(CORES) + 1}")


def _affinity(worker: Any) -> tuple[list[int], int]:
    import torch

    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


def _engine(model: Path, tp: int, **kwargs: Any) -> EngineCore:
    return EngineCore(model=str(model), tensor_parallel_size=tp, device="cpu", dtype="float32",
                      kv_cache_memory_bytes=4 << 20, max_model_len=64, distributed_executor_backend="mp",
                      use_tqdm_on_load=False, **kwargs)


@pytest.mark.slow
@needs_two_cores
def test_each_rank_runs_on_the_cores_it_was_given(tiny_models):
    half = len(CORES) // 2
    with _engine(tiny_models["llama"], 2) as core:  # auto
        assert core.collective_rpc(_affinity) == [(CORES[:half], half), (CORES[half : 2 * half], half)]
    explicit = f"{CORES[1]}|{CORES[0]}"
    with _engine(tiny_models["llama"], 2, cpu_threads_bind=explicit) as core:
        assert core.collective_rpc(_affinity) == [([CORES[1]], 1), ([CORES[0]], 1)]


@pytest.mark.slow
@needs_two_cores
def test_two_engines_with_disjoint_binds_share_no_core(tiny_models):
    with _engine(tiny_models["llama"], 1, cpu_threads_bind=str(CORES[0])) as first, \
            _engine(tiny_models["llama"], 1, cpu_threads_bind=str(CORES[1])) as second:
        (cores_a, _), = first.collective_rpc(_affinity)
        (cores_b, _), = second.collective_rpc(_affinity)
        assert cores_a == [CORES[0]] and cores_b == [CORES[1]]
        assert not set(cores_a) & set(cores_b)


def test_the_engine_spins_for_replies_only_on_a_core_no_rank_runs_on():
    """The cores left to no rank: the engine busy-waits for its ranks only there."""
    assert spare_cpus("auto", 2, [0, 1, 2, 3]) == set()  # auto hands every core to a rank
    assert spare_cpus("auto", 2, [0, 1, 2, 3, 4]) == {4}  # 5 cores, 2 ranks of 2
    assert spare_cpus("0|1", 2, [0, 1, 2]) == {2}
    assert spare_cpus("none", 2, [0, 1, 2, 3]) == set()  # unpinned ranks use every core
    assert spare_cpus("auto", 4, [0, 1]) == set()  # fewer cores than ranks: none pinned
    with pytest.raises(CpuBindError):
        spare_cpus("0|0", 2, [0, 1])


@needs_two_cores
def test_a_cpu_engine_whose_ranks_take_every_core_waits_for_replies_without_spinning(tiny_models):
    with _engine(tiny_models["llama"], 2) as core:  # auto: every core runs a rank
        assert [reply.spin_s for reply in core.model_executor._replies] == [0.0, 0.0]
    spare = f"{CORES[0]}|{CORES[1]}" if len(CORES) > 2 else None
    if spare is not None:
        with _engine(tiny_models["llama"], 2, cpu_threads_bind=spare) as core:
            assert all(reply.spin_s is None for reply in core.model_executor._replies)  # the default spin
