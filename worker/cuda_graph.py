"""CUDA graphs for decode steps: each batch size captured once, replayed every step.

A decode step of a small model is bound by kernel launches (about 30 per layer, each
a few µs of host time); a replayed graph launches them all at once. As vLLM does, the
ModelRunner captures the model's forward (not the logits or the sampling) for every
size in `CompilationConfig.cudagraph_capture_sizes`, reading its inputs and its
attention metadata from persistent buffers (`DecodeBuffers`); a step whose every
sequence decodes one token is padded to the next captured size, its inputs copied
into the buffers, and the graph replayed.

Padding rows are inert: token 0 at position 0, slot -1 (the backend writes no K/V for
it) and no context (seq_len 0: the kernel attends to nothing), so they never touch the
cache or another row. Only an attention backend that takes every length from device
buffers (`AttentionBackend.supports_cuda_graphs`: TRITON_ATTN) can be captured; the
resolution step turns graphs off for the others. A layer whose method reads routing on
the host (a quantisation method with `supports_cuda_graphs = False`: block-fp8 experts,
grouped per expert) cannot be captured either: `capture()` then captures nothing, says
which layer, and every decode step runs eagerly from the same buffers.

Called by the ModelRunner on every rank alike: capture after the KV cache is
allocated (a collective per size at TP > 1, so every rank captures the same sizes in
the same order), replay per step. A graph bakes in the addresses of the weights and the
KV cache, so the runner drops the graphs when sleep mode releases either and captures
again on wake-up. Memory: the buffers (a few KiB per row) and one graph memory pool
shared by every size, about the activations of the largest captured batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from models.layers.attention import AttentionBackend, AttentionMetadata


@dataclass
class DecodeInputs:
    """One pure-decode step, as host lists: one token per sequence."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)


class DecodeBuffers:
    """The persistent device tensors a captured graph reads: the model's inputs and the
    attention metadata of up to `max_batch` decode sequences of up to `max_blocks`
    KV blocks each; lengths and block tables in `index_dtype` (int32 for the Triton
    kernels, int64 for the CPU's paged decode kernel)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device,
                 index_dtype: torch.dtype = torch.int32) -> None:
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        # Rows: input ids, positions, slots, sequence lengths; filled by one copy per step.
        self.rows = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self.rows[2].fill_(-1)
        self.seq_lens = torch.zeros(max_batch, dtype=index_dtype, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=index_dtype, device=device)
        self._pin = device.type == "cuda"

    @property
    def input_ids(self) -> torch.Tensor:
        return self.rows[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.rows[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.rows[2]

    def fits(self, inputs: DecodeInputs) -> bool:
        return inputs.num_seqs <= self.max_batch and max(map(len, inputs.block_tables)) <= self.max_blocks

    def fill(self, inputs: DecodeInputs, padded: int) -> None:
        """Copy one decode step into rows [0, padded); rows past the batch are padding
        (token 0 at position 0, slot -1, seq_len 0). Two host-to-device copies: the
        per-row values, and the block-table columns this batch uses (a sequence's
        kernel reads only its own cdiv(seq_len, block_size) entries, so stale columns
        beyond them are never read)."""
        n, pad = inputs.num_seqs, padded - inputs.num_seqs
        rows = torch.tensor([inputs.input_ids + [0] * pad, inputs.positions + [0] * pad,
                             inputs.slot_mapping + [-1] * pad, inputs.seq_lens + [0] * pad],
                            dtype=torch.long, pin_memory=self._pin)
        self.rows[:, :padded].copy_(rows, non_blocking=True)
        self.seq_lens[:padded].copy_(self.rows[3, :padded])
        width = max(map(len, inputs.block_tables))
        # One tensor from one flat list, as StepInputs.to_device does: a tensor per row
        # costs a decode step about ten times as much host time.
        flat: list[int] = []
        for blocks in inputs.block_tables:
            flat.extend(blocks)
            flat.extend([0] * (width - len(blocks)))
        table = torch.tensor(flat, dtype=self.block_tables.dtype, pin_memory=self._pin).view(n, width)
        self.block_tables[:n, :width].copy_(table, non_blocking=True)

    def metadata(self, backend: AttentionBackend, size: int, block_size: int) -> AttentionMetadata:
        """The backend's metadata over the first `size` rows (views of the buffers, so a
        graph captured with it reads each step's values)."""
        return backend.make_decode_metadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1], block_size=block_size,
        )


logger = logging.getLogger(__name__)


def uncapturable_layer(model: nn.Module) -> str | None:
    """The first module whose method cannot be captured (`quant_method.supports_cuda_graphs`
    False: it reads device values on the host), as "name (MethodClass)", or None."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "supports_cuda_graphs", True) is False:
            return f"{name} ({type(method).__name__})"
    return None


class CudaGraphRunner:
    """Runs pure-decode steps of up to the largest capture size from the buffers: by
    graph replay once `capture()` has run (CUDA), else eagerly on the same padded
    buffers (how the buffer path is tested on the CPU, where nothing is captured)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, capture_sizes: list[int], max_blocks: int,
                 block_size: int, device: torch.device) -> None:
        if not capture_sizes:
            raise ValueError("CudaGraphRunner needs at least one capture size")
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} reads host-side lengths: it cannot be captured")
        self.model = model
        self.backend = backend
        self.sizes = sorted(capture_sizes)
        self.block_size = block_size
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device)
        self._metadata = {size: self.buffers.metadata(backend, size, block_size) for size in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, inputs: DecodeInputs) -> int | None:
        """The captured size this step runs at, or None when it must run eagerly."""
        if not self.buffers.fits(inputs):
            return None
        return next(size for size in self.sizes if size >= inputs.num_seqs)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per size, largest first so that the smaller ones reuse its
        memory pool; each after one eager warm-up run (Triton compiles its kernels
        there, outside the capture). Returns the seconds it took; captures nothing (0.0)
        when a layer cannot be captured (`uncapturable_layer`): steps then run eagerly."""
        if (blocker := uncapturable_layer(self.model)) is not None:
            logger.warning("CUDA graphs off: %s reads its routing on the host; decode steps run eagerly", blocker)
            return 0.0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, positions = self.buffers.input_ids[:size], self.buffers.positions[:size]
            self.model(ids, positions, self._metadata[size])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self._metadata[size])
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def release(self) -> None:
        """Drop every graph and its memory pool (sleep mode is about to move the weights
        or the cache, whose addresses the graphs hold)."""
        self._graphs.clear()

    def run(self, inputs: DecodeInputs, padded: int) -> torch.Tensor:
        """The hidden states [num_seqs, hidden] of one decode step at the captured size
        `padded` (from `padded_size`). A replayed graph's output is its own static
        tensor, overwritten by the next replay: use it before the next step."""
        self.buffers.fill(inputs, padded)
        if padded in self._graphs:
            graph, hidden = self._graphs[padded]
            graph.replay()
        else:
            hidden = self.model(self.buffers.input_ids[:padded], self.buffers.positions[:padded],
                                self._metadata[padded])
        return hidden[:inputs.num_seqs]
