"""GGUF mixture-of-experts files (llama.cpp's qwen3moe) against transformers on the stored values.

The files are written here from tests/moe_checkpoints.py's tiny random Qwen3-MoE (4
experts, top 2) the way llama.cpp's convert_hf_to_gguf.py lays them out: each layer's
experts stacked into `blk.N.ffn_gate_exps` / `ffn_up_exps` [E, I, H] and
`ffn_down_exps` [E, H, I], the router as `ffn_gate_inp` (F32, as llama.cpp keeps it),
the expert metadata (`expert_count`, `expert_used_count`, `expert_feed_forward_length`)
and the head size (`attention.key_length`); names from gguf's own `TensorNameMap`. Two
files: everything Q8_0 (hidden 64, experts 32 wide), and a Q4_K_M-like mix (hidden and
experts 256 wide: gate/up Q4_K, down Q6_K, attention and tables Q8_0).

The oracle: transformers on the dequantised stored values, so with float32 activations
(float products of the blocks) logits agree to 1e-4. Each rank holds the experts as the
file's blocks (uint8, the file's bytes for its experts), under expert parallelism too;
tensor parallelism that would split a block of the down type is refused at load naming
tensor_parallel_size and expert parallelism. An F16 file keeps float experts. Also the
engine's greedy tokens, and a decode step's experts in one C call (16-bit activations):
against the grouped path and the exact product, under expert parallelism, and recorded
as a CPU graph that replays the eager steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.layers import cpu_sgemm
from models.layers.quantization import gguf_moe
from tests.conftest import run_tp
from tests.moe_checkpoints import decode_with_graphs, experts_layer, grouped_apply, write_moe_checkpoint
from tests.quant_checkpoints import assert_engine_greedy_matches, hf_logits
from tests.quant_tp_helpers import load_case, tp_quant_cases
from tests.test_gguf import FILE_TYPES, add_model_metadata, read_hf_tensors, store, stored_value

INPUT_IDS = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(3))
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}

# name -> (checkpoint sizes, default type, the expert stacks' types)
FILES: dict[str, tuple[dict[str, int], str, dict[str, str]]] = {
    "q8_0": ({"hidden_size": 64, "moe_intermediate_size": 32}, "Q8_0", {}),
    "q4_k_m": ({"hidden_size": 256, "moe_intermediate_size": 256}, "Q8_0",
               {"gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}),
}


def write_qwen3moe_gguf(hf_dir: Path, out: Path, default_type: str, expert_types: dict[str, str]
                        ) -> dict[str, torch.Tensor]:
    """The checkpoint as a qwen3moe GGUF file; returns the dequantised stored values under
    the HF names (the oracle's state dict)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    add_model_metadata(writer, hf_dir.name, cfg)
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])  # (transformers 5 writes the latter)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_file_type(FILE_TYPES["Q4_K_M" if expert_types else default_type])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    values: dict[str, torch.Tensor] = {}
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in read_hf_tensors(hf_dir).items():
        if (m := _EXPERT.match(name)) is not None:
            stacks.setdefault((int(m[1]), m[3]), {})[int(m[2])] = tensor.float().numpy()
            values[name] = stored_value(tensor.float().numpy(), expert_types.get(m[3], default_type))
            continue
        qtype = "F32" if name.endswith("mlp.gate.weight") else default_type  # llama.cpp keeps routers F32
        data, raw = store(tensor.float().numpy(), qtype)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw)
        values[name] = stored_value(tensor.float().numpy(), qtype)
    for (layer, proj), experts in stacks.items():
        stacked = np.stack([experts[e] for e in sorted(experts)])  # [E, rows, cols]
        data, raw = store(stacked.reshape(-1, stacked.shape[-1]), expert_types.get(proj, default_type))
        writer.add_tensor(f"blk.{layer}.{_STACKS[proj]}.weight", data.reshape(*stacked.shape[:2], -1),
                          raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def expert_file_bytes(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf_moe")
    out = {}
    for name, (sizes, default_type, expert_types) in FILES.items():
        src = write_moe_checkpoint(root / f"{name}-src", "qwen3_moe", seed=13, **sizes)
        path = root / f"{name}.gguf"
        values = write_qwen3moe_gguf(src, path, default_type, expert_types)
        reference = root / f"{name}-reference"
        reference.mkdir()
        save_file({n: v.contiguous() for n, v in values.items()}, str(reference / "model.safetensors"))
        (reference / "config.json").write_text((src / "config.json").read_text())
        hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = hf.config.eos_token_id = None
        out[name] = SimpleNamespace(path=path, hf=hf, logits=hf_logits(hf, INPUT_IDS), sizes=sizes,
                                    expert_bytes=expert_file_bytes(path), types=expert_types or {
                                        p: default_type for p in _STACKS})
    return out


def check_experts(result: dict[str, Any], case: SimpleNamespace, num_local: int, ranks: int) -> None:
    """Every FusedMoE holds its experts as the file's blocks ([E, rows, blocks, bytes]
    uint8) and nothing else: its share of the file's expert bytes."""
    hidden, inter = case.sizes["hidden_size"], case.sizes["moe_intermediate_size"]
    up, down = (gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[case.types[p]]] for p in ("gate_proj", "down_proj"))
    assert len(result["experts"]) == 2
    for held in result["experts"].values():
        assert held == {"w13_qweight": ("torch.uint8", (num_local, 2 * inter, hidden // up[0], up[1])),
                        "w2_qweight": ("torch.uint8", (num_local, hidden, inter // down[0], down[1]))}
    assert result["expert_bytes"] == case.expert_bytes // ranks + (2 * 4 * 8 if num_local < 4 else 0)  # + EP's map


@pytest.mark.parametrize("name", list(FILES))
def test_gguf_moe_logits_match_transformers(files: dict[str, SimpleNamespace], name: str) -> None:
    case = files[name]
    result = load_case({"model": str(case.path), "input_ids": INPUT_IDS})
    torch.testing.assert_close(result["logits"], case.logits, atol=1e-4, rtol=0)
    check_experts(result, case, 4, 1)
    assert result["methods"]["model.layers.0.self_attn.qkv_proj"] == "GGUFLinearMethod"
    assert result["dtypes"]["model.layers.0.mlp.gate"] == "torch.float32"  # the router, F32 in the file


def test_f16_gguf_moe_keeps_float_experts(files: dict[str, SimpleNamespace], tmp_path: Path) -> None:
    """An F16 file's expert stacks are split per expert into the plain float experts (no
    quantisation config), logits as transformers' on the stored values."""
    case = files["q8_0"]
    src = case.path.with_name("q8_0-src")
    path = tmp_path / "f16.gguf"
    values = write_qwen3moe_gguf(src, path, "F16", {})
    result = load_case({"model": str(path), "input_ids": INPUT_IDS})
    reference = tmp_path / "f16-reference"
    reference.mkdir()
    save_file({n: v.contiguous() for n, v in values.items()}, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((src / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    torch.testing.assert_close(result["logits"], hf_logits(hf, INPUT_IDS), atol=1e-4, rtol=0)
    for held in result["experts"].values():
        assert held == {"w13_weight": ("torch.float32", (4, 64, 64)), "w2_weight": ("torch.float32", (4, 64, 32))}


def test_gguf_moe_expert_parallel_and_tensor_parallel_refusal(files: dict[str, SimpleNamespace]) -> None:
    """TP 2 with expert parallelism: two whole experts per rank, in blocks. TP 2 without it
    would give each rank 16 of the Q8_0 experts' 32 intermediate features: half a block
    of the down stack, refused naming the fix."""
    case = files["q8_0"]
    specs = [{"name": "ep", "model": str(case.path), "input_ids": INPUT_IDS,
              "kwargs": {"enable_expert_parallel": True}},
             {"name": "tp", "model": str(case.path), "input_ids": INPUT_IDS, "expect_error": True}]
    for rank_result in run_tp(tp_quant_cases, 2, specs):
        torch.testing.assert_close(rank_result["ep"]["logits"], case.logits, atol=1e-4, rtol=0)
        check_experts(rank_result["ep"], case, 2, 2)
        kind, message = rank_result["tp"]["error"]
        for needle in ("Q8_0", "16 intermediate features per rank", "tensor_parallel_size=2", "expert parallelism"):
            assert needle in message, (needle, kind, message)


@pytest.mark.slow
def test_gguf_moe_engine_greedy_matches_transformers(files: dict[str, SimpleNamespace]) -> None:
    case = files["q4_k_m"]
    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_engine_greedy_matches(case.path, case.hf, prompts, 8)


# ------------------------------------------------------------------ a decode step's experts in one C call


@pytest.mark.parametrize("name", list(FILES))
def test_c_kernel_computes_the_grouped_experts(files: dict[str, SimpleNamespace], name: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 tokens (1, 5, 16 and 64 of them): the one-call kernel and the experts
    grouped in torch against the float64 product of the dequantised experts, and against
    each other: both round the activations to int8 (the grouped path's larger groups of
    tokens take bf16 tiles, without), the kernel keeps gate/up and the activation in
    float32 where torch rounds them to bfloat16."""
    from models.layers.fused_moe.router import fused_topk

    layer = experts_layer(files[name].path, "bfloat16")
    method = layer.quant_method
    w13, w2 = (w.double() for w in method.dequantized_weights(layer))
    inter = w13.shape[1] // 2
    hidden = w2.shape[1]
    for tokens in (1, 5, 16, 64):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen).bfloat16()
        weights, ids = fused_topk(torch.randn(tokens, 4, generator=gen), 2, True)
        kernel = method.apply(layer, x, weights, ids)
        grouped = grouped_apply(gguf_moe, layer, x, weights, ids, monkeypatch)
        exact = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(2):
                e = int(ids[t, j])
                gate_up = w13[e] @ x[t].double()
                exact[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(gate_up[:inter])
                                                            * gate_up[inter:]))
        assert kernel.dtype == torch.bfloat16 and kernel.shape == (tokens, hidden)
        # (measured: 0.5-2.1% each against the exact product, the K-quants' activations
        # rounded per 256 values the most; a wrong expert, pair or weight is tens of per cent)
        assert rel_err(kernel, exact) < 3e-2 and rel_err(grouped, exact) < 3e-2, tokens
        assert rel_err(kernel, grouped) < 3e-2, tokens


@pytest.mark.parametrize("name", list(FILES))
def test_c_kernel_token_does_not_depend_on_its_batch(files: dict[str, SimpleNamespace], name: str) -> None:
    """Each token's activations are quantised alone (per 256 values for the K-quants however
    many tokens its experts get: 64 tokens over 4 experts give each 20-45), and each output
    is summed in its own order: a token's row is the same in a batch as alone."""
    from models.layers.fused_moe.router import fused_topk

    layer = experts_layer(files[name].path, "bfloat16")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, layer.w2_qweight.shape[1], generator=gen).bfloat16()
    weights, ids = fused_topk(torch.randn(64, 4, generator=gen), 2, True)
    assert ids.flatten().bincount().min() >= 8  # every expert past the 8 tokens a product takes at once
    batch = layer.quant_method.apply(layer, x, weights, ids)
    for t in (0, 17, 63):
        alone = layer.quant_method.apply(layer, x[t:t + 1], weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(batch[t:t + 1], alone), t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_c_kernel_under_expert_parallelism_and_bad_ids(files: dict[str, SimpleNamespace],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank holding experts 2 and 3 of 4 (the map sends 0 and 1 to -1): the kernel adds
    only its experts' pairs, as the grouped path does; an id past the model's experts is a
    ValueError naming them."""
    from models.layers.fused_moe.router import fused_topk

    full = experts_layer(files["q8_0"].path, "bfloat16")
    rank = SimpleNamespace(w13_qweight=full.w13_qweight[2:].contiguous(), w2_qweight=full.w2_qweight[2:].contiguous(),
                           expert_map=torch.tensor([-1, -1, 0, 1]), num_experts=4, quant_method=full.quant_method)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, full.w2_qweight.shape[1], generator=gen).bfloat16()
    weights, ids = fused_topk(torch.randn(7, 4, generator=gen), 2, True)
    method = full.quant_method
    kernel = method.apply(rank, x, weights, ids)
    assert rel_err(kernel, grouped_apply(gguf_moe, rank, x, weights, ids, monkeypatch)) < 1e-2
    ids[3, 1] = 4
    with pytest.raises(ValueError, match="outside the model's 4 experts"):
        method.apply(rank, x, weights, ids)


@pytest.mark.parametrize("name", list(FILES))
def test_c_kernel_does_not_depend_on_the_thread_count(files: dict[str, SimpleNamespace], name: str) -> None:
    """Every expert's products are one parallel loop over all their rows, split between
    threads by rows weighted by each expert's tokens: each output is one thread's sum in a
    fixed order, so 1, 2 and 3 threads give the same bits, for one token (every expert
    reading one quantised input) and for batches whose experts get different counts."""
    from models.layers.fused_moe.router import fused_topk

    layer = experts_layer(files[name].path, "bfloat16")
    gen = torch.Generator().manual_seed(21)
    threads = torch.get_num_threads()
    try:
        for tokens in (1, 3, 16):
            x = torch.randn(tokens, layer.w2_qweight.shape[1], generator=gen).bfloat16()
            weights, ids = fused_topk(torch.randn(tokens, 4, generator=gen), 2, True)
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(layer.quant_method.apply(layer, x, weights, ids))
            assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2]), tokens
    finally:
        torch.set_num_threads(threads)


def test_c_kernel_with_no_local_pair_gives_zeros(files: dict[str, SimpleNamespace]) -> None:
    """A rank holding experts 2 and 3 of 4 while every token picks experts 0 and 1: no
    product runs, and the rank's share of the output is zeros (the all-reduce adds the
    other rank's)."""
    full = experts_layer(files["q4_k_m"].path, "bfloat16")
    rank = SimpleNamespace(w13_qweight=full.w13_qweight[2:].contiguous(), w2_qweight=full.w2_qweight[2:].contiguous(),
                           expert_map=torch.tensor([-1, -1, 0, 1]), num_experts=4, quant_method=full.quant_method)
    x = torch.randn(5, full.w2_qweight.shape[1], generator=torch.Generator().manual_seed(8)).bfloat16()
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    out = full.quant_method.apply(rank, x, torch.full((5, 2), 0.5), ids)
    assert out.shape == x.shape and not out.any()


@pytest.mark.skipif(not cpu_sgemm.cpu_has_avx2(), reason="no AVX2/FMA on this CPU")
def test_c_kernel_of_the_avx2_build(files: dict[str, SimpleNamespace], gguf_avx2_kernels: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts' one call as an AVX2 CPU without AVX-512 builds it (gguf_avx2.c's
    products, built here whatever this CPU adds): against the exact product at 1, 5 and 16
    tokens, and a token's row the same alone as in a batch of 64 whose experts get 20-45
    tokens each (K-quant experts' tokens go 7 at a time, so their activations are quantised
    per 256 values, as one token's are, where the AVX2 products take 8 tokens or more per
    32)."""
    from models.layers.fused_moe.router import fused_topk

    avx2 = gguf_avx2_kernels
    assert avx2 is not None and not avx2.has_bf16
    monkeypatch.setattr(gguf_moe, "load", lambda: avx2)
    for name in FILES:
        layer = experts_layer(files[name].path, "bfloat16")
        w13, w2 = (w.double() for w in layer.quant_method.dequantized_weights(layer))
        inter = w13.shape[1] // 2
        gen = torch.Generator().manual_seed(4)
        for tokens in (1, 5, 16):
            x = torch.randn(tokens, w2.shape[1], generator=gen).bfloat16()
            weights, ids = fused_topk(torch.randn(tokens, 4, generator=gen), 2, True)
            exact = torch.zeros(tokens, w2.shape[1], dtype=torch.float64)
            for t in range(tokens):
                for j in range(2):
                    gate_up = w13[int(ids[t, j])] @ x[t].double()
                    exact[t] += float(weights[t, j]) * (w2[int(ids[t, j])] @ (
                        torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]))
            assert rel_err(layer.quant_method.apply(layer, x, weights, ids), exact) < 3e-2, (name, tokens)
        x = torch.randn(64, w2.shape[1], generator=gen).bfloat16()
        weights, ids = fused_topk(torch.randn(64, 4, generator=gen), 2, True)
        assert ids.flatten().bincount().min() >= 8
        batch = layer.quant_method.apply(layer, x, weights, ids)
        for t in (0, 17, 63):
            assert torch.equal(batch[t:t + 1], layer.quant_method.apply(layer, x[t:t + 1], weights[t:t + 1],
                                                                        ids[t:t + 1])), (name, t)


def test_gguf_moe_decode_steps_are_recorded_and_replay_eager(files: dict[str, SimpleNamespace]) -> None:
    """In bfloat16 a decode step's experts are one C call reading the routing from tensors:
    every decode batch size is recorded as a CPU graph and replays the eager steps' tokens
    and logprobs."""
    eager, none = decode_with_graphs(files["q4_k_m"].path, True)
    replayed, sizes = decode_with_graphs(files["q4_k_m"].path, False)
    assert none == [[]] and sizes == [[1, 2, 3]]
    assert replayed == eager
