"""A GGUF file's header read in one pass: its metadata and tensor infos over a mapping.

Why not gguf-py's `GGUFReader`: it makes a numpy view (two for a string) of every value
it parses, every element of an array included, and a start-up parses the file three
times (the config and tokenizer in the engine process, the weights on every rank). A
32000-token vocabulary's header took 270-450 ms a parse with it, a Llama 3-sized one
(117207 tokens, 280147 merges) 9.4 s (2026-12-07, the Zen 4 VM). This reads the same
format with `struct`: scalars as Python values, numeric arrays as numpy views of the
mapping, string arrays as sequences decoded on access (the walk over their lengths is
the parse's main cost, about 0.15 µs a string: 7-14 ms and 57 ms for those two). gguf-py still supplies the formats (`GGMLQuantizationType`,
`GGML_QUANT_SIZES`), its dequantisers and the writer the tests use, and the tensors are
its `ReaderTensor`s with the same views of the mapping, so its dequantisers and our
loaders read them as before.

Format (ggml's docs/gguf.md): "GGUF", version (2 or 3), tensor and key/value counts
(uint64), the key/values (key string, uint32 type, value; strings are a uint64 length
and UTF-8 bytes; arrays a uint32 element type, a uint64 count and the elements), the
tensor infos (name, uint32 dimension count, uint64 dimensions ne0 first, uint32 type,
uint64 offset), then the tensor data from the next multiple of `general.alignment`
(32 by default). Little-endian files only (what llama.cpp writes on every platform it
builds for); a big-endian one is refused.

Memory: the mapping (copy-on-write "c", or read-only "r") lives as long as the
`GGUFFile` or any view of it (a tensor's data, a numeric array); reading the header
touches only the header's pages.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> the struct and numpy dtype of one little-endian value
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct(fmt), np.dtype(dtype)) for t, (fmt, dtype) in {
        0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
        6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
    }.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class StringArray(Sequence[str]):
    """A metadata array of strings: each decoded from the mapping when read."""

    def __init__(self, buf: memoryview, starts: list[int], lengths: list[int]) -> None:
        self._buf, self._starts, self._lengths = buf, starts, lengths

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start = self._starts[index]
        return str(self._buf[start:start + self._lengths[index]], "utf-8")

    def __iter__(self) -> Iterator[str]:
        buf = self._buf
        return (str(buf[s:s + n], "utf-8") for s, n in zip(self._starts, self._lengths))


class GGUFFile:
    """The header of GGUF file `path` over a mapping of it (mode "c": copy-on-write, the
    default, whose views are writable without touching the file; "r": read-only).

    `metadata`: key -> value in file order (int, float, bool, str; a numeric array as a
    read-only numpy view, an array of strings as a `StringArray`, nested arrays as lists).
    `tensors`: gguf-py `ReaderTensor`s in file order, `data` a view of the mapping shaped
    as gguf-py shapes it (F32/F16/F64/integer types as their values, every other type as
    bytes, [..., row bytes]); `field` is None. Raises ValueError for a file that is not
    GGUF, a version other than 2 or 3, a big-endian file, a truncated header, an unknown
    value or tensor type, a bad alignment or duplicate keys or tensor names; OSError for
    a file that cannot be opened."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "c") -> None:
        self.path = path
        self.data = np.memmap(path, mode=mode).view(np.ndarray)  # a plain view: slicing skips memmap's hooks
        self._buf = memoryview(self.data)
        self.metadata: dict[str, Any] = {}
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (its first bytes are not 'GGUF')")
        version = self._unpack(_U32, 4)
        if version not in _VERSIONS:
            hint = " (a big-endian file: not supported)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}; supported: {list(_VERSIONS)}")
        tensor_count, kv_count = self._unpack(_U64, 8), self._unpack(_U64, 16)
        offs = 24
        for _ in range(kv_count):
            key, offs = self._string(offs)
            value_type = self._unpack(_U32, offs)
            value, offs = self._value(value_type, offs + 4)
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.metadata[key] = value
        infos = []
        for _ in range(tensor_count):
            name, offs = self._string(offs)
            n_dims = self._unpack(_U32, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offs + 4)
            offs += 4 + 8 * n_dims
            infos.append((name, dims, self._unpack(_U32, offs), self._unpack(_U64, offs + 4)))
            offs += 12
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r} is not a power of two")
        self.data_offset = (offs + alignment - 1) // alignment * alignment
        self.tensors = self._tensors(infos)

    def _unpack(self, fmt: struct.Struct, offs: int) -> Any:
        try:
            return fmt.unpack_from(self._buf, offs)[0]
        except struct.error:
            raise ValueError(f"the header is truncated at byte {offs}") from None

    def _string(self, offs: int) -> tuple[str, int]:
        n = self._unpack(_U64, offs)
        end = offs + 8 + n
        if end > len(self._buf):
            raise ValueError(f"the header is truncated at byte {offs} (a string of {n} bytes)")
        return str(self._buf[offs + 8:end], "utf-8"), end

    def _value(self, value_type: int, offs: int) -> tuple[Any, int]:
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type][0]
            return self._unpack(fmt, offs), offs + fmt.size
        if value_type == _STRING:
            return self._string(offs)
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {offs}")
        item_type, count = self._unpack(_U32, offs), self._unpack(_U64, offs + 4)
        offs += 12
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type][1]
            end = offs + count * dtype.itemsize
            if end > len(self._buf):
                raise ValueError(f"the header is truncated at byte {offs} (an array of {count})")
            view = self.data[offs:end].view(dtype)
            view.flags.writeable = False
            return view, end
        if item_type == _STRING:
            return self._strings(offs, count)
        items = []
        for _ in range(count):
            item, offs = self._value(item_type, offs)
            items.append(item)
        return items, offs

    def _strings(self, offs: int, count: int) -> tuple[StringArray, int]:
        buf, unpack, size = self._buf, _U64.unpack_from, len(self._buf)
        starts, lengths = [0] * count, [0] * count
        try:
            for i in range(count):
                n = unpack(buf, offs)[0]
                starts[i], lengths[i] = offs + 8, n
                offs += 8 + n
        except struct.error:
            raise ValueError(f"the header is truncated at byte {offs} (an array of {count} strings)") from None
        if offs > size:
            raise ValueError(f"the header is truncated at byte {size} (an array of {count} strings)")
        return StringArray(buf, starts, lengths), offs

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[Any]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        tensors, names = [], set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicate tensor name {name!r}")
            names.add(name)
            qtype = GGMLQuantizationType(raw_type)  # ValueError for a type gguf-py does not know
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.int64))
            n_bytes = n_elements * type_size // block_size
            start = self.data_offset + offset
            if start + n_bytes > len(self._buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file ({start + n_bytes} > "
                                 f"{len(self._buf)} bytes)")
            np_dims = tuple(reversed(dims))
            if qtype in plain:
                data = self.data[start:start + n_bytes].view(plain[qtype]).reshape(np_dims)
            else:
                data = self.data[start:start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
            tensors.append(ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                                        n_elements=n_elements, n_bytes=n_bytes, data_offset=start, data=data,
                                        field=None))
        return tensors
