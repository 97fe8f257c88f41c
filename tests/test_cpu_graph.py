"""CPU graphs (worker/cpu_graph.py): a recorded forward replays what the eager one
computes, on new inputs; what cannot be replayed is refused while recording and runs
eagerly; and in the engine, replayed decode steps give eager's tokens and logprobs on
every CPU layer path (float32, bf16, the GGUF blocks), with each batch size recorded
once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import SamplingParams
from engine.arg_utils import create_engine_config
from engine.core import EngineCore
from models.layers import cpu_ops
from models.layers.attention.backends import paged_decode
from models.layers.attention.backends.cpu_attn import (
    CASCADE_MIN_TOKENS,
    CPUAttentionBackend,
)
from worker.cpu_graph import NotCapturable, _NativeStep, record

# ------------------------------------------------------------------ the recorder


def _norm_then_torch_ops(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A C call between torch ops: out-of-place, in place, views, a list argument."""
    kernel = cpu_ops.load()
    h = x * 2.0
    normed = kernel.rms_norm(h, None, weight, 1e-6)
    assert normed is not None
    first, second = normed.split([3, 5], dim=-1)
    torch.nn.functional.silu(first, inplace=True)
    joined = torch.cat([second, first], dim=-1)
    return joined.add_(x)


def test_a_recorded_forward_replays_on_new_inputs():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    weight = torch.rand(8) + 0.5
    out, graph = record(lambda: _norm_then_torch_ops(x, weight))
    torch.testing.assert_close(out, _norm_then_torch_ops(x.clone(), weight), rtol=0, atol=0)
    for _ in range(3):
        x.copy_(torch.randn(4, 8))  # what a runner does to its buffers between replays
        expected = _norm_then_torch_ops(x.clone(), weight)
        got = graph.replay()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The step makes three [4, 8] tensors (h, normed, joined); joined takes h's place,
    # dead once the norm has read it, so the arena holds two.
    assert graph.arena.numel() == 2 * x.numel() * x.element_size()


@pytest.mark.parametrize("bad", ["item", "tensor", "nonzero"])
def test_data_dependent_forwards_are_refused(bad):
    x = torch.randn(4, 8)

    def forward() -> torch.Tensor:
        y = x * 2
        if bad == "item":
            return y * float(y.sum().item())
        if bad == "tensor":
            return y + torch.tensor([1.0])
        return y[y.nonzero()[:, 0]]

    with pytest.raises(NotCapturable):
        record(forward)
    # The recorder is gone: kernels and ops run as usual afterwards.
    assert cpu_ops.load().rms_norm(x, None, torch.ones(8), 1e-6) is not None


def test_ops_with_several_outputs_and_overloads_replay():
    """A router's ops: topk (two outputs: written through topk.values' values= and
    indices=), a sum over a dim (whose out overload is sum.IntList_out, not sum.out),
    a softmax in float32."""
    logits = torch.randn(5, 8)

    def router() -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, 2, dim=-1)
        return torch.cat([weights / weights.sum(dim=-1, keepdim=True), ids.float()], dim=-1)

    _, graph = record(router)
    for _ in range(2):
        logits.copy_(torch.randn(5, 8))
        torch.testing.assert_close(graph.replay(), router(), rtol=0, atol=0)


def test_integer_indexing_replays_and_boolean_masks_are_refused():
    table = torch.randn(10, 4)
    ids = torch.tensor([3, 1, 7])
    _, graph = record(lambda: table[ids * 1] * 2)  # an index computed in the step, then gathered
    ids.copy_(torch.tensor([0, 9, 2]))
    torch.testing.assert_close(graph.replay(), table[ids] * 2, rtol=0, atol=0)
    with pytest.raises(NotCapturable, match="aten.index"):
        record(lambda: table[table[:, 0] > 0] * 2)


def test_a_c_call_on_another_thread_is_not_recorded():
    """The recorder is per thread: a kernel another thread calls while a forward records
    runs as usual and stays out of the graph, whose replay computes only its own step."""
    import threading

    kernel = cpu_ops.load()
    x, weight = torch.randn(4, 8), torch.rand(8) + 0.5
    other_in, other_out = torch.randn(2, 8), []

    def forward() -> torch.Tensor:
        h = x * 2.0
        thread = threading.Thread(target=lambda: other_out.append(kernel.rms_norm(other_in, None, weight, 1e-6)))
        thread.start()
        thread.join()
        return kernel.rms_norm(h, None, weight, 1e-6)

    out, graph = record(forward)
    torch.testing.assert_close(other_out[0], kernel.rms_norm(other_in, None, weight, 1e-6), rtol=0, atol=0)
    other_in.fill_(1e6)  # had the other thread's call been recorded, replay would write to its output
    before = other_out[0].clone()
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(graph.replay(), kernel.rms_norm(x * 2.0, None, weight, 1e-6), rtol=0, atol=0)
    assert torch.equal(other_out[0], before)
    assert sum(isinstance(step, _NativeStep) for step in graph.steps) == 1  # the step's own norm only


def test_a_kernel_status_that_changes_at_replay_raises():
    kernel = cpu_ops.load()
    q, k = torch.randn(1, 8), torch.randn(1, 8)
    positions = torch.zeros(1, dtype=torch.long)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)

    def forward() -> torch.Tensor:
        q2, k2 = q * 1.0, k * 1.0
        assert kernel.rotary_neox(q2, k2, 8, positions, cos, sin)
        return q2

    _, graph = record(forward)
    positions.fill_(7)  # outside the 4-position tables: the kernel refuses it
    with pytest.raises(RuntimeError, match="cpu_rotary_neox returned"):
        graph.replay()


def test_shared_prefixes_are_left_to_the_eager_cascade():
    bs = 16
    shared = CASCADE_MIN_TOKENS // bs
    tables = [list(range(shared)) + [100 + i] for i in range(3)]
    lens = [shared * bs + 1] * 3
    assert CPUAttentionBackend.decode_shares_prefix(tables, lens, bs)
    assert not CPUAttentionBackend.decode_shares_prefix(tables[:1], lens[:1], bs)
    assert not CPUAttentionBackend.decode_shares_prefix([[i] + t[1:] for i, t in enumerate(tables)], lens, bs)
    # Every sequence keeps a token of its own past the shared blocks.
    assert not CPUAttentionBackend.decode_shares_prefix(tables, [shared * bs] * 3, bs)


# ------------------------------------------------------------------ the engine


def test_cpu_graphs_resolve_for_cpu_attn(tiny_models):
    model = str(tiny_models["llama"])

    def resolve(**kwargs):
        return create_engine_config(model=model, device="cpu", dtype="float32", max_model_len=128,
                                    **kwargs).compilation_config

    on = resolve(max_num_seqs=8)
    assert not on.enforce_eager and on.cpu_graph_max_batch == 8 and on.cudagraph_capture_sizes == []
    assert resolve(max_num_seqs=64, max_cudagraph_capture_size=20).cpu_graph_max_batch == 20
    assert resolve(tensor_parallel_size=2, max_num_seqs=4).cpu_graph_max_batch == 4
    for off in (resolve(enforce_eager=True), resolve(attention_backend="TORCH_SDPA")):
        assert off.enforce_eager and off.cpu_graph_max_batch == 0


def _captured_sizes(worker) -> list[int]:
    graphs = worker.model_runner.cpu_graphs
    return [] if graphs is None else graphs.captured_sizes


def _generate(model: str, eager: bool, **kwargs) -> tuple[list, list[list[int]]]:
    """Three prompts of different lengths and budgets (the batch shrinks 3 -> 2 -> 1;
    the contexts cross block boundaries), with logprobs: (outputs, recorded sizes)."""
    prompts = [[5, 9, 13, 2, 7, 11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [42, 17]]
    budgets = [23, 9, 15]
    with EngineCore(model=model, device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22, block_size=16,
                    enforce_eager=eager, use_tqdm_on_load=False, **kwargs) as core:
        outs = [core.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3))[0]
                for p, n in zip(prompts[:1], budgets[:1])]
        outs += core.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)
                                        for n in budgets])
        sampled = core.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.8, seed=3))
        sizes = core.collective_rpc(_captured_sizes)
    return [(o.token_ids, o.logprobs) for o in outs] + [o.token_ids for o in sampled], sizes


@pytest.mark.parametrize("name,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("llama", "float16"),
                                        ("qwen2_tied_v333", "bfloat16"), ("mistral", "float32")])
def test_replayed_decode_steps_match_eager(tiny_models, name, dtype):
    eager, none = _generate(str(tiny_models[name]), True, dtype=dtype)
    replayed, sizes = _generate(str(tiny_models[name]), False, dtype=dtype)
    assert none == [[]] and sizes == [[1, 2, 3]]
    assert replayed == eager


def test_a_cache_dtype_the_kernel_does_not_take_runs_eagerly(tiny_models, monkeypatch):
    """A KV-cache dtype the paged decode kernel has no entry point for (here float16 taken
    out of its table; the engine runs in this process at TP=1): no graph is set up and
    every step runs as before, through torch's attention."""
    monkeypatch.delitem(paged_decode._DTYPES, torch.float16)
    eager, none = _generate(str(tiny_models["llama"]), True, dtype="float16")
    got, sizes = _generate(str(tiny_models["llama"]), False, dtype="float16")
    assert none == sizes == [[]]
    assert got == eager


def test_replayed_gguf_blocks_match_eager(tmp_path):
    """A Q4_K_M-style GGUF file in bfloat16: int8 products from the blocks, the
    embedding dequantised by row, the LM head from Q6_K blocks."""
    from engine.tiny_model import make_tiny_model
    from tests.test_gguf import write_gguf
    from tests.test_gguf_quantised import MIXED

    spec = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 320, "init_std": 0.05, "with_tokenizer": False}
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", seed=21, tie_word_embeddings=False, **spec)
    path = str(write_gguf(hf_dir, tmp_path / "mixed.gguf", "Q4_K_M", tensor_types=MIXED))
    eager, _ = _generate(path, True, dtype="bfloat16", load_format="gguf")
    replayed, sizes = _generate(path, False, dtype="bfloat16", load_format="gguf")
    assert sizes == [[1, 2, 3]]
    assert replayed == eager

    def batch(eager: bool) -> tuple[list, list[list[int]]]:
        """Nine sequences at once (the int8 tiles from 8 tokens on) of different budgets."""
        prompts = [[(7 * i + j) % 320 for j in range(3 + i)] for i in range(9)]
        with EngineCore(model=path, load_format="gguf", device="cpu", dtype="bfloat16", max_model_len=128,
                        kv_cache_memory_bytes=1 << 22, block_size=16, enforce_eager=eager,
                        use_tqdm_on_load=False) as core:
            outs = core.generate(prompts, [SamplingParams(max_tokens=6 + (i % 3), temperature=0.0, ignore_eos=True,
                                                          logprobs=2) for i in range(9)])
            return [(o.token_ids, o.logprobs) for o in outs], core.collective_rpc(_captured_sizes)

    eager, _ = batch(True)
    replayed, sizes = batch(False)
    assert sizes == [[3, 6, 9]]  # 9 sequences until the first budgets end, then 6, then 3
    assert replayed == eager


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_decode_steps_match_eager_at_tp2(tiny_models, dtype):
    """Two ranks: each records the same sizes, and the collectives (the shared-memory
    all-reduce fused with the norm, the embedding's) run again at every replay."""
    model = str(tiny_models["llama_h8_kv2"])
    eager, _ = _generate(model, True, dtype=dtype, tensor_parallel_size=2)
    replayed, sizes = _generate(model, False, dtype=dtype, tensor_parallel_size=2)
    assert sizes == [[1, 2, 3], [1, 2, 3]]
    assert replayed == eager


def test_recording_imports_no_compiler_stack():
    """A dispatch mode's handler is wrapped in torch._dynamo.disable by default, which
    imports dynamo, fx and sympy (about 150 MiB resident); the recorder opts out."""
    code = ("import sys, torch\n"
            "from worker.cpu_graph import record\n"
            "x = torch.ones(4)\n"
            "out, graph = record(lambda: x * 2)\n"
            "x.fill_(3)\n"
            "assert graph.replay().tolist() == [6.0] * 4\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'sympy'))))\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _hook_last_layer(worker) -> None:
    layer = worker.model_runner.model.model.layers[-1]
    worker.hook_calls = 0

    def hook(module, args) -> None:
        worker.hook_calls += 1

    worker.hook_handle = layer.register_forward_pre_hook(hook)


def _unhook(worker) -> int:
    worker.hook_handle.remove()
    return worker.hook_calls


def test_a_forward_hook_makes_steps_run_eagerly(tiny_models):
    """A replay runs no module's Python, so while a hook is registered every step runs
    eagerly (the hook sees each one); once it is removed, steps replay again."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with EngineCore(model=str(tiny_models["llama"]), device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22,
                    use_tqdm_on_load=False) as core:
        (before,) = core.generate([[5, 9, 13]], params)
        assert core.collective_rpc(_captured_sizes) == [[1]]
        core.collective_rpc(_hook_last_layer)
        (hooked,) = core.generate([[5, 9, 13]], params)
        assert core.collective_rpc(_unhook) == [6]  # the prefill and five decode steps
        (after,) = core.generate([[5, 9, 13]], params)
    assert before.token_ids == hooked.token_ids == after.token_ids


def _replace_last_layers_forward(worker) -> None:
    layer = worker.model_runner.model.model.layers[-1]
    original = type(layer).forward
    worker.replaced_calls = 0

    def forward(*args, **kwargs):
        worker.replaced_calls += 1
        return original(layer, *args, **kwargs)

    layer.forward = forward


def _restore_last_layers_forward(worker) -> int:
    del worker.model_runner.model.model.layers[-1].forward
    return worker.replaced_calls


def test_a_replaced_forward_makes_steps_run_eagerly(tiny_models):
    """A module's forward replaced on the instance (a test's fault injection, a user's
    probe) runs at every step while it is there."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with EngineCore(model=str(tiny_models["llama"]), device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22,
                    use_tqdm_on_load=False) as core:
        (before,) = core.generate([[5, 9, 13]], params)
        core.collective_rpc(_replace_last_layers_forward)
        (replaced,) = core.generate([[5, 9, 13]], params)
        assert core.collective_rpc(_restore_last_layers_forward) == [6]
        (after,) = core.generate([[5, 9, 13]], params)
        assert core.collective_rpc(_captured_sizes) == [[1]]
    assert before.token_ids == replaced.token_ids == after.token_ids


def test_new_weights_are_recorded_again(tiny_models):
    """update_weights drops the graphs (recorded with the old weights' tensors); the next
    decode steps record again and give what an eager engine on the new weights gives."""
    new = str(tiny_models["llama_1shard"])  # the same shapes, other values
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    with EngineCore(model=new, device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22, enforce_eager=True,
                    use_tqdm_on_load=False) as core:
        (expected,) = core.generate([[5, 9, 13]], params)
    with EngineCore(model=str(tiny_models["llama"]), device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22,
                    use_tqdm_on_load=False) as core:
        (old,) = core.generate([[5, 9, 13]], params)
        core.update_weights(new)
        assert core.collective_rpc(_captured_sizes) == [[]]
        (got,) = core.generate([[5, 9, 13]], params)
        assert core.collective_rpc(_captured_sizes) == [[1]]
    assert old.token_ids != expected.token_ids
    assert (got.token_ids, got.logprobs) == (expected.token_ids, expected.logprobs)
