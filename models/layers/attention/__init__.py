"""Attention: the layer models call, and the backends that run it per platform.

    layer.py               Attention (the nn.Module), AttentionSpec
    masked_attention.py    causal_sdpa (one sequence, no cache); causal_attention,
                           capped_attention: sliding window and soft cap with explicit,
                           memory-bounded masks
    backends/abstract.py   AttentionBackend, AttentionImpl, AttentionMetadata, AttentionLayer
                           (what a backend reads of the layer), gather_paged_kv
    backends/triton_attn.py TritonAttentionBackend: TRITON_ATTN, Triton paged attention
                           (CUDA; the CPU under Triton's interpreter)
    backends/torch_sdpa.py TorchSDPABackend: TORCH_SDPA, portable SDPA over gathered K/V
    backends/cpu_attn.py   CPUAttentionBackend: CPU_ATTN, SDPA plus the per-layer decode context
    ops/                   the Triton kernels
    selector.py            get_attn_backend(name, num_layers)
"""

from models.layers.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from models.layers.attention.layer import Attention, AttentionSpec
from models.layers.attention.selector import get_attn_backend

__all__ = ["Attention", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionSpec", "get_attn_backend"]
