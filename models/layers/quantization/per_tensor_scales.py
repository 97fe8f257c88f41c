"""Per-tensor weight scales in fused layers: one value per checkpoint module.

A checkpoint quantised "per tensor" gives q_proj, k_proj and v_proj (or gate_proj and
up_proj) one scale each, but our qkv_proj (gate_up_proj) holds them as one weight. The
method registers a float32 parameter with one slot per fused sub-projection, loaded by
`scalar_per_shard_loader` (AutoWeightsLoader passes the shard id: 'q'/'k'/'v' or 0/1;
an unfused layer gets none), and after loading widens it with `per_channel_from_shards`
to a per-output-row [out, 1] scale, so that one per-channel kernel serves both (4 bytes
per output row). Used by the fp8 checkpoint method and the W8A8 int8 scheme, on every
rank, for this rank's shard (each rank's fused sub-projections are its slices of them).
A mixture-of-experts layer's per-tensor scales are widened as they load instead
(`per_tensor_as_rows`, an expert tensor's `expert_transform`): each projection's value
over its rows, before the loader takes this rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.errors import WeightLoadError

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def scalar_per_shard_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
    """One checkpoint module's scalar scale into its fused sub-projection's slot.
    Raises WeightLoadError for a tensor that is not one value."""
    if loaded.numel() != 1:
        raise WeightLoadError(f"a per-tensor scale must be one value, the checkpoint has shape {tuple(loaded.shape)}")
    index = 0 if shard_id is None else _SHARD_INDEX.get(shard_id, shard_id)
    param.data[index] = loaded.reshape(())


def per_channel_from_shards(scales: torch.Tensor, output_partition_sizes: list[int]) -> torch.Tensor:
    """float32 [sum(sizes), 1]: each sub-projection's rows get its scale."""
    sizes = torch.tensor(output_partition_sizes, device=scales.device)
    return scales.to(torch.float32).repeat_interleave(sizes).reshape(-1, 1).contiguous()


def per_tensor_as_rows(rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A per-tensor scale (one value, [] or [1]) as the [rows, 1] per-channel scale it
    equals (an expanded view). ValueError for a tensor that is not one value."""
    def expand(scale: torch.Tensor) -> torch.Tensor:
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor scale must be one value, the checkpoint has shape {tuple(scale.shape)}")
        return scale.reshape(1, 1).expand(rows, 1)
    return expand
