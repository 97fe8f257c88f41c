"""DeviceConfig: the device the ranks run on, and the CPU's own knobs."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class DeviceConfig:
    # "cpu" or "cuda": the resolution step (engine/arg_utils.py) decides "auto" once, in
    # the engine process, so that every rank runs on the device the engine chose.
    device: str = "cpu"
    # Linear weights on the CPU are packed in place (models/layers/unquantized.py): faster
    # GEMMs (decode above all), no extra memory (MKL, when chosen, keeps a copy beside).
    cpu_prepack_weights: bool = True
    # Which cores each CPU rank runs on: "auto" | "none" | "0-3|4-7" (worker/cpu_affinity.py).
    cpu_threads_bind: str = "auto"

    @property
    def device_type(self) -> str:
        return self.device
