"""The CPU's large weights placed in transparent huge pages before they are loaded.

A decode step on the CPU streams every weight from memory, and on 4 KB pages it reads
them slower than it could: the Zen 4 VM's float16 one-row product read 4 KB-page memory
that torch allocated at 27-31 GB/s, the same bytes in 2 MB pages (or in the page cache's
mapping of the checkpoint, which the GGUF and safetensors loaders alias) at 32-36 GB/s
in the same minutes (2026-12-07, 24 weights of 5632x2048 alternating, 7-13% apart run by
run). torch advises huge pages only when the process starts with
`THP_MEM_ALLOC_ENABLE=1`, which an engine built inside a user's process cannot set, and
then for every allocation.

So `place_in_huge_pages` gives each large parameter and buffer of a freshly built model
(before any weight is loaded: no copy) its own slice of one anonymous mapping advised
`MADV_HUGEPAGE`; the loader's copies fault in 2 MB pages where the kernel has them (4 KB
ones otherwise: nothing fails). Each slice is its own torch storage (`torch.frombuffer`
over its bytes), so storage-based checks (safetensors' shared-memory check, sleep mode's
storage sets, memory accounting) see one storage per tensor as before. A loader may
still replace a parameter's data (a view of the checkpoint's mapping, a repacked
layout); `HugePageArena.release_unused` then hands back the pages of the slices nobody
uses any more, so a replaced weight costs no memory. The mapping lives as long as any
slice: dropping the model frees it.

Who calls it: `BaseModelLoader.load_model`, on every rank whose load device is the CPU,
between building the model and loading its weights. Linux only (elsewhere, or where
THP is `never`, it places nothing).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller tensors (norms, biases) gain little and would share pages
ALIGN = 64  # each slice starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str | None:
    """The kernel's THP mode ("always" or "madvise"), or None where there are none
    ("never", not Linux, or the setting unreadable)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    mode = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return mode if mode in ("always", "madvise") else None


@dataclass
class _Slice:
    holders: list[tuple[nn.Module, str]]  # the (module, attribute) pairs given the slice
    start: int  # its bytes' offset in the mapping
    nbytes: int


class HugePageArena:
    """One anonymous mapping advised MADV_HUGEPAGE and where its slices went. Built by
    `place_in_huge_pages`; refers to modules, never to the tensors (a replaced parameter
    is freed as usual), and holds the mapping object only: the pages belong to the
    slices' storages, which keep the mapping alive."""

    def __init__(self, mapping: mmap.mmap, base: int, slices: list[_Slice]) -> None:
        self.mapping = mapping
        self.base = base  # the mapping's address
        self.slices = slices

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    def slice_in_use(self, piece: _Slice) -> bool:
        """Whether a module still reads `piece` (the parameter or buffer its holders now
        have starts there: neither replaced nor given other data)."""
        for module, name in piece.holders:
            tensor = module._parameters.get(name, module._buffers.get(name))
            if tensor is None or type(tensor.data) is not torch.Tensor or tensor.device.type != "cpu":
                continue  # gone, or a subclass such as a packed layout, which holds its own memory
            if tensor.data_ptr() == self.base + piece.start:
                return True
        return False

    def release_unused(self) -> int:
        """Hand back the pages lying wholly inside slices no module reads any more (the
        weight replaced by a view of a checkpoint's mapping, a repacked layout); a huge
        page shared with a slice in use is split and only the unused part released.
        Called after each module's post-processing, and cheap when nothing changed.
        Returns the bytes released."""
        released, kept = 0, []
        for piece in self.slices:
            if self.slice_in_use(piece):
                kept.append(piece)
                continue
            start = -(-piece.start // mmap.PAGESIZE) * mmap.PAGESIZE
            stop = (piece.start + piece.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if stop > start:
                self.mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)
                released += stop - start
        self.slices = kept
        return released


def _large_tensors(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]]:
    """Each distinct large, plain, contiguous CPU parameter and buffer once (a tied weight
    once, with every module holding it), in the model's order."""
    found: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None:
                continue
            data = tensor.data
            if (type(data) is torch.Tensor and data.device.type == "cpu" and data.layout == torch.strided
                    and data.is_contiguous() and data.numel() * data.element_size() >= MIN_BYTES):
                found.setdefault(id(tensor), (tensor, []))[1].append((module, name))
    return found


def place_in_huge_pages(model: nn.Module) -> HugePageArena | None:
    """Give every large CPU parameter and buffer of `model` a slice of one mapping
    advised MADV_HUGEPAGE (their contents are not kept: call it before loading). Returns
    the arena, or None where nothing was placed (no such tensor, no transparent huge
    pages). Raises nothing the kernel's refusal could cause: an unadvised mapping still
    serves, in 4 KB pages."""
    found = list(_large_tensors(model).values())
    if not found or transparent_huge_pages() is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    tensors = [tensor for tensor, _ in found]
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE  # the first slice starts on a huge page
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    slices = []
    for (tensor, holders), nbytes in zip(found, sizes):
        data = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
        tensor.data = data.view(tensor.shape)
        slices.append(_Slice(holders, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return HugePageArena(mapping, base, slices)
