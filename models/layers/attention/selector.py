"""Which attention backend a rank runs: `get_attn_backend(name, num_layers)`.

Called once per rank by the ModelRunner with the resolved `AttentionConfig.backend`
(engine/arg_utils.py chose it for the device and refused one that cannot run there).
The models and the runner never name a backend.
"""

from __future__ import annotations

from models.layers.attention.backends.abstract import AttentionBackend


def get_attn_backend(name: str, num_layers: int) -> AttentionBackend:
    """The backend called `name` (vLLM's names: "TRITON_ATTN", "TORCH_SDPA",
    "CPU_ATTN") for a rank serving `num_layers` attention layers; ValueError for
    another name."""
    if name == "CPU_ATTN":
        from models.layers.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend(num_layers)
    if name == "TORCH_SDPA":
        from models.layers.attention.backends.torch_sdpa import TorchSDPABackend

        return TorchSDPABackend()
    if name == "TRITON_ATTN":
        from models.layers.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; valid: 'TRITON_ATTN', 'TORCH_SDPA', 'CPU_ATTN'")
