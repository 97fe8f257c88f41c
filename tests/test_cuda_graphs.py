"""CUDA-graph bookkeeping, on the CPU: which sizes are captured and when graphs are
on, how a decode step is padded into the persistent buffers, and that a step run
from those padded buffers (what a replayed graph reads) gives the tokens an
ordinary eager step gives. Capture and replay themselves need a GPU
(tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from config import ConfigError, EngineConfig
from config.compilation import CompilationConfig, default_capture_sizes
from engine.arg_utils import create_engine_config
from engine.entrypoints.cli_args import parse_args
from engine.entrypoints.engine_args import engine_config_kwargs
from worker.cuda_graph import DecodeBuffers, DecodeInputs


def test_default_capture_sizes_are_vllms() -> None:
    assert default_capture_sizes(512) == [1, 2, 4, *range(8, 513, 8)]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_batch_size_is_the_next_captured_size() -> None:
    cc = CompilationConfig(enforce_eager=False, cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    assert [cc.padded_batch_size(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert cc.padded_batch_size(17) is None
    assert CompilationConfig().padded_batch_size(1) is None


def _resolve(model: str, **kwargs) -> EngineConfig:
    return create_engine_config(model=model, dtype="float32", max_model_len=128, **kwargs)


def test_graphs_resolve_on_cuda_with_triton_attn_only(tiny_models) -> None:
    """Resolution needs no GPU: it decides from the device named."""
    model = tiny_models["llama"]
    on = _resolve(model, device="cuda", attention_backend="TRITON_ATTN", max_num_seqs=8)
    assert not on.compilation_config.enforce_eager
    assert on.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8]
    for off in (
        _resolve(model, device="cuda", attention_backend="TRITON_ATTN", enforce_eager=True),
        _resolve(model, device="cuda", attention_backend="TORCH_SDPA"),
        _resolve(model, device="cuda", tensor_parallel_size=2, tp_communicator="gloo"),
    ):
        assert off.compilation_config.enforce_eager and off.compilation_config.cudagraph_capture_sizes == []
    # The CPU captures no CUDA graph; its own graphs are tests/test_cpu_graph.py's.
    assert _resolve(model, device="cpu").compilation_config.cudagraph_capture_sizes == []
    chosen = _resolve(model, device="cuda", attention_backend="TRITON_ATTN", max_num_seqs=32,
                      cudagraph_capture_sizes=[16, 1, 64, 16, 3])
    assert chosen.compilation_config.cudagraph_capture_sizes == [1, 3, 16]  # sorted, once, <= max_num_seqs
    capped = _resolve(model, device="cuda", attention_backend="TRITON_ATTN", max_num_seqs=64,
                      max_cudagraph_capture_size=20)
    assert capped.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]


def test_attention_backend_defaults_and_refusals(tiny_models, monkeypatch) -> None:
    model = tiny_models["llama"]
    assert _resolve(model, device="cpu").attention_config.backend == "CPU_ATTN"
    assert _resolve(model, device="cuda").attention_config.backend == "TRITON_ATTN"
    assert _resolve(model, device="cpu", attention_backend="TORCH_SDPA").attention_config.backend == "TORCH_SDPA"
    with pytest.raises(ConfigError, match="CPU_ATTN.*CPU only"):
        _resolve(model, device="cuda", attention_backend="CPU_ATTN")
    with pytest.raises(ConfigError, match=r"attention_backend='FLASH_ATTN' is not valid.*TRITON_ATTN"):
        EngineConfig(model=model, attention_backend="FLASH_ATTN")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_ATTN.*TRITON_INTERPRET=1"):
        _resolve(model, device="cpu", attention_backend="TRITON_ATTN")


def test_tp_communicator_choices(tiny_models) -> None:
    model = tiny_models["llama"]
    assert _resolve(model, device="cpu", tensor_parallel_size=2).parallel_config.tp_communicator == "gloo"
    assert _resolve(model, device="cuda").parallel_config.tp_communicator == "nccl"
    with pytest.raises(ConfigError, match="tp_communicator='nccl' needs device='cuda'"):
        _resolve(model, device="cpu", tp_communicator="nccl")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="tp_communicator='gloo' lets the ranks share a GPU"):
            _resolve(model, device="cuda", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tp_communicator='mpi' is not valid"):
        EngineConfig(model=model, tp_communicator="mpi")
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        EngineConfig(model=model, cudagraph_capture_sizes=[0, 8])


def test_serve_flags_reach_the_config() -> None:
    args = parse_args(["--model", "m", "--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "8",
                       "--max-cudagraph-capture-size", "8", "--attention-backend", "TORCH_SDPA",
                       "--tp-communicator", "gloo"])
    kwargs = engine_config_kwargs(args, "m")
    assert kwargs["enforce_eager"] is True and kwargs["cudagraph_capture_sizes"] == [1, 2, 8]
    assert kwargs["max_cudagraph_capture_size"] == 8
    assert kwargs["attention_backend"] == "TORCH_SDPA" and kwargs["tp_communicator"] == "gloo"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--attention-backend", "FLASHINFER"])


def test_decode_buffers_pad_with_inert_rows() -> None:
    buffers = DecodeBuffers(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    buffers.block_tables.fill_(77)  # stale values from an earlier step
    inputs = DecodeInputs(input_ids=[5, 6, 7], positions=[16, 3, 40], slot_mapping=[33, 51, 104],
                          seq_lens=[17, 4, 41], block_tables=[[2, 1], [3], [9, 8, 6]])
    assert buffers.fits(inputs)
    buffers.fill(inputs, padded=4)
    assert buffers.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buffers.positions[:4].tolist() == [16, 3, 40, 0]
    assert buffers.slot_mapping[:4].tolist() == [33, 51, 104, -1]  # the padding row writes nothing
    assert buffers.seq_lens[:4].tolist() == [17, 4, 41, 0]  # and attends to nothing
    assert buffers.seq_lens.dtype == torch.int32 and buffers.block_tables.dtype == torch.int32
    assert buffers.block_tables[0, :2].tolist() == [2, 1] and buffers.block_tables[2, :3].tolist() == [9, 8, 6]
    assert buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    too_long = DecodeInputs([1], [80], [80], [81], [[0, 1, 2, 3, 4, 5]])
    assert not buffers.fits(too_long)


@pytest.mark.slow
def test_decode_from_the_padded_buffers_gives_the_eager_tokens(tiny_models) -> None:
    """What a replayed graph runs, run eagerly on the CPU: decode steps copied into the
    persistent buffers, padded to a capture size with inert rows, attended by
    TRITON_ATTN (under Triton's interpreter) from metadata over those buffers."""
    from config import SamplingParams
    from engine.core import EngineCore
    from worker.cuda_graph import CudaGraphRunner

    config = create_engine_config(model=str(tiny_models["llama"]), device="cpu", dtype="float32",
                                  attention_backend="TRITON_ATTN", max_model_len=128, max_num_batched_tokens=32,
                                  kv_cache_memory_bytes=1 << 20, block_size=12, use_tqdm_on_load=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in (3, 30, 17)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with EngineCore(config) as core:
        eager = [o.token_ids for o in core.generate(prompts, params)]
        runner = core.model_executor.worker.model_runner
        graphs = CudaGraphRunner(runner.model, runner.attn_backend, [1, 2, 4, 8], max_blocks=11, block_size=12,
                                 device=torch.device("cpu"))
        sizes: list[int] = []
        run = graphs.run
        graphs.run = lambda inputs, padded: sizes.append(padded) or run(inputs, padded)
        runner.cuda_graphs = graphs
        buffered = [o.token_ids for o in core.generate(prompts, params)]
    assert buffered == eager
    assert 4 in sizes  # three sequences decoding together ran padded to 4, with an inert row
