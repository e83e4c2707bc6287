"""Quantized GLM-5.3-Flash checkpoints: formats, numerics and how each platform serves them.

Numerics and formats (plain torch, no device kernels):
``fp8_block``: the native checkpoint format, FP8 E4M3 weights with one fp32 multiplier per 128x128 block
(``weight_scale_inv``); quantize (for test checkpoints) and dequantize (for platforms without FP8 kernels).
``mxfp8``: re-grouping of that format into OCP MXFP8 (E4M3 elements, one E8M0 exponent per 1x32 group along
K), the layout Ascend 950 matmuls consume.
``w8a8``: msmodelslim W8A8_DYNAMIC checkpoints (Ascend A2/A3): the description file, per-channel int8 weights,
per-token int8 activations, and the reference matmul.

Serving:
``fp8``: pairing streamed FP8 weights with their scales, and what a layer keeps of them;
``configs``: the ``--quantization`` configs registered with vLLM (``glm5_next_fp8``, ``ascend`` where no
vllm-ascend owns it, ``glm5_next_mxfp8`` where vllm-ascend's own model serves GLM-5.3); ``plan``: per-layer
decisions from the checkpoint's tensors; ``linear`` and ``experts``: the quantized linear methods and expert
stacks; ``npu``: the ``torch_npu`` calls and their layouts.
"""
