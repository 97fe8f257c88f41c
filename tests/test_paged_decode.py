"""The CPU paged decode kernel (models/layers/attention/backends/paged_decode.py, .c).

Its output must equal attention computed the long way (gather, float64 softmax) for
every layout the runner produces; its build must cache, fall back cleanly and leave
nothing behind; and loading it must not change the process's floating-point mode or
bring in a second OpenMP runtime.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from distributed.native_build import load_kernel
from models.layers.attention.backends import paged_decode
from models.layers.attention.backends.cpu_attn import CPUAttentionBackend

KERNEL = paged_decode.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler on this machine")


def paged_case(seq_lens: list[int], num_kv_heads: int, group: int, head_size: int, block_size: int,
               dtype: torch.dtype, seed: int = 0):
    """A cache whose blocks are handed out in shuffled order, block tables padded with
    -1 (never to be read), and one query token per sequence."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + 3
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(counts) + 2), -1, dtype=torch.long)
    for i, count in enumerate(counts):
        tables[i, :count] = torch.tensor([order.pop() for _ in range(count)])
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_size, generator=gen).to(dtype)
    return q, cache, tables


def reference(q, cache, tables, seq_lens, scale, start=0):
    """out [G, H, D] float64 and lse [G, H], from each sequence's gathered K/V."""
    num_kv_heads, block_size = cache.shape[3], cache.shape[2]
    group = q.shape[1] // num_kv_heads
    outs, lses = [], []
    for g, n in enumerate(seq_lens):
        blocks = tables[g, : -(-n // block_size)]
        kv = cache[blocks].double().permute(1, 3, 0, 2, 4).reshape(2, num_kv_heads, -1, cache.shape[4])
        k, v = (x[:, start:n].repeat_interleave(group, 0) for x in kv)
        scores = torch.einsum("hd,hld->hl", q[g].double(), k) * scale
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(scores, -1), v))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


CASES = {
    # name: (seq_lens, num_kv_heads, group, head_size, block_size)
    "gqa3-d64": ([1, 16, 17, 100, 190, 33, 64, 2], 4, 3, 64, 16),
    "mha-d128": ([5, 48, 129], 2, 1, 128, 16),
    "gqa8-d80": ([31, 7, 70], 1, 8, 80, 8),
    "small-heads": ([1, 2, 3, 4, 9], 2, 2, 8, 4),
    "one-sequence": ([300], 4, 2, 64, 16),  # fewer sequences than threads: heads split among tasks
    # Head sizes 64 and 128 take the AVX-512 path where the CPU has it: query rows in groups
    # (4 at 64, 2 at 128), dot products reduced 16 tokens at a time across block edges.
    "gqa4-d128": ([1, 15, 16, 17, 250], 2, 4, 128, 16),
    "gqa7-d128-bs32": ([3, 40, 97], 1, 7, 128, 32),
    "gqa8-d64-bs8": ([9, 31, 64, 130], 2, 8, 64, 8),
    # Head size 64 takes the AVX2 path on an AVX2 CPU without AVX-512: a block at a time,
    # rows in groups of up to 4 (here 1), 8 tokens' dot products reduced together.
    "mha-d64": ([5, 48, 129], 2, 1, 64, 16),
}


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_equals_attention_over_the_gathered_context(case, dtype, atol):
    seq_lens, num_kv_heads, group, head_size, block_size = CASES[case]
    q, cache, tables = paged_case(seq_lens, num_kv_heads, group, head_size, block_size, dtype)
    scale = head_size**-0.5
    out, lse = KERNEL(q, cache, tables, torch.tensor(seq_lens), scale, with_lse=True)
    expected, expected_lse = reference(q, cache, tables, seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=0)
    no_lse, none = KERNEL(q, cache, tables, torch.tensor(seq_lens), scale)
    assert none is None and torch.equal(no_lse, out)


def _cpu_has(*flags: str) -> bool:
    words = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return all(flag in words for flag in flags)


# The build for this CPU takes one path for head sizes 64 and 128; these builds take the
# others where the CPU can run them: the AVX2 one (head size 64) on an AVX-512 CPU, and
# the portable attend() on any (GCC's -mno-avx2 turns AVX-512 off with it), also
# without F16C.
OTHER_PATHS = {
    "avx2": (("-mno-avx512f",), {"avx512": False, "avx2": _cpu_has("avx2", "fma")}),
    "portable": (("-mno-avx2",), {"avx512": False, "avx2": False}),
    # float16 converted by the compiler's _Float16 rather than F16C
    "portable-no-f16c": (("-mno-avx2", "-mno-f16c"), {"avx512": False, "avx2": False}),
}


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("path", OTHER_PATHS)
def test_every_path_of_the_build_equals_attention_over_the_gathered_context(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    extra, flags = OTHER_PATHS[path]
    kernel = load_kernel(paged_decode.SOURCES, paged_decode.COMPILE_FLAGS + extra, paged_decode.LINK_FLAGS,
                         paged_decode.LINK_LIBS, paged_decode.PagedDecodeKernel, "no build: %s")
    assert kernel is not None and {"avx512": kernel.avx512, "avx2": kernel.avx2} == flags
    for case in ("gqa3-d64", "gqa4-d128", "gqa7-d128-bs32", "gqa8-d64-bs8", "one-sequence", "mha-d64"):
        seq_lens, num_kv_heads, group, head_size, block_size = CASES[case]
        for dtype, atol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]:
            q, cache, tables = paged_case(seq_lens, num_kv_heads, group, head_size, block_size, dtype)
            scale = head_size**-0.5
            out, lse = kernel(q, cache, tables, torch.tensor(seq_lens), scale, start=0, with_lse=True)
            expected, expected_lse = reference(q, cache, tables, seq_lens, scale)
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0, msg=lambda m, case=case: f"{case}: {m}")
            torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=0, msg=lambda m, case=case: f"{case}: {m}")
    # a window and a soft cap, on a prefix-shared start, through the same path
    seq_lens = [33, 40, 100, 48, 49]
    q, cache, tables = paged_case(seq_lens, 2, 4, 64, 16, torch.float32, seed=2)
    lens = torch.tensor(seq_lens)
    ours = kernel(q, cache, tables, lens, 0.1, start=32, with_lse=True, sliding_window=40, soft_cap=5.0)
    native = KERNEL(q, cache, tables, lens, 0.1, start=32, with_lse=True, sliding_window=40, soft_cap=5.0)
    torch.testing.assert_close(ours[0], native[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], native[1], atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_start_skips_a_shared_prefix(dtype):
    block_size, start = 16, 32
    seq_lens = [33, 40, 100, 48, 49]
    q, cache, tables = paged_case(seq_lens, 2, 3, 64, block_size, dtype, seed=1)
    out, lse = KERNEL(q, cache, tables, torch.tensor(seq_lens), 0.125, start=start, with_lse=True)
    expected, expected_lse = reference(q, cache, tables, seq_lens, 0.125, start=start)
    torch.testing.assert_close(out.double(), expected, atol={torch.float32: 1e-5, torch.bfloat16: 1e-2}.get(dtype, 2e-3),
                               rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=0)


@needs_kernel
def test_query_rows_may_be_a_strided_view_of_the_qkv_projection():
    seq_lens, num_kv_heads, group, head_size = [10, 20, 30], 2, 2, 16
    q, cache, tables = paged_case(seq_lens, num_kv_heads, group, head_size, 4, torch.float32)
    qkv = torch.randn(len(seq_lens), (num_kv_heads * group + 2 * num_kv_heads) * head_size)
    qkv[:, : q[0].numel()] = q.reshape(len(seq_lens), -1)
    view = qkv[:, : q[0].numel()].view(q.shape)
    assert not view.is_contiguous()
    lens = torch.tensor(seq_lens)
    assert torch.equal(KERNEL(view, cache, tables, lens, 0.25)[0], KERNEL(q, cache, tables, lens, 0.25)[0])


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    seq_lens = [1, 50, 200, 17, 90, 3]
    q, cache, tables = paged_case(seq_lens, 4, 3, 64, 16, torch.float32)
    lens = torch.tensor(seq_lens)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(KERNEL(q, cache, tables, lens, 0.125, with_lse=True))
    finally:
        torch.set_num_threads(threads)
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@needs_kernel
def test_cpu_backend_uses_the_kernel_only_for_the_dtypes_it_covers():
    backend = CPUAttentionBackend(num_layers=1)
    assert backend.kernel is KERNEL
    cache = torch.zeros(4, 2, 16, 2, 8)
    assert KERNEL.supports(torch.zeros(1, 2, 8), cache)
    assert KERNEL.supports(torch.zeros(1, 2, 8, dtype=torch.bfloat16), cache.bfloat16())
    assert KERNEL.supports(torch.zeros(1, 2, 8, dtype=torch.float16), cache.half())
    assert not KERNEL.supports(torch.zeros(1, 2, 8, dtype=torch.float16), cache.bfloat16())
    assert not KERNEL.supports(torch.zeros(1, 2, 8, dtype=torch.bfloat16), cache)  # e.g. an fp32 cache
    assert CPUAttentionBackend(num_layers=1, paged_decode=False).kernel is None


@needs_kernel
def test_loading_keeps_one_openmp_runtime_and_the_float_mode():
    # torch has run parallel ops and the kernel is loaded (at import of this module).
    torch.randn(256, 256) @ torch.randn(256, 256)
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp
    # crtfastmath would have set flush-to-zero / denormals-are-zero for the whole process.
    tiny = 5e-324
    assert tiny * 1.0 != 0.0 and float(torch.tensor([1e-40]) * 1.0) != 0.0


# --------------------------------------------------------------------------- the build


def _leftovers(root: Path) -> list[str]:
    kernels = root / "kernels"
    return sorted(p.name for p in kernels.iterdir()) if kernels.exists() else []


@pytest.mark.slow
@needs_kernel
def test_builds_once_into_the_cache_and_then_only_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    first = paged_decode.build_or_load()
    assert first is not None and first.path.parent == tmp_path / "kernels"
    assert _leftovers(tmp_path) == [first.path.name]  # no build directory left
    mtime = first.path.stat().st_mtime_ns
    second = paged_decode.build_or_load()
    assert second is not None and second.path == first.path and second.path.stat().st_mtime_ns == mtime
    q, cache, tables = paged_case([7, 21], 2, 2, 16, 4, torch.float32)
    lens = torch.tensor([7, 21])
    assert torch.equal(second(q, cache, tables, lens, 0.25)[0], KERNEL(q, cache, tables, lens, 0.25)[0])


def _fake_compiler(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-cc"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("compiler", ["missing", "failing", "garbage"])
def test_a_failed_build_falls_back_and_leaves_nothing(tmp_path, monkeypatch, caplog, compiler):
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(cache_root))
    if compiler == "missing":
        cc = str(tmp_path / "no-such-cc")
    elif compiler == "failing":
        cc = str(_fake_compiler(tmp_path, 'echo "paged_decode.c:1: error: nope" >&2; exit 1\n'))
    else:  # "succeeds" but writes something that is not a library: must not be cached
        cc = str(_fake_compiler(tmp_path, 'while [ $# -gt 1 ]; do [ "$1" = -o ] && echo junk > "$2"; shift; done\n'))
    monkeypatch.setenv("CC", cc)
    with caplog.at_level("WARNING"):
        assert paged_decode.build_or_load() is None
    assert "paged decode kernel unavailable" in caplog.text
    if compiler == "failing":
        assert "nope" in caplog.text  # the compiler's own message reaches the log
    assert _leftovers(cache_root) == []
    assert CPUAttentionBackend(num_layers=1).kernel is KERNEL  # the process's loaded kernel is unaffected


def test_disabled_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setenv("TP_CPU_PAGED_DECODE", "0")
    assert paged_decode.build_or_load() is None
    assert not os.listdir(tmp_path)


def _rank_kernel(worker) -> str | None:
    backend = worker.model_runner.attn_backend
    kernel = getattr(backend, "kernel", None)
    return None if kernel is None else str(kernel.path)


@pytest.mark.slow
@needs_kernel
def test_every_rank_of_a_cpu_engine_decodes_with_the_kernel(tiny_models):
    """The greedy-equals-transformers tests (test_generation.py) run on this path."""
    from config import SamplingParams
    from engine.core import EngineCore

    with EngineCore(model=str(tiny_models["llama"]), tensor_parallel_size=2, device="cpu", dtype="float32",
                    kv_cache_memory_bytes=4 << 20, max_model_len=64, distributed_executor_backend="mp",
                    use_tqdm_on_load=False) as core:
        assert core.collective_rpc(_rank_kernel) == [str(KERNEL.path)] * 2
        out, = core.generate([[1, 5, 9, 2]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 6


@needs_kernel
def test_a_table_or_length_out_of_range_is_an_error_before_any_read():
    seq_lens = [5, 20]
    q, cache, tables = paged_case(seq_lens, 2, 2, 16, 4, torch.float32)
    lens = torch.tensor(seq_lens)
    bad = tables.clone()
    bad[1, 4] = cache.shape[0]  # the last block sequence 1 needs
    with pytest.raises(ValueError, match="outside the cache's"):
        KERNEL(q, cache, bad, lens, 0.25)
    bad[1, 4] = -1
    with pytest.raises(ValueError, match="outside the cache's"):
        KERNEL(q, cache, bad, lens, 0.25)
    with pytest.raises(ValueError, match="too few"):
        KERNEL(q, cache, tables[:, :3], lens, 0.25)
    with pytest.raises(ValueError, match="not above start=8"):
        KERNEL(q, cache, tables, lens, 0.25, start=8)
    with pytest.raises(ValueError, match="one row per query"):
        KERNEL(q, cache, tables[:1], lens, 0.25)
    # Entries past a sequence's last block are never read, whatever they hold.
    padded = tables.clone()
    padded[0, 2:] = 10**9
    assert torch.equal(KERNEL(q, cache, padded, lens, 0.25)[0], KERNEL(q, cache, tables, lens, 0.25)[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_equals_the_index_assignment(dtype):
    """The kernel's KV write (vLLM's reshape_and_cache) puts each token's keys and values
    where the SDPA backend's index assignment puts them, from rows of the qkv
    projection (a strided view), and touches no other slot."""
    from models.layers.attention.backends.torch_sdpa import TorchSDPAImpl

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_size, block_size, tokens = 6, 2, 64, 16, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    _, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    k, v = k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, head_size)
    slots = torch.randperm(7 * block_size, generator=gen)[:tokens]
    ours = torch.randn(7, 2, block_size, kv_heads, head_size, generator=gen).to(dtype)
    expected = ours.clone()
    assert KERNEL.write_kv(k, v, ours, slots)
    md = type("Md", (), {"slot_blocks_and_offsets": (slots // block_size, slots % block_size)})()
    TorchSDPAImpl.write_kv(k, v, expected, md)
    assert torch.equal(ours, expected)


@needs_kernel
def test_write_kv_refuses_what_it_does_not_take_and_checks_slots_first():
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 2, 4, 2, 8)
    assert not KERNEL.write_kv(k, k, cache.bfloat16(), torch.tensor([0, 1, 2]))  # dtypes differ
    assert not KERNEL.write_kv(k, k, cache, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(IndexError, match="outside the cache's 8 slots"):
        KERNEL.write_kv(k, k, cache, torch.tensor([0, 8, 1]))
    assert not cache.any()  # nothing written before the check failed
