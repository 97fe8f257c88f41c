"""The WNA16 layout: the one form GPTQ, AWQ and compressed-tensors W4A16/W8A16 weights take
after loading.

Every format unpacks, in its `process_weights_after_loading`, into (this rank's shard):

    wna16_qweight      uint8 [N, Kp * bits / 8]  codes per output row in blocks of 32
                       inputs; int4: byte j of block b holds input 32b+j (low nibble) and
                       32b+16+j (high nibble); int8: one code a byte
    wna16_scales       [N, G]                     w = (code - zero) * scale; float16 or
                                                  bfloat16 where that holds every scale
                                                  exactly (the checkpoint's), else float32
    wna16_zeros        uint8 [N, G]               the unsigned zero point (the format's
                                                  offsets, GPTQ v1's +1, already applied)
    wna16_block_group  int32 [Kp / 32]            the group of each block
    wna16_input_perm   int64 [Kp] (only if needed) activation column of each position;
                                                  K (one past the end) reads a zero

all registered buffers, so `state_dict()`, sleep mode and memory accounting see them,
and the checkpoint's tensors are deleted (never a second copy). Inputs are ordered by
group and each group padded to whole blocks: nothing to do for contiguous groups that
are multiples of 32 (the usual 32/64/128 and per-channel); GPTQ's `desc_act` (`g_idx`)
permutes the weight's inputs once here and the activations' columns per call (as
exllama does), and a row-parallel shard of an act-order checkpoint, whose inputs fall
in any of the global groups, pads each group it holds to whole blocks (at most 31 zero
codes a group). `Kp` is therefore K, except on such a shard: there, with groups of 128
split over 2 ranks, about 1.25 K; with groups of 32, nearly 2 K.

A FusedMoE's int4/int8 experts (quantization/wna16_moe.py) hold the same tensors stacked
over the experts, [E, N, ...] (`build_wna16_tensors`, `WNA16Tensors`), one block_group and
input_perm serving them all; `WNA16Tensors.layout(e)` is expert e's WNA16Layout.

The kernels that read it (kernels/wna16_cpu.py, kernels/wna16_triton.py) import this
module, and the forward that picks one (kernels/wna16_apply.py's `apply_wna16`) imports
them all: this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32
_BUFFERS = ("wna16_qweight", "wna16_scales", "wna16_zeros", "wna16_block_group", "wna16_input_perm")
_ROWS_PER_CHUNK = 512  # bounds the int32 scratch of the codes while repacking a big weight


@dataclass(frozen=True)
class WNA16Layout:
    bits: int
    in_features: int  # K: this rank's inputs, as the activations hold them
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    block_group: torch.Tensor
    input_perm: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def padded_in_features(self) -> int:
        return self.block_group.numel() * BLOCK


@dataclass(frozen=True)
class WNA16Tensors:
    """E weights of one shape in the layout, stacked: qweight [E, N, Kp * bits / 8],
    scales and zeros [E, N, G]; one block_group and input_perm serve all of them."""

    bits: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    block_group: torch.Tensor
    input_perm: torch.Tensor | None

    def layout(self, index: int) -> WNA16Layout:
        """Weight `index`'s layout: views of the stacked tensors, nothing copied."""
        return WNA16Layout(self.bits, self.in_features, self.qweight[index], self.scales[index], self.zeros[index],
                           self.block_group, self.input_perm)


def _input_order(input_groups: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(input_perm or None, block_group, local group ids) for inputs whose (global) group
    ids are `input_groups` [K]: inputs sorted by group, each group padded to whole
    blocks with index K. The local ids number the groups present, in order."""
    k = input_groups.numel()
    present, local = torch.unique(input_groups.long(), sorted=True, return_inverse=True)
    counts = torch.bincount(local, minlength=present.numel())
    order = torch.argsort(local, stable=True)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    block_group = torch.repeat_interleave(torch.arange(present.numel(), dtype=torch.int32), padded // BLOCK)
    if bool((padded == counts).all()):
        perm = order
    else:
        pieces, start = [], 0
        for count, pad in zip(counts.tolist(), (padded - counts).tolist()):
            pieces += [order[start : start + count], torch.full((pad,), k, dtype=torch.int64)]
            start += count
        perm = torch.cat(pieces)
    if perm.numel() == k and bool((perm == torch.arange(k)).all()):
        return None, block_group, present
    return perm, block_group, present


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """`scales` in the narrowest dtype that holds each of them exactly: float16 (GPTQ's and
    AWQ's), bfloat16 (compressed-tensors' usual), else float32."""
    scales = scales.to(torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        narrow = scales.to(dtype)
        if torch.equal(narrow.to(torch.float32), scales):
            return narrow.contiguous()
    return scales.contiguous()


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [rows, Kp] (0 .. 2^bits - 1) -> uint8 [rows, Kp * bits / 8] in the block layout."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    rows, kp = codes.shape
    halves = codes.view(rows, kp // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, kp // 2).contiguous()


def build_wna16_tensors(bits: int, codes_rows: Callable[[int, int, int], torch.Tensor], scales: torch.Tensor,
                        zeros: torch.Tensor, input_groups: torch.Tensor) -> WNA16Tensors:
    """The layout's tensors for E weights of one shape stacked ([E, N, ...]: a FusedMoE's
    experts; E = 1 for a linear layer). `codes_rows(e, a, b)` gives output rows [a, b)
    of weight e's codes, [b - a, K] integers in [0, 2^bits), inputs in the activations'
    order; `scales`/`zeros` are [E, N, G] (float; integers in [0, 2^bits] or 255 for
    8-bit) for the groups the ids in `input_groups` [K] name (global ids: only the groups
    present are kept; one input order serves every weight). The scales of all E take one
    dtype (`compact_scales` over the stack). Built on `scales`' device. ValueError for
    other bit widths, zero points outside [0, 255] or codes of the wrong shape. Peak
    extra memory: the new tensors plus one chunk of codes."""
    if bits not in (4, 8):
        raise ValueError(f"the WNA16 layout holds 4- or 8-bit codes, not {bits}")
    k = input_groups.numel()
    device = scales.device  # the layer's: the layout is built and kept there
    perm, block_group, present = _input_order(input_groups.cpu())
    perm = None if perm is None else perm.to(device)
    block_group, present = block_group.to(device), present.to(device)
    num, n = scales.shape[0], scales.shape[1]
    scales = compact_scales(scales.index_select(2, present))
    zeros = zeros.to(device).index_select(2, present)
    if int(zeros.min()) < 0 or int(zeros.max()) > 255:
        raise ValueError(f"zero points outside [0, 255] for {bits}-bit codes")
    zeros = zeros.to(torch.uint8).contiguous()
    kp = block_group.numel() * BLOCK
    qweight = torch.empty(num, n, kp * bits // 8, dtype=torch.uint8, device=device)
    for e in range(num):
        for start in range(0, n, _ROWS_PER_CHUNK):
            stop = min(n, start + _ROWS_PER_CHUNK)
            codes = codes_rows(e, start, stop)
            if codes.shape != (stop - start, k):
                raise ValueError(f"codes of shape {tuple(codes.shape)} for rows [{start}, {stop}) of a [{n}, {k}] "
                                 "weight")
            if perm is not None:
                codes = F.pad(codes, (0, 1)).index_select(1, perm)
            qweight[e, start:stop] = _pack_codes(codes, bits)
    return WNA16Tensors(bits, k, qweight, scales, zeros, block_group, perm)


def set_wna16_layout(layer: nn.Module, bits: int, codes_rows: Callable[[int, int], torch.Tensor],
                     scales: torch.Tensor, zeros: torch.Tensor, input_groups: torch.Tensor,
                     checkpoint_params: Iterable[str]) -> None:
    """Replace `layer`'s checkpoint parameters (`checkpoint_params`, deleted) by the WNA16
    layout's buffers: `build_wna16_tensors` for one weight, `codes_rows(a, b)` its rows
    and `scales`/`zeros` [N, G]."""
    built = build_wna16_tensors(bits, lambda _, a, b: codes_rows(a, b), scales.unsqueeze(0), zeros.unsqueeze(0),
                                input_groups)
    for name in checkpoint_params:
        if hasattr(layer, name):
            delattr(layer, name)
    layer.wna16_bits, layer.wna16_in_features = bits, built.in_features
    for name, value in zip(_BUFFERS, (built.qweight[0], built.scales[0], built.zeros[0], built.block_group,
                                      built.input_perm)):
        layer.register_buffer(name, value)


def get_wna16_layout(layer: nn.Module) -> WNA16Layout | None:
    """The layer's layout, or None before `set_wna16_layout`. The view is kept beside the
    buffers (the same tensors, so nothing is held twice) and rebuilt whenever a buffer is
    no longer the tensor it holds (sleep mode or a reload replacing one): a decode step
    asks once per layer, and reading seven buffers through nn.Module each time cost
    several microseconds."""
    buffers = layer._buffers
    cached: WNA16Layout | None = layer.__dict__.get("_wna16_layout")
    if cached is not None and all(buffers.get(name) is tensor for name, tensor in zip(_BUFFERS, (
            cached.qweight, cached.scales, cached.zeros, cached.block_group, cached.input_perm))):
        return cached
    qweight = buffers.get("wna16_qweight")
    if qweight is None:
        return None
    layout = WNA16Layout(layer.wna16_bits, layer.wna16_in_features, qweight, buffers["wna16_scales"],
                         buffers["wna16_zeros"], buffers["wna16_block_group"], buffers["wna16_input_perm"])
    layer.__dict__["_wna16_layout"] = layout
    return layout
