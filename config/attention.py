"""AttentionConfig: which attention backend the ranks run, by vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's names. TRITON_ATTN: Triton paged attention that reads the block table (CUDA, or
# the CPU under Triton's interpreter, TRITON_INTERPRET=1); TORCH_SDPA: torch's SDPA over
# K/V gathered from the paged cache (any device); CPU_ATTN: SDPA plus the CPU's decode
# kernel (the CPU only).
ATTENTION_BACKENDS = ("TRITON_ATTN", "TORCH_SDPA", "CPU_ATTN")


@dataclass
class AttentionConfig:
    # One of ATTENTION_BACKENDS; the resolution step turns "auto" into TRITON_ATTN on CUDA
    # (TORCH_SDPA where Triton is not installed) and CPU_ATTN on the CPU.
    backend: str = "CPU_ATTN"
