"""The ModelRunner's CPU graphs: each decode batch size recorded once, then replayed.

The first pure-decode step of each batch size runs the model under `record`
(worker/cpu_graph.py, which says what is kept and how a replay runs); later steps of
that size replay it. Inputs come from persistent buffers (`DecodeBuffers`: ids,
positions, slots, int64 lengths and block tables), refilled before each replay, and the
attention metadata is the backend's `make_decode_metadata` over them, so nothing a
replay reads is a Python value of the recorded step. Each batch size is recorded as it
first occurs (no padding: a padding row on the CPU costs real compute), up to
`max_batch`; the recording is itself that step's forward, so it costs no extra pass.

A batch size whose recording is refused (`NotCapturable`: a mixture of experts'
routing) runs eagerly for good, its reason kept in `eager_sizes`. A batch the backend
attends in cascade (a shared prefix) runs eagerly, and so does every step while a
forward hook is registered on the model or a module's forward is replaced (a user's
probe, a test's injected fault): a replay would skip it.

Owned by a CPU engine's ModelRunner on every rank (each records the same sizes at the
same steps, so the collectives line up). A graph holds the weights and the KV cache it
read; the runner drops every graph before sleep mode releases them, and when new
weights are loaded. Memory: the buffers (a few KiB per row) and each batch size's graph.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.nn.modules import module as nn_module

from worker.cpu_graph import CpuGraph, NotCapturable, record
from worker.cuda_graph import DecodeBuffers, DecodeInputs

if TYPE_CHECKING:
    from torch import nn

    from models.layers.attention import AttentionBackend

logger = logging.getLogger(__name__)


class CpuGraphRunner:
    """Runs pure-decode steps of up to `max_batch` sequences from the buffers: each batch
    size recorded on first use, replayed after (module docstring)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, max_batch: int, max_blocks: int,
                 block_size: int) -> None:
        if not hasattr(backend, "supports_cpu_graphs"):
            raise ValueError(f"attention backend {backend.name!r} cannot run a CPU graph's decode step")
        self.model = model
        self.backend = backend
        self.max_batch = max_batch
        self.block_size = block_size
        self.buffers = DecodeBuffers(max_batch, max_blocks, torch.device("cpu"), index_dtype=torch.int64)
        self._modules = list(model.modules())
        # Each module class's forward as the graphs will record it (see `_hooked`).
        self._forwards = {cls: cls.forward for cls in {type(m) for m in self._modules}}
        self._graphs: dict[int, CpuGraph] = {}
        self.eager_sizes: dict[int, str] = {}  # batch size -> why it could not be recorded

    def accepts(self, inputs: DecodeInputs) -> bool:
        """Whether this step replays (or records): a batch size that records, within the
        buffers, and not one the backend attends in cascade (which only eager does)."""
        n = inputs.num_seqs
        if n in self.eager_sizes or not self.buffers.fits(inputs) or self._hooked():
            return False
        shares = getattr(self.backend, "decode_shares_prefix", None)
        return shares is None or not shares(inputs.block_tables, inputs.seq_lens, self.block_size)

    def _hooked(self) -> bool:
        """Whether the model's Python differs from what the graphs replay: a forward hook
        registered (on a module, or globally), or a module's forward replaced since this
        runner was made (on its class or the instance). A replay runs no module's Python,
        so such a step runs eagerly, hooks and replacements and all. Asking costs about 50
        µs a step for the 183 modules of a 16-layer Llama (0.3% of its replayed step)."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        if any(cls.forward is not forward for cls, forward in self._forwards.items()):
            return True
        return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in self._modules)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def release(self) -> None:
        """Drop every graph (they hold the weights and KV cache they read)."""
        self._graphs.clear()

    def run(self, inputs: DecodeInputs) -> torch.Tensor | None:
        """The hidden states [num_seqs, hidden] of one decode step (`accepts` said yes):
        replayed, or recorded as this step's forward; None when recording was refused
        (nothing of the step is kept: the caller runs it eagerly)."""
        n = inputs.num_seqs
        self.buffers.fill(inputs, n)
        graph = self._graphs.get(n)
        if graph is not None:
            return graph.replay()
        md = self.backend.make_decode_metadata(self.buffers.slot_mapping[:n], self.buffers.block_tables[:n],
                                               self.buffers.seq_lens[:n], self.buffers.query_start_loc[:n + 1],
                                               self.block_size)
        try:
            hidden, self._graphs[n] = record(
                lambda: self.model(self.buffers.input_ids[:n], self.buffers.positions[:n], md))
        except NotCapturable as e:
            logger.info("decode batches of %d run eagerly: %s", n, e)
            self.eager_sizes[n] = str(e)
            return None
        return hidden
