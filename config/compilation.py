"""CompilationConfig: CUDA graphs for decode steps (vLLM's names), and the CPU's graphs."""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's default ceiling on the largest captured batch.
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default sizes up to `max_size`: 1, 2, 4, then every multiple of 8 (a decode
    batch is padded to the next one, so padding wastes at most 7 rows), and `max_size`
    itself when it is none of those."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


@dataclass
class CompilationConfig:
    # True: every step runs eagerly (--enforce-eager); False: pure-decode steps of up to
    # the largest capture size replay a CUDA graph (CUDA with TRITON_ATTN only).
    enforce_eager: bool = True
    # Ascending batch sizes (decode sequences) captured at start-up; a batch is padded to
    # the smallest size that holds it. Empty when graphs are off.
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    # The CPU's counterpart (worker/cpu_graph.py): pure-decode steps of up to this many
    # sequences replay their recorded forward, each batch size recorded on first use and
    # never padded; 0 when off (enforce_eager, CUDA, another attention backend).
    cpu_graph_max_batch: int = 0

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    def padded_batch_size(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of `num_seqs` runs at, or None (eager)."""
        for size in self.cudagraph_capture_sizes:
            if size >= num_seqs:
                return size
        return None
