"""reshape_and_cache: write a step's new keys and values into the paged KV cache.

Called by TritonAttentionImpl.forward (every rank, the model's thread) before the
attention kernel reads the cache, so that every token of the step is in the cache before
any sequence attends (AttentionImpl.forward's contract). One program per token; the
launch grid depends only on the number of token rows, so a decode batch captured in a
CUDA graph replays with new slots. A negative slot (a padding row of a padded batch)
writes nothing. Allocates nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr,
    block_size,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # A slot is block_id * block_size + offset; block_size need not be a power of two.
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    dst = kv_cache_ptr + block * stride_cache_block + offset * stride_cache_slot
    dst += heads[:, None] * stride_cache_head + dims[None, :]
    cache_dtype = kv_cache_ptr.dtype.element_ty
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    tl.store(dst, key.to(cache_dtype), mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
                    mask=mask)
    tl.store(dst + stride_cache_kv, value.to(cache_dtype), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key, value [T, num_kv_heads, head_size] (any dtype; converted to the cache's) into
    `kv_cache` [num_blocks, 2, block_size, num_kv_heads, head_size] at `slot_mapping`
    [T] (int32 or int64, block_id * block_size + offset; < 0 = skip).

    The cache must be contiguous (it is allocated so); key and value only need unit
    stride in their last dimension, which a slice of the fused QKV projection has."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert kv_cache.is_contiguous() and kv_cache.shape[1] == 2, "the paged cache layout is fixed"
    assert kv_cache.shape[3:] == (num_kv_heads, head_size) and slot_mapping.shape[0] == num_tokens
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        kv_cache.shape[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads), HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
    )
