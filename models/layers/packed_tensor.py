"""PackedTensor: a weight held only in a kernel's packed layout, that reads as its values.

When the CPU packs a linear layer's weight (`models/layers/unquantized.py`), the packed
layout replaces the weight: the layer's `weight` Parameter becomes a PackedTensor, a
tensor subclass with the plain weight's shape and dtype whose only data is the
`PackedWeight` (models/layers/cpu_gemm.py) that the linear method multiplies with. So
the weights are held once, `parameters()` counts them, and `state_dict()` lists them
under their own names, as vLLM's quantised layers register `qweight`.

Every other use sees the plain values: any torch op on a PackedTensor runs on the
weight unpacked for that op (exact, a transient copy of that one weight), so
`torch.equal`, `state_dict()`, saving (`torch.save` and pickling write the plain
tensor), `load_state_dict` and the tests' inspections work unchanged. An embedding
lookup (`F.embedding` on a tied LM head's table) reads only the rows it asks for, in
place (models/layers/packed_rows.py). An in-place op on it (`copy_`, `mul_`, ...) packs
the result again, so writes are never lost; writes through a view of it
(`w[:4].zero_()`) would be, as the view is of the transient copy: loaders go through
`weight_loader`, which `unquantized.py` points at a plain weight first. `detach()` and
`.data` share the packed data, as they share storage elsewhere.

Who uses it: the CPU's unquantised linear method creates and unpacks these on the
rank's loading thread; any thread may read one. Its apparent dtype is the checkpoint's
(bfloat16 for the float32 copy a CPU without a bf16 GEMM computes with: `nbytes` there
is half of `packed_nbytes`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from models.layers.cpu_gemm import PackedWeight
from models.layers.packed_rows import gather_rows

_VIEWS_OF_SELF = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class PackedTensor(torch.Tensor):
    """A [out, in] weight of dtype `dtype` stored as `packed_weight` only."""

    packed_weight: PackedWeight

    @staticmethod
    def __new__(cls, packed_weight: PackedWeight, dtype: torch.dtype) -> PackedTensor:
        shape = (packed_weight.out_features, packed_weight.in_features)
        # A tensor created under inference_mode could not be detached outside it.
        with torch.inference_mode(False):
            tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"),
                                                         requires_grad=False)
        tensor.packed_weight = packed_weight
        return tensor

    @classmethod
    def parameter(cls, packed_weight: PackedWeight, dtype: torch.dtype) -> nn.Parameter:
        """A new PackedTensor that modules register as a Parameter. `nn.Parameter(t)` would
        mark it so after a `detach()`; that first dispatch of a tensor subclass in a
        process makes torch import torch.distributed.tensor (0.5 s here), so it is marked
        directly, as `nn.Parameter` marks tensor subclasses (`_is_param`)."""
        tensor = cls(packed_weight, dtype)
        tensor._is_param = True
        assert isinstance(tensor, nn.Parameter)
        return tensor  # type: ignore[return-value]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """A lookup in a tied LM head's packed table reads only the rows asked for. It is
        caught here, before torch's dispatch: the first dispatch of a tensor subclass in a
        process makes torch import torch.distributed.tensor, 0.5 s of a first request.
        Every other function reaches `__torch_dispatch__` as aten ops."""
        kwargs = kwargs or {}
        if (func is F.embedding and len(args) == 2 and isinstance(args[1], PackedTensor)
                and kwargs.get("padding_idx") is None and kwargs.get("max_norm") is None):
            return gather_rows(args[1].packed_weight, args[0]).to(args[1].dtype)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @property
    def packed_nbytes(self) -> int:
        """The bytes the packed layout holds (padding included)."""
        return self.packed_weight.nbytes

    def plain(self) -> torch.Tensor:
        """The plain weight, exactly, as a new ordinary tensor of this dtype."""
        return self.packed_weight.unpack().to(self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # no unpacking just to print
        return (f"PackedTensor({self.packed_weight.kernel}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"packed as {self.packed_weight.dtype})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.plain().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.embedding.default and isinstance(args[0], PackedTensor):
            return gather_rows(args[0].packed_weight, args[1]).to(args[0].dtype)  # torch.embedding
        if func in _VIEWS_OF_SELF:
            source = args[0]
            return PackedTensor(source.packed_weight, source.dtype)
        plains: dict[int, torch.Tensor] = {}
        written = _written_packed_args(func, args, kwargs)
        # copy_ replaces every value of its destination: no need to unpack those first.
        overwritten = func is torch.ops.aten.copy_.default and args[1] is not args[0]

        def unpacked(value: Any) -> Any:
            if not isinstance(value, PackedTensor):
                return value
            if id(value) not in plains:
                plains[id(value)] = (torch.empty(value.shape, dtype=value.dtype) if overwritten and value is args[0]
                                     else value.plain())
            return plains[id(value)]

        result = func(*tree_map(unpacked, args), **tree_map(unpacked, kwargs))
        for tensor in written:
            tensor.packed_weight.repack(plains[id(tensor)])
            if result is plains[id(tensor)]:
                result = tensor  # an in-place op returns the tensor it changed
        return result


def _written_packed_args(func: Any, args: tuple, kwargs: dict) -> list[PackedTensor]:
    """The PackedTensor arguments `func`'s schema says it writes (self of `mul_`, `out=`)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, PackedTensor):
            written.append(value)
    return written
