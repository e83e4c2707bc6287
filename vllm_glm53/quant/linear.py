"""vLLM linear methods for the plugin's quantized linear layers (chosen by :mod:`.plan`).

Both keep the checkpoint's own tensor layout as parameters, so vLLM's parameter loaders shard and fuse them
like any weight (TP, gate|up, q|k|v), and move to the kernels' layout after loading.
"""

from __future__ import annotations

import torch

from vllm_glm53 import _vllm
from vllm_glm53.quant import npu
from vllm_glm53.quant.mxfp8 import GROUP
from vllm_glm53.quant.w8a8 import W8A8_DYNAMIC, w8a8_matmul


@_vllm.register_weight_loader_v2_supported_method
class Mxfp8LinearMethod(_vllm.LinearMethodBase):
    """A linear layer holding MXFP8 weights, run by ``npu_quant_matmul`` in MX mode.

    Its parameters are the loader-side MXFP8 layout (``weight`` E4M3 ``[N, K]``, ``weight_scale`` uint8
    ``[N, K/32]``), so vLLM's parameter loaders shard them like any weight; the weight loader re-groups the
    block-FP8 checkpoint tensors into it (``fp8.block_fp8_parts``). After loading both move to the kernel layout.
    """

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if input_size_per_partition % GROUP:
            raise ValueError(f"{layer.prefix}: MXFP8 needs the per-rank reduction size "
                             f"({input_size_per_partition}) to be a multiple of {GROUP}")
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        layer.register_parameter("weight", _vllm.ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale", _vllm.ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition // GROUP, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=loader))

    def process_weights_after_loading(self, layer) -> None:
        weight, scale = npu.mx_weight_layout(layer.weight.data, layer.weight_scale.data)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        out = npu.mx_linear(x.reshape(-1, shape[-1]), layer.weight, layer.weight_scale, bias)
        return out.reshape(*shape[:-1], out.shape[-1])


@_vllm.register_weight_loader_v2_supported_method
class W8A8LinearMethod(_vllm.LinearMethodBase):
    """A linear layer with an msmodelslim W8A8_DYNAMIC weight: ``npu_quant_matmul`` on Ascend, the reference
    (:func:`w8a8_matmul`) elsewhere. Parameters are the checkpoint's, sharded by vLLM's loaders; after loading the
    weight is kept as ``[K, N]`` (the kernels' layout) and the scale as ``[N]``."""

    def __init__(self, on_npu: bool) -> None:
        self.on_npu = on_npu

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        layer.register_parameter("weight", _vllm.ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=torch.int8),
            input_dim=1, output_dim=0, weight_loader=loader))
        for name in ("weight_scale", "weight_offset"):
            layer.register_parameter(name, _vllm.ChannelQuantScaleParameter(
                data=torch.empty(n, 1, dtype=torch.float32), output_dim=0, weight_loader=loader))

    def process_weights_after_loading(self, layer) -> None:
        if bool(layer.weight_offset.data.any()):
            raise ValueError(f"{layer.prefix}: weight_offset is not zero; only symmetric {W8A8_DYNAMIC} is served")
        del layer.weight_offset
        layer.weight = torch.nn.Parameter(layer.weight.data.t().contiguous(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(layer.weight_scale.data.reshape(-1), requires_grad=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.on_npu:
            out = npu.w8a8_linear(x2, layer.weight, layer.weight_scale, bias)
        else:
            out = w8a8_matmul(x2, layer.weight, layer.weight_scale, bias)
        return out.reshape(*shape[:-1], out.shape[-1])
