"""Quantization numerics for GLM-5.3-Flash checkpoints, in plain torch (no device kernels).

``fp8_block``: the native checkpoint format, FP8 E4M3 weights with one fp32 multiplier per 128x128 block
(``weight_scale_inv``); quantize (for test checkpoints) and dequantize (for platforms without FP8 kernels).
``mxfp8``: re-grouping of that format into OCP MXFP8 (E4M3 elements, one E8M0 exponent per 1x32 group along
K), the layout Ascend 950 matmuls consume.
"""
