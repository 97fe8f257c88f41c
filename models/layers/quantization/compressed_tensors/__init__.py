"""compressed-tensors checkpoints (llm-compressor's output): `quant_method: "compressed-tensors"`."""

from models.layers.quantization.compressed_tensors.config import CompressedTensorsConfig

__all__ = ["CompressedTensorsConfig"]
