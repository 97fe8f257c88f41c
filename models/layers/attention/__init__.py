"""Attention: the layer models call, and the backends that run it per platform.

    layer.py               Attention (the nn.Module), AttentionSpec, causal_sdpa
    backends/abstract.py   AttentionBackend, AttentionImpl, AttentionMetadata, gather_paged_kv
    backends/torch_sdpa.py TorchSDPABackend: portable paged SDPA (CUDA for now)
    backends/cpu_attn.py   CPUAttentionBackend: SDPA plus the per-layer decode context
    selector.py            get_attn_backend(device_type, num_layers)
"""

from models.layers.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from models.layers.attention.layer import Attention, AttentionSpec
from models.layers.attention.selector import get_attn_backend

__all__ = ["Attention", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionSpec", "get_attn_backend"]
