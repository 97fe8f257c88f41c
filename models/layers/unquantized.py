"""The unquantised linear methods, one per platform.

`UnquantizedLinearMethod` is plain `F.linear` (CUDA, and the CPU with packing off).
`CPUUnquantizedLinearMethod` packs the weight after loading (`models/layers/cpu_gemm.py`):
a float32 weight by oneDNN or our AVX2 kernel (by CPU), a 16-bit one our row-major kernels
cannot read by oneDNN in its own dtype where the CPU has a GEMM for it: the CPU
counterpart of what vLLM's CPU backend does with oneDNN in
`process_weights_after_loading`. Three kinds of 16-bit weight are not packed at all, so
loading them is reading them: a bfloat16 weight on a CPU with AVX-512 BF16
(`models/layers/cpu_bf16_gemm.py` multiplies it in the checkpoint's layout), a
bfloat16/float16 weight on a CPU whose oneDNN has no GEMM for its dtype (AVX2 CPUs, and
AVX-512 ones without BF16/FP16: `cpu_sgemm.linear_half` widens it to float32 inside the
kernel), and a float16 weight where oneDNN has an FP16 GEMM (AVX512-FP16 CPUs): the same
widening kernel up to `cpu_gemm.NATIVE_HALF_MAX_ROWS` rows, where it leads oneDNN's, and
F.linear above. Both methods serve the
parallel linear layers and the LM head; `LayerBuildConfig` picks one per layer.

Memory: the packed layout replaces the weight. The layer's `weight` becomes a
`PackedTensor` (models/layers/packed_tensor.py) holding only the packed data, which
`parameters()` counts and `state_dict()` reads as the plain values; no plain copy stays.
What needs the plain weight gets it from the packed form, one weight at a time: a
`weight_loader` call (`update_weights`, a reload into a live model) unpacks its layer
first, and the next `process_weights_after_loading` packs it again. A weight several
modules share (a tied LM head's, which is the embedding's table) is packed in place in
every one of them, its lookups reading rows from the packed layout
(models/layers/packed_rows.py); where that layout's rows cannot be read, it stays plain
and unpacked (a packed copy beside it would add the vocabulary's table: 27% of a
Qwen2.5-0.5B). `TP_CPU_PACKED_GEMM=mkl` keeps MKL's packed copy beside the plain weight,
which its large batches need (a non-persistent buffer, `weight_mkl_packed`): twice the
linear weights, by choice. A bf16 weight on a CPU without a bf16 GEMM where the AVX2
kernel does not read it (`TP_CPU_BF16_GEMM=0`, `TP_CPU_PACKED_GEMM=onednn|mkl`, no compiler) is
replaced by a packed float32 copy, twice the checkpoint's bytes, which computing in
float32 there needs. Packing runs in the worker's "weights" memory pool, so KV-cache
sizing sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import cpu_bf16_gemm, cpu_sgemm
from models.layers.cpu_gemm import (
    PackedWeight,
    can_pack,
    half_linear_rows,
    lacks_native_gemm,
    layout_verified,
    native_half_gemm,
    packing_available,
    reusing_upcast_buffer,
    upcast_float32,
    upcast_gemm,
    widens_half_weights,
)
from models.layers.file_pages import release_file_pages
from models.layers.packed_rows import rows_readable
from models.layers.packed_tensor import PackedTensor
from models.layers.quantization.base import LinearMethodBase

logger = logging.getLogger(__name__)

MKL_BUFFER = "weight_mkl_packed"

# While a whole model is packed (`tracking_shared_weights`): for each parameter that more
# than one module holds, by id, every (module, attribute name) holding it.
Holders = list[tuple[nn.Module, str]]
_SHARED: contextvars.ContextVar[dict[int, Holders]] = contextvars.ContextVar("shared_weights", default={})


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain F.linear on the full-precision weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class CPUUnquantizedLinearMethod(UnquantizedLinearMethod):
    """The weight in a packed layout once loaded; F.linear where it is not packed.

    `packed` is the PackedWeight the layer's weight is held in (MKL: held beside it), or
    None: before `process_weights_after_loading`, for a weight multiplied where it was
    loaded (`row_major`), for a weight other modules share whose packed rows cannot be
    read in place, and where packing fails (no packing library, a build that cannot pack
    the dtype, or a packed product that does not match F.linear: the layout being
    independent of the row count is library behaviour, not an API promise, so it is
    checked once per shape class, `PackedWeight.verify`).

    A bfloat16/float16 weight stays as loaded where a row-major kernel reads it
    (`_row_major_kernel`). Otherwise it is packed by oneDNN in its own dtype where the CPU
    has a GEMM for it (`native_half_gemm`: AVX-512 BF16/FP16, AMX), whatever `kernel`
    packs float32; on a CPU with none it is `upcast`: a packed float32 copy (oneDNN's, or
    the avx2 kernel's: `upcast_gemm`) replaces it and computes every product in float32
    (the input cast up, the output back), which is what oneDNN would do anyway,
    converting the weight on each call.
    """

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel  # PACKED_GEMMS: the float32 one
        self.packed: PackedWeight | None = None
        self.upcast = False
        self.row_major: str | None = None  # `_row_major_kernel`'s choice
        # Every (module, name) that holds the weight: the layer's own, and for a shared
        # weight (a tied LM head's) the others', which the packed and unpacked forms replace too.
        self.holders: Holders = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack `layer.weight` in place of itself, in every module that holds it. Idempotent:
        a weight still packed is left as it is, a plain one (new, unpacked by a loader, or
        MKL's companion after a change) is packed, so code that changes weights calls it
        again (`prepack_cpu_weights`). Called on every rank, on the loading thread."""
        weight = layer.weight
        if isinstance(weight, PackedTensor):
            return
        self.packed, self.upcast = None, False
        _drop_mkl_copy(layer)
        self.row_major = self._row_major_kernel(weight)
        if self.row_major:
            return
        choice = self._choose_kernel(weight)
        if choice is None:
            return
        kernel, upcast = choice
        dtype = torch.float32 if upcast else weight.dtype
        shared = _SHARED.get().get(id(weight))
        if shared is not None and not rows_readable(kernel, dtype, tuple(weight.shape)):
            return  # the embedding's lookups need rows: a shared table stays plain
        packed = self._pack(weight, kernel, upcast)
        if packed is None:
            return
        self.packed, self.upcast = packed, upcast
        if not packed.holds_whole_weight:
            layer.register_buffer(MKL_BUFFER, packed.packed, persistent=False)
            return
        self.holders = shared or [(layer, "weight")]
        self._install(_packed_parameter(layer, weight, packed))
        release_file_pages(weight)  # a view of the checkpoint's mapping: packing read its pages in

    def _row_major_kernel(self, weight: torch.Tensor) -> str | None:
        """The kernel that multiplies `weight` where it was loaded, unpacked: "bf16" (AVX-512
        BF16, `cpu_bf16_gemm`), "avx2" (a 16-bit weight on a CPU whose oneDNN has no GEMM for
        it, or a float16 one, widened inside our AVX2 kernel: `cpu_gemm.widens_half_weights`;
        F.linear past `half_linear_rows` where oneDNN has a GEMM for it), or None: pack it.
        `TP_CPU_BF16_GEMM=0` turns both off (read per weight, at load)."""
        if cpu_bf16_gemm.serves(weight):
            return "bf16"
        if widens_half_weights(weight):
            return "avx2"
        return None

    def _choose_kernel(self, weight: torch.Tensor) -> tuple[str, bool] | None:
        """(the kernel that packs `weight` on this CPU, whether as a float32 copy), or None."""
        if lacks_native_gemm(weight):
            return upcast_gemm(self.kernel), True
        if native_half_gemm(weight):
            return "onednn", False
        if packing_available(self.kernel) and can_pack(weight):
            return self.kernel, False
        return None

    def _pack(self, weight: torch.Tensor, kernel: str, upcast: bool) -> PackedWeight | None:
        """`weight` packed by `kernel` (a float32 copy if `upcast`), or None (logged)."""
        dtype = torch.float32 if upcast else weight.dtype
        try:
            if not layout_verified(kernel, dtype, tuple(weight.shape)):
                logger.warning("%s packed GEMM does not match F.linear for %s %s weights; using the plain path",
                               kernel, tuple(weight.shape), dtype)
                return None
            return PackedWeight(upcast_float32(weight) if upcast else weight, kernel)
        except RuntimeError as e:  # a build of the library without this dtype's reorder
            logger.warning("%s cannot pack a %s %s weight (%s); using the plain path",
                           kernel, tuple(weight.shape), dtype, e)
            return None

    def _install(self, param: nn.Parameter) -> None:
        for module, name in self.holders:
            setattr(module, name, param)

    def unpack_weight(self, layer: nn.Module, plain: nn.Parameter | None = None) -> bool:
        """Give `layer` (and every module sharing its weight) its plain weight back, in
        place of the packed one, which is dropped: the exact values (`plain_parameter`),
        or `plain` if given (a loader filled it). The layer holds one weight throughout,
        plus this one while it converts. MKL's companion copy is dropped. Returns whether
        anything was packed."""
        weight = layer.weight
        was_packed = self.packed is not None or isinstance(weight, PackedTensor)
        self.packed, self.upcast = None, False
        _drop_mkl_copy(layer)
        if isinstance(weight, PackedTensor):
            self._install(plain_parameter(weight) if plain is None else plain)
            weight.packed_weight.release()  # even if a loader's table still holds `weight`
        return was_packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if self.row_major == "bf16":
            return cpu_bf16_gemm.linear(x, weight, bias)
        if self.row_major == "avx2":
            limit = half_linear_rows(weight.dtype)
            if limit is not None and x.numel() > limit * x.shape[-1]:  # more rows: oneDNN's GEMM
                return F.linear(x, weight, bias)
            return cpu_sgemm.linear_half(x, weight, bias)
        if isinstance(weight, PackedTensor):  # (no tensor property of it is read: each is a torch function)
            packed = weight.packed_weight
            if self.upcast:  # the float32 copy of a bf16/fp16 weight
                out = packed.linear_any_rows(x.float(), None if bias is None else bias.float())
                return out.to(x.dtype)
            return packed.linear(x, None, bias)
        if self.packed is not None:  # MKL's, beside the plain weight
            return self.packed.linear(x, weight, bias)
        return F.linear(x, weight, bias)


class _UnpackingLoader:
    """The `weight_loader` of a packed weight: loads into a plain weight with the layer's
    own loader, which then replaces the packed one (the next
    `process_weights_after_loading` packs it again). A call without a shard id fills the
    whole parameter (the contract of every `weight_loader`: it narrows the checkpoint
    tensor to this rank's slice, which is all of the parameter), so it loads into a new
    uninitialised one, swapped in only once the loader succeeded; a shard of a fused
    weight (q of qkv) needs the others' values, so the layer is unpacked exactly first."""

    def __init__(self, layer: nn.Module, loader: Callable[..., None]) -> None:
        self.layer, self.loader = layer, loader

    def __call__(self, param: torch.Tensor, loaded_weight: torch.Tensor, *shard: Any) -> None:
        weight, method = self.layer.weight, self.layer.quant_method
        if isinstance(weight, PackedTensor) and not shard:
            fresh = plain_parameter(weight, values=False)
            self.loader(fresh, loaded_weight)
            method.unpack_weight(self.layer, fresh)
            return
        if isinstance(weight, PackedTensor):
            method.unpack_weight(self.layer)
        self.loader(self.layer.weight, loaded_weight, *shard)


def plain_parameter(weight: PackedTensor, values: bool = True) -> nn.Parameter:
    """A plain Parameter for `weight` with its attributes (its own weight_loader back):
    holding its exact values, or uninitialised (`values=False`, for a loader to fill)."""
    with torch.inference_mode(False), torch.no_grad():
        data = weight.plain() if values else torch.empty(weight.shape, dtype=weight.dtype)
        plain = nn.Parameter(data, requires_grad=False)
    for key, value in _parameter_attrs(weight).items():
        setattr(plain, key, value.loader if isinstance(value, _UnpackingLoader) else value)
    return plain


def _drop_mkl_copy(layer: nn.Module) -> None:
    if hasattr(layer, MKL_BUFFER):
        delattr(layer, MKL_BUFFER)


def _parameter_attrs(param: torch.Tensor) -> dict[str, Any]:
    """The attributes set on a parameter (`set_weight_attrs`), without torch's and ours."""
    return {k: v for k, v in vars(param).items() if k not in ("_is_param", "packed_weight")}


def _packed_parameter(layer: nn.Module, weight: torch.Tensor, packed: PackedWeight) -> nn.Parameter:
    """The Parameter holding `packed` in place of `weight`, with `weight`'s attributes and
    a weight_loader that unpacks first."""
    param = PackedTensor.parameter(packed, weight.dtype)
    for key, value in _parameter_attrs(weight).items():
        setattr(param, key, _UnpackingLoader(layer, value) if key == "weight_loader" else value)
    return param


@contextlib.contextmanager
def tracking_shared_weights(model: nn.Module) -> Iterator[None]:
    """While `model` is packed inside this block, a parameter that more than one module
    holds (a tied LM head's weight is the embedding's table) is packed in every holder at
    once, or, where the packed layout's rows cannot be read for the lookups, left plain.
    Entered by whoever packs a whole model (model_loader.utils, `prepack_cpu_weights`)."""
    holders: dict[int, Holders] = defaultdict(list)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders[id(param)].append((module, name))
    token = _SHARED.set({pid: found for pid, found in holders.items() if len(found) > 1})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _cpu_methods(model: nn.Module) -> Iterator[tuple[nn.Module, CPUUnquantizedLinearMethod]]:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, CPUUnquantizedLinearMethod):
            yield module, method


def prepack_cpu_weights(model: nn.Module) -> int:
    """Pack every CPU-packable weight of `model` that is plain now (unpacked by a loader or
    `unpack_cpu_weights`, or MKL's companion after its weight changed); weights still
    packed are kept. Returns how many weights are packed now."""
    count = 0
    with reusing_upcast_buffer(), tracking_shared_weights(model):
        for module, method in _cpu_methods(model):
            method.process_weights_after_loading(module)
            count += method.packed is not None
    return count


def unpack_cpu_weights(model: nn.Module) -> int:
    """Give every packed weight of `model` its plain form back, layer by layer (never two
    copies of more than one weight); returns how many were packed. For code that edits
    weights through views (`w[:n].copy_(...)`), then calls `prepack_cpu_weights`."""
    return sum(method.unpack_weight(module) for module, method in _cpu_methods(model))
