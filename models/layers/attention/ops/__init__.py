"""Triton kernels of the TRITON_ATTN backend (backends/triton_attn.py).

    triton_reshape_and_cache.py   reshape_and_cache: a step's K/V into the paged cache
    triton_unified_attention.py   unified_attention: every sequence of a step (decode,
                                  prefill, chunked prefill, prefix hits) in one launch,
                                  K/V read through the block table

They run on CUDA tensors, or on CPU tensors under Triton's interpreter: TRITON_INTERPRET=1
must be in os.environ before either module is imported (Triton reads it when the
@triton.jit functions are defined). Importing this package imports no kernel and no triton.
"""
