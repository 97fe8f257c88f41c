"""Kernels the quantisation methods share: the WNA16 layout (int4/int8 weights, 16-bit or
float32 activations) that GPTQ, AWQ and compressed-tensors W4A16/W8A16 repack into, its
CPU kernels (C, with a torch fallback) and its Triton kernel for CUDA."""
