"""Functions that run inside the spawned tensor-parallel test processes.

`tests.conftest.run_tp(fn, world_size, *args)` starts `world_size` processes with the
"spawn" context and calls `fn(rank, world_size, port, *args)` in each. Spawn pickles
`fn` by qualified name, so every such function lives here, in an importable module,
never inside a test.
"""

from __future__ import annotations

import hashlib
import pickle
import signal
import traceback
from typing import Any, Callable

import torch

from executor.parent_death import set_parent_death_signal


def init_tp(rank: int, world_size: int, port: int) -> None:
    """gloo process group over loopback + this process's TP group handle."""
    from distributed import init_distributed_environment

    init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"))


def shutdown_tp() -> None:
    from distributed import destroy_distributed_environment

    destroy_distributed_environment()


def worker_entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    """Process target used by `run_tp`: report ("ok", rank, result) or ("error", rank, traceback)."""
    set_parent_death_signal(signal.SIGKILL)  # dies with the test process, even by SIGKILL
    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensors by value: no shared-memory handles that would
        # need this process alive while the parent unpickles.
        payload = pickle.dumps(fn(rank, world_size, port, *args))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        queue.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        queue.put(("ok", rank, payload))


def compute_logits_on_rank(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.numel())
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions))


def tp_load_cases(rank: int, world_size: int, port: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Load each case's checkpoint at TP=`world_size` and return {case name: result}.

    A case is {"name", "model", "input_ids", "kwargs" (extra EngineConfig keywords),
    "expect_error" (optional: the result is then the error's type name and message)}.
    Otherwise the result is this rank's full logits [T, vocab], plus a few shapes that
    show the model really is sharded.
    """
    from engine.arg_utils import create_engine_config
    from model_loader import get_model

    init_tp(rank, world_size, port)
    try:
        results: dict[str, Any] = {}
        for case in cases:
            config = create_engine_config(
                model=case["model"],
                dtype="float32",
                device="cpu",
                tensor_parallel_size=world_size,
                use_tqdm_on_load=False,
                **case.get("kwargs", {}),
            )
            if case.get("expect_error"):
                try:
                    get_model(config)
                except Exception as e:  # noqa: BLE001
                    results[case["name"]] = (type(e).__name__, str(e))
                else:
                    results[case["name"]] = None
                continue
            model = get_model(config)
            logits = compute_logits_on_rank(model, case["input_ids"])
            attn = model.model.layers[0].self_attn
            results[case["name"]] = {
                "logits": logits,
                "num_heads": attn.num_heads,
                "num_kv_heads": attn.num_kv_heads,
                "embed_rows": model.model.embed_tokens.num_embeddings_per_partition,
            }
            del model
        return results
    finally:
        shutdown_tp()


def tp_fail_on_rank(rank: int, world_size: int, port: int, bad_rank: int) -> int:
    """For the run_tp self-test: `bad_rank` raises, the others wait in a collective."""
    init_tp(rank, world_size, port)
    try:
        if rank == bad_rank:
            raise RuntimeError(f"deliberate failure on rank {rank}")
        import torch.distributed as dist

        dist.barrier()
        return rank
    finally:
        shutdown_tp()


def tp_collectives(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """The TP collectives through the installed communicator: which class it is, and the
    all-reduce / all-gather results of rank-dependent inputs (for tests/test_distributed.py)."""
    from distributed import get_tp_group, tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

    init_tp(rank, world_size, port)
    try:
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
        reduced = tensor_model_parallel_all_reduce(x.clone())
        gathered_last = tensor_model_parallel_all_gather(x, dim=-1)
        gathered_first = tensor_model_parallel_all_gather(x, dim=0)
        return {
            "communicator": type(get_tp_group().communicator).__name__,
            "reduced": reduced,
            "gathered_last": gathered_last,
            "gathered_first": gathered_first,
        }
    finally:
        shutdown_tp()


def tp_shm_vs_gloo(rank: int, world_size: int, port: int, sizes: list[int], dtypes: list[str]) -> dict[str, Any]:
    """For each size and dtype: the shared-memory all-reduce and all-gather of
    rank-dependent random data next to gloo's, on this rank."""
    import torch.distributed as dist

    from distributed import get_tp_group

    init_tp(rank, world_size, port)
    try:
        communicator = get_tp_group().communicator
        shm = communicator.shm
        assert shm is not None, "the shared-memory path is not active"
        out: dict[str, Any] = {"uses_kernel": shm.uses_kernel}
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for size in sizes:
                gen = torch.Generator().manual_seed(1000 * rank + size)
                x = torch.randn(size, generator=gen).to(dtype)
                ints = torch.randint(-8, 8, (size,), generator=gen).to(dtype)
                gloo, gloo_ints = x.clone(), ints.clone()
                dist.all_reduce(gloo)
                dist.all_reduce(gloo_ints)
                ours, ours_ints = shm.all_reduce(x.clone()), shm.all_reduce(ints.clone())
                key = f"{dtype_name}-{size}"
                # The contract: every rank's input added in rank order in float32, rounded once.
                inputs = [torch.randn(size, generator=torch.Generator().manual_seed(1000 * j + size)).to(dtype)
                          for j in range(world_size)]
                reference = inputs[0].float()
                for other in inputs[1:]:
                    reference = reference + other.float()
                out[key] = {
                    "max_diff": (ours.float() - gloo.float()).abs().max().item() if size else 0.0,
                    "scale": gloo.float().abs().max().item() if size else 0.0,
                    "ints_equal": torch.equal(ours_ints, gloo_ints),
                    "rank_order_sum": torch.equal(ours, reference.to(dtype)),
                    "digest": hashlib.sha256(ours.view(torch.uint8).numpy().tobytes()).hexdigest(),
                }
                parts = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(parts, x)
                out[key]["gather_equal"] = torch.equal(shm.all_gather(x, dim=0), torch.cat(parts))
                if size % 2 == 0:  # along the last dim of a 2-D view, as the LM head gathers logits
                    rows = x.view(2, -1)
                    parts = [torch.empty_like(rows) for _ in range(world_size)]
                    dist.all_gather(parts, rows)
                    out[key]["gather_equal"] &= torch.equal(shm.all_gather(rows, dim=-1), torch.cat(parts, dim=-1))
        return out
    finally:
        shutdown_tp()


def count_kernel_rounds(shm: Any, entry: str, seq_arg: int) -> set[int]:
    """Wrap the C entry `entry` of `shm`'s kernel so that every call records its round's
    seq (its argument `seq_arg`); returns the set it fills (a round may take several
    calls, so it counts rounds, not calls)."""
    rounds: set[int] = set()
    inner = getattr(shm._kernel, entry)

    def counted(*args: Any) -> int:
        rounds.add(args[seq_arg])
        return inner(*args)

    shm._kernel = shm._kernel._replace(**{entry: counted})
    return rounds


# (shape, dtype, dim) gathered by tp_shm_gathers: a 1-element tensor, the greedy
# exchange's [1, rows, 2] pairs, bf16 logits along the vocabulary, float16 (which the
# all-reduce kernel does not take), rows along a middle dim that take two slots' worth of
# rounds, and rows larger than a slot (the torch-op round's).
GATHER_CASES = [
    ((1,), "float32", 0),
    ((1, 32, 2), "float32", 0),
    ((32, 16000), "bfloat16", -1),
    ((3, 5), "float16", -1),
    ((300, 40, 100), "float32", 1),
    ((2, (1 << 20) + 1), "float32", -1),
]


def tp_shm_gathers(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Each of GATHER_CASES gathered by the shared-memory path next to gloo's all_gather
    concatenated, with the number of rounds it took (each round advances `_seq` by one)
    and how many of them the C gather round ran, on this rank."""
    import torch.distributed as dist

    from distributed import get_tp_group

    init_tp(rank, world_size, port)
    try:
        shm = get_tp_group().communicator.shm
        assert shm is not None and shm.uses_kernel, "the shared-memory kernel path is not active"
        kernel_rounds = count_kernel_rounds(shm, "gather_round", seq_arg=4)
        out: dict[str, Any] = {"slot_bytes": shm.slot_bytes}
        for shape, dtype_name, dim in GATHER_CASES:
            gen = torch.Generator().manual_seed(100 * rank + len(shape))
            x = torch.randn(shape, generator=gen).to(getattr(torch, dtype_name))
            parts = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(parts, x)
            before = shm._seq
            kernel_rounds.clear()
            ours = shm.all_gather(x, dim)
            out[f"{shape}-{dtype_name}-{dim}"] = {
                "equal": torch.equal(ours, torch.cat(parts, dim=dim)),
                "rounds": shm._seq - before,
                "kernel_rounds": len(kernel_rounds),
                "digest": hashlib.sha256(ours.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
            }
        return out
    finally:
        shutdown_tp()


def tp_rank_dies_in_all_reduce(rank: int, world_size: int, port: int, queue: Any, fused_norm: bool = False) -> None:
    """Process target: after the group is up, the last rank SIGKILLs itself; the others
    enter an all-reduce (with `fused_norm`, the fused all-reduce + RMSNorm the model's
    norms run) and put (error message, seconds waited) on `queue`."""
    import os
    import signal
    import time

    from distributed import tensor_model_parallel_all_reduce
    from models.layers.layernorm import RMSNorm

    set_parent_death_signal(signal.SIGKILL)  # dies with the test process, even by SIGKILL
    torch.set_num_threads(1)
    init_tp(rank, world_size, port)
    norm = RMSNorm(1024)
    norm.weight.data.fill_(1.0)
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        with torch.no_grad():
            if fused_norm:
                norm(torch.ones(2, 1024), torch.ones(2, 1024), all_reduce_input=True)
            else:
                tensor_model_parallel_all_reduce(torch.ones(1024))
    except RuntimeError as e:
        queue.put((str(e), time.monotonic() - start))
    else:
        queue.put(("no error", time.monotonic() - start))


def tp_greedy_tokens_vs_logits(rank: int, world_size: int, port: int, vocab_sizes: list[int],
                               dtypes: list[str]) -> dict[str, Any]:
    """For each vocabulary size and dtype: `ParallelLMHead.compute_greedy_tokens` next to the
    argmax of its all-gathered `compute_logits`, on this rank, for hidden states whose
    logits have ties (duplicated vocabulary rows) across the ranks' ranges."""
    from models.layers.vocab_parallel_embedding import ParallelLMHead

    init_tp(rank, world_size, port)
    try:
        out: dict[str, Any] = {}
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for vocab in vocab_sizes:
                head = ParallelLMHead(vocab, 16).to(dtype)
                table = torch.randn(vocab, 16, generator=torch.Generator().manual_seed(vocab)).to(dtype)
                table[vocab - 1] = table[0]  # the same maximum in the first and the last range
                table[vocab // 2] = table[1]
                head.weight_loader(head.weight, table)
                hidden = torch.randn(9, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
                hidden[0] = table[0] * 4  # row 0: tokens 0 and vocab - 1 tie at the top
                hidden[1] = table[1] * 4  # row 1: tokens 1 and vocab // 2 tie
                with torch.no_grad():
                    tokens = head.compute_greedy_tokens(hidden)
                    expected = head.compute_logits(hidden).float().max(dim=-1).indices
                out[f"{dtype_name}-{vocab}"] = {"tokens": tokens.tolist(), "expected": expected.tolist(),
                                                "dtype": str(tokens.dtype)}
        return out
    finally:
        shutdown_tp()


def tp_fused_all_reduce_norm(rank: int, world_size: int, port: int, row_counts: list[int],
                             dtypes: list[str]) -> dict[str, Any]:
    """For each row count, dtype and with or without a residual: `RMSNorm(x, residual,
    all_reduce_input=True)` on this rank's partial sums (the fused shared-memory call)
    next to the unfused path (the all-reduce, then the norm), and how many fused kernel
    rounds ran; then a float16 input, which the kernel does not take, and a plain
    all-reduce after it, to show that the fallback sends nothing out of turn."""
    from distributed import get_tp_group, tensor_model_parallel_all_reduce
    from models.layers.layernorm import RMSNorm

    init_tp(rank, world_size, port)
    try:
        shm = get_tp_group().communicator.shm
        assert shm is not None and shm.uses_kernel, "the shared-memory kernel path is not active"
        rounds = count_kernel_rounds(shm, "norm_round", seq_arg=5)
        out: dict[str, Any] = {}
        hidden = 96
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            norm = RMSNorm(hidden, 1e-5).to(dtype)
            norm.weight.data.copy_(torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5)
            for rows in row_counts:
                for with_residual in (False, True):
                    gen = torch.Generator().manual_seed(100 * rank + rows)
                    x = torch.randn(rows, hidden, generator=gen).to(dtype)
                    residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype)
                    before = len(rounds)
                    fused_x = x.clone()
                    fused_res = residual.clone() if with_residual else None
                    with torch.no_grad():
                        normed, summed = norm(fused_x, fused_res, all_reduce_input=True)
                    fused_rounds = len(rounds) - before
                    ref_x = tensor_model_parallel_all_reduce(x.clone())
                    with torch.no_grad():
                        if with_residual:
                            ref_normed, ref_summed = norm(ref_x, residual.clone())
                        else:
                            ref_normed, ref_summed = norm(ref_x), ref_x
                    out[f"{dtype_name}-{rows}-{with_residual}"] = {
                        "rounds": fused_rounds,
                        "normed_equal": torch.equal(normed, ref_normed),
                        "summed_equal": torch.equal(summed, ref_summed),
                        "summed_in_place": summed.data_ptr() == fused_x.data_ptr(),
                        "digest": hashlib.sha256(normed.view(torch.uint8).numpy().tobytes()).hexdigest(),
                    }
        half = torch.full((4, hidden), float(rank + 1), dtype=torch.float16)
        weight = torch.ones(hidden, dtype=torch.float16)
        out["float16_fused"] = shm.all_reduce_rms_norm(half, None, weight, 1e-5, 0)
        out["float16_untouched"] = bool((half == rank + 1).all())
        after = tensor_model_parallel_all_reduce(torch.full((5,), float(rank + 1)))
        out["sum_after_fallback"] = after.tolist()
        return out
    finally:
        shutdown_tp()


def tp_row_parallel_partial_sums(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """A RowParallelLinear with a bias and `reduce_results=False`: this rank's output (its
    partial sum) and the all-reduce of it, next to the whole layer's product computed
    from the full weight on this rank."""
    from distributed import tensor_model_parallel_all_reduce
    from models.layers.linear import RowParallelLinear

    init_tp(rank, world_size, port)
    try:
        gen = torch.Generator().manual_seed(5)
        weight, bias = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
        x = torch.randn(3, 8, generator=gen)
        layer = RowParallelLinear(8, 6, bias=True, reduce_results=False)
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        width = 8 // world_size
        with torch.no_grad():
            partial = layer(x[:, rank * width:(rank + 1) * width].contiguous())
            own = x[:, rank * width:(rank + 1) * width] @ weight[:, rank * width:(rank + 1) * width].T
            total = tensor_model_parallel_all_reduce(partial.clone())
        return {"bias_here": not torch.allclose(partial, own, atol=1e-5),
                "bias_is_the_difference": torch.allclose(partial - own, bias.expand_as(own), atol=1e-5),
                "sum_matches": torch.allclose(total, x @ weight.T + bias, atol=1e-4)}
    finally:
        shutdown_tp()
