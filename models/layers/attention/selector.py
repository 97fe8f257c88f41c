"""Which attention backend a platform runs: `get_attn_backend(device_type, num_layers)`.

Called once per rank by the ModelRunner. A flash-attention backend for CUDA would be
chosen here; the models and the runner never name a backend.
"""

from __future__ import annotations

from models.layers.attention.backends.abstract import AttentionBackend


def get_attn_backend(device_type: str, num_layers: int) -> AttentionBackend:
    """The backend for a rank on `device_type` ("cpu" | "cuda") serving `num_layers`
    attention layers."""
    if device_type == "cpu":
        from models.layers.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend(num_layers)
    from models.layers.attention.backends.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend()
