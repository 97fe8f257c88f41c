"""A fused GGUF layer's shards in one kernel call (`gguf_linear_shards`).

A Q4_K_M layer mixes types per shard (q and k in Q4_K, v in Q6_K; gate in Q4_K, up in
Q6_K): the one call must give, bit for bit, what `gguf_linear` gives each shard, for
every token count the int8 path, the int8 tiles (K-quants and Q8_0; Q4_0 too on VNNI;
Q8_0 from 16 tokens where the build has bf16 tiles) and the bf16 tiles take, and for both
16-bit activation dtypes. A layer whose shards' paths differ at its token count (the
int8 tiles for some, not others) is left to `gguf_linear` shard by shard. On an AVX2
build (int8 products and int8 tiles, no bf16 tiles) Q4_0 shards take one call up to 16
tokens, with Q8_0 ones below 8.
"""

from __future__ import annotations

import pytest
import torch

from models.layers.quantization import gguf_kernels
from models.layers.quantization.gguf import GGUFLinearMethod
from tests.gguf_kquants import quantize as quantize_blocks

kernel = gguf_kernels.load()
needs_int8 = pytest.mark.skipif(
    kernel is None or not kernel.gemm("Q8_0", torch.zeros(1, 34, dtype=torch.uint8), 32, torch.zeros(1, 32),
                                      torch.empty(1, 1), int8_activations=True),
    reason="this CPU or build has no int8 path (AVX-512 VNNI or AVX2)")


def _blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.from_numpy(quantize_blocks((torch.randn(rows, k, generator=g) * 0.3).numpy(), qtype))


KQUANTS = [("Q4_K", 40), ("Q5_K", 24), ("Q6_K", 16)]
LEGACY = [("Q8_0", 8), ("Q4_0", 8)]


@needs_int8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 40, 100])
@pytest.mark.parametrize("types", [KQUANTS, LEGACY, KQUANTS + LEGACY], ids=["kquants", "legacy", "mixed"])
def test_shards_in_one_call_equal_one_call_each(types, dtype, tokens):
    k = 512
    shards = [(qtype, _blocks(qtype, rows, k, seed)) for seed, (qtype, rows) in enumerate(types)]
    x = (torch.randn(tokens, k, generator=torch.Generator().manual_seed(9)) * 2).to(dtype)
    plan = gguf_kernels.shard_plan(shards)
    assert plan is not None and plan.rows == sum(rows for _, rows in types)
    out = torch.full((tokens, plan.rows), float("nan"))
    # the int8 tiles where they take every shard at this count (`int8_tiles_take`); where they
    # take none, bf16 tiles up to 64 tokens (AVX-512 BF16) or int8 products up to 16 (every
    # count below 8); where they take some, shard by shard
    legacy_max = gguf_kernels.BF16_TILE_MAX_TOKENS if kernel.has_bf16 else gguf_kernels.SMALL_BATCH_TOKENS
    takes = [kernel.int8_tiles_take(qtype, tokens) for qtype, _ in types]
    one_call = all(takes) or (not any(takes) and tokens <= legacy_max)
    assert gguf_kernels.gguf_linear_shards(plan, k, x, out) == one_call
    if not one_call:
        assert out.isnan().all()  # declined: nothing written
        return
    start = 0
    for qtype, blocks in shards:
        one = torch.empty(tokens, blocks.shape[0])
        gguf_kernels.gguf_linear(qtype, blocks, k, x, one)
        assert torch.equal(out[:, start:start + blocks.shape[0]], one), qtype
        start += blocks.shape[0]


@needs_int8
def test_shards_path_declines_what_it_does_not_take():
    """float32 activations (the exact float path), more Q4_0 tokens than the bf16 tiles
    take where the int8 tiles do not take Q4_0 (AVX2: the tiled GEMM) and a shard held as
    floats each leave it to `gguf_linear`; K-quant and Q8_0 shards (and Q4_0 ones on VNNI)
    take any number of tokens past the bf16 tiles' (the int8 tiles)."""
    k = 256
    shards = [("Q4_K", _blocks("Q4_K", 8, k, 1))]
    plan = gguf_kernels.shard_plan(shards)
    many = gguf_kernels.BF16_TILE_MAX_TOKENS + 1
    out = torch.empty(many, 8)
    assert not gguf_kernels.gguf_linear_shards(plan, k, torch.randn(1, k), out[:1])
    assert gguf_kernels.gguf_linear_shards(plan, k, torch.randn(many, k).bfloat16(), out) == kernel.has_int8_tiles
    legacy = gguf_kernels.shard_plan([("Q4_0", _blocks("Q4_0", 8, k, 2))])
    taken = gguf_kernels.gguf_linear_shards(legacy, k, torch.randn(many, k).bfloat16(), out)
    assert taken == ("Q4_0" in kernel.int8_tile_types)
    q8 = gguf_kernels.shard_plan([("Q8_0", _blocks("Q8_0", 8, k, 3))])
    taken = gguf_kernels.gguf_linear_shards(q8, k, torch.randn(many, k).bfloat16(), out)
    assert taken == ("Q8_0" in kernel.int8_tile_types)
    floats = torch.randn(8, k).view(torch.uint8)
    assert gguf_kernels.shard_plan([*shards, ("F32", floats)]) is None


def test_layer_plan_follows_its_storage():
    """The plan holds the blocks' addresses: it is rebuilt once `qweight` moves (sleep
    mode frees and refills the weights), and reused while it does not."""
    layer = torch.nn.Module()
    method = GGUFLinearMethod(["Q8_0", "Q8_0"])
    method.create_weights(layer, 64, [4, 4], 64, 8, torch.bfloat16, weight_loader=None)
    first = method.shard_plan(layer)
    assert method.shard_plan(layer) is first
    layer.qweight.data = layer.qweight.data.clone()
    second = method.shard_plan(layer)
    assert second is not first
    if second is not None:
        assert list(second.pointers)[0] == layer.qweight.data_ptr()
