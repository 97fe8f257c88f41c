"""The attention backend interface: how a platform runs paged attention.

A backend is chosen per platform (`models.layers.attention.selector`) and created once
per rank by the ModelRunner. Each step the runner hands it the step's common metadata
(`AttentionMetadata`, built from the scheduler output); the backend may derive its own
metadata from it (`build_metadata`), which every layer of the step then shares. Each
`Attention` layer gets its own `AttentionImpl` from the backend when the KV cache is
attached, and calls it in its forward. The backend also hears which requests finished
(`requests_finished`), so that state it keeps across steps never outlives a request.

Every rank builds the same metadata from the same scheduler output and runs the same
forward; nothing here communicates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Protocol

import torch


class AttentionLayer(Protocol):
    """What a backend reads of the `Attention` layer it serves (vLLM's name for it):
    the layer (models/layers/attention/layer.py) imports this module, not the reverse."""

    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's kv heads
    head_size: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    dtype: torch.dtype


@dataclass
class AttentionMetadata:
    """One step's batch, as the runner lays it out, shared by every layer.

    Tokens of all scheduled sequences are flattened into one batch; sequence i (request
    `req_ids[i]`) owns tokens [query_start_loc[i], query_start_loc[i+1]) and, after this
    step, has seq_lens[i] tokens of context in the blocks listed in block_tables[i]
    (padded with any value past its blocks).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: list[int]
    query_start_loc: list[int]  # num_seqs + 1 entries
    block_size: int
    req_ids: tuple[str, ...] = ()
    # seq_lens and query_start_loc on the device (int64), where the runner sent them
    # with the rest of the step; None where it did not.
    seq_lens_tensor: torch.Tensor | None = None
    query_start_loc_tensor: torch.Tensor | None = None

    # Derived once per step, on first use by the first layer, then shared by all layers.
    @cached_property
    def slot_blocks_and_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slot_mapping // self.block_size, self.slot_mapping % self.block_size

    @cached_property
    def decode_seqs(self) -> list[int]:
        """Sequences whose chunk is a single query token."""
        qsl = self.query_start_loc
        return [i for i in range(len(self.seq_lens)) if qsl[i + 1] - qsl[i] == 1]


def gather_paged_kv(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, ctx_len: int) -> torch.Tensor:
    """The K and V of `num_seqs` sequences, copied out of the paged `cache` into one
    contiguous [2, num_kv_heads, num_seqs, ctx_len, head_size] tensor.

    `cache` is [num_blocks, 2, block_size, num_kv_heads, head_size]; `blocks` lists
    each sequence's ctx_len // block_size block ids in turn, flattened. Viewed as
    [2, Hkv, N, bs, D], one index_select writes [2, Hkv, G * nb, bs, D], which is
    [2, Hkv, G, nb * bs, D] with no further copy."""
    num_kv_heads, head_size = cache.shape[3], cache.shape[4]
    gathered = cache.permute(1, 3, 0, 2, 4).index_select(2, blocks)
    return gathered.view(2, num_kv_heads, num_seqs, ctx_len, head_size)


class AttentionImpl(ABC):
    """One layer's paged attention; holds whatever per-layer state the backend keeps."""

    def __init__(self, layer: AttentionLayer) -> None:
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window = layer.sliding_window

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: Any
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] for this step's tokens: write k and v into
        `kv_cache` at `md.slot_mapping`, then attend every query to its sequence's
        cached context (causally within its chunk). Returns [T, H, D]. `md` is the
        step's metadata as this backend built it (`build_metadata`, or
        `make_decode_metadata` for a CUDA graph).

        Every token's K/V must be in the cache before any sequence attends: with prefix
        caching, a sequence's context may include blocks that another sequence of the
        same step is filling (the scheduler shares them as soon as they are scheduled)."""


class AttentionBackend(ABC):
    """One per rank (ModelRunner). Subclasses name themselves and their impl."""

    name: str = ""
    # Whether a decode step can be captured in a CUDA graph: the impls read every length
    # from device tensors and `make_decode_metadata` builds metadata over persistent
    # buffers (worker/cuda_graph.py).
    supports_cuda_graphs: bool = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The layout of one layer's cache tensor (K and V together)."""
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @abstractmethod
    def make_impl(self, layer: AttentionLayer) -> AttentionImpl:
        """The impl for one layer (called once per layer when its cache is attached)."""

    def build_metadata(self, common: AttentionMetadata) -> Any:
        """This backend's metadata for a step (the common one, unless it needs more),
        which every layer's impl receives."""
        return common

    def workspace_bytes(self, layer: AttentionLayer, max_model_len: int) -> int:
        """The most memory one layer's attention call allocates beyond its output, at any
        step of up to max_model_len tokens of context: the profile run holds this much
        during its forward, so the KV cache sized after it leaves room for it."""
        return 0

    def make_decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, block_size: int) -> Any:
        """Metadata for a decode batch (one query token per sequence) over the device
        tensors given, which the caller refills before every replay: slot_mapping int64
        [n] (-1: write nothing), block_tables int32 [n, max_blocks], seq_lens int32 [n]
        (0: a padding row), query_start_loc int32 [n + 1]. Only for backends that
        support CUDA graphs."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot build metadata for a CUDA graph")

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget every request's state and free what holds it: the KV cache was
        discarded (sleep) and no request from before will continue."""

    def requests_finished(self, req_ids: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """Requests that finished, were aborted or were preempted since the last step:
        state kept for them must go before a request with the same id runs again."""
