"""vLLM linear methods for the plugin's quantized linear layers (chosen by :mod:`.plan`), and the MXFP8 method
the plugin lends to vLLM linear layers of another model class (:mod:`.configs`, vllm-ascend's GLM5Next).

All keep a checkpoint's own tensor layout as parameters, so vLLM's parameter loaders shard and fuse them
like any weight (TP, gate|up, q|k|v), and move to the kernels' layout after loading.
"""

from __future__ import annotations

import logging
import math

import torch

from vllm_glm53 import _vllm
from vllm_glm53.quant import npu
from vllm_glm53.quant.mxfp8 import GROUP, regroup
from vllm_glm53.quant.w8a8 import W8A8_DYNAMIC, w8a8_matmul

logger = logging.getLogger("vllm_glm53")


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


# What an FP8 scale parameter holds until the checkpoint fills it: no loaded block scale is negative.
UNLOADED_SCALE = -1.0


@_vllm.register_weight_loader_v2_supported_method
class BlockFp8Mxfp8LinearMethod(Mxfp8LinearMethod):
    """:class:`Mxfp8LinearMethod` for a vLLM linear layer whose model loads the block-FP8 checkpoint itself.

    Its parameters are the checkpoint's (``weight`` E4M3 ``[N, K]``, ``weight_scale_inv`` fp32 block scales) as
    vLLM's block-FP8 method declares them, so the model's ``load_weights`` and vLLM's parameter loaders fill
    them unchanged (TP shards, fused shards). After loading the weight is re-grouped to MXFP8
    (:func:`~.mxfp8.regroup`) and the layer becomes exactly what :class:`Mxfp8LinearMethod` holds and runs.
    """

    def __init__(self, block_size: tuple[int, int]) -> None:
        self.block_size = tuple(int(b) for b in block_size)

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if input_size_per_partition % GROUP:
            raise ValueError(f"{layer.prefix}: MXFP8 needs the per-rank reduction size "
                             f"({input_size_per_partition}) to be a multiple of {GROUP}")
        # The TP split must fall on block edges, or a rank's rows would need another rank's scales.
        _vllm.validate_fp8_block_shape(layer, input_size, output_size, input_size_per_partition,
                                       output_partition_sizes, list(self.block_size))
        bn, bk = self.block_size
        if any(size % bn for size in output_partition_sizes[:-1]):
            # Only the last fused part may end in a partial block (q_a | kv_a: 1536 | 576). Then row r of the
            # fused weight has its scale in row r // bn, as in one checkpoint tensor; a partial block inside
            # would make vLLM's loaders start the next part's scales at a rounded-up row.
            raise ValueError(f"{layer.prefix}: fused parts {output_partition_sizes} are not whole {bn}-row blocks")
        layer.weight_block_size = list(self.block_size)  # vLLM's fused loaders read it for the scale offsets
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        layer.register_parameter("weight", _vllm.ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=loader))
        scale = _vllm.BlockQuantScaleParameter(
            data=torch.full((math.ceil(n / bn), math.ceil(input_size_per_partition / bk)), UNLOADED_SCALE,
                            dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=loader)
        layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer) -> None:
        scale_inv = layer.weight_scale_inv.data
        if bool((scale_inv == UNLOADED_SCALE).any()):
            raise ValueError(
                f"{layer.prefix}: the checkpoint gave this layer no (or not every) weight_scale_inv, so it is not "
                "block-FP8 there; list it in quantization_config.modules_to_not_convert")
        weight, scale = regroup(layer.weight.data, scale_inv, self.block_size)
        del layer.weight_scale_inv
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        super().process_weights_after_loading(layer)


@_vllm.register_weight_loader_v2_supported_method
class CpuBlockFp8LinearMethod(_vllm.LinearMethodBase):
    """A linear layer whose block-FP8 weight stays FP8 on the CPU: ``weight`` E4M3 ``[N, K]`` and
    ``weight_scale_inv`` float32 block scales, run by the compiled ``fp8_linear`` (backends/cpu/fp8.py), which
    dequantizes inside the product.

    The parameters are the checkpoint's, as vLLM's block-FP8 method declares them, so vLLM's parameter loaders
    fill them (TP shards, fused parts: a fused part's scale rows start at ``ceil(row offset / bn)``, each part
    keeps its own ragged last block). Nothing moves after loading: the kernels read the checkpoint's layout.
    A layer whose tensor-parallel share does not start on a block edge takes the dequantize-at-load path
    instead (logged), as vLLM's block-FP8 methods would refuse it.
    """

    def __init__(self, block_size: tuple[int, int]) -> None:
        self.block_size = tuple(int(b) for b in block_size)

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm_glm53.backends.cpu.fp8 import scale_rows

        bn, bk = self.block_size
        parts = [int(p) for p in output_partition_sizes]
        loader = extra_weight_attrs["weight_loader"]
        reason = None
        if sum(parts) != output_size and any(p % bn for p in parts):
            reason = f"tensor-parallel parts {parts} are not whole {bn}-row blocks"
        elif input_size_per_partition != input_size and input_size_per_partition % bk:
            reason = f"the per-rank input size {input_size_per_partition} is not whole {bk}-column blocks"
        # vLLM's loaders put part p's scales at row ceil(offset_p / bn); parts of fewer than bn rows could then
        # land on one another's rows.
        offset, first = 0, 0
        for p in parts:
            if reason is None and math.ceil(offset / bn) != first:
                reason = f"fused parts {parts} share block rows"
            first += math.ceil(p / bn)
            offset += p
        if reason is not None:
            # A rank's share would need another rank's (or part's) scales: this layer takes the
            # dequantize-at-load path (the loader dequantizes into a weight of the model dtype).
            logger.warning("vllm-glm53: %s stays dequantized on CPU: %s", layer.prefix, reason)
            layer.fp8_dequantized = True
            layer.register_parameter("weight", _vllm.ModelWeightParameter(
                data=torch.empty(sum(parts), input_size_per_partition, dtype=params_dtype),
                input_dim=1, output_dim=0, weight_loader=loader))
            return
        layer.weight_block_size = [bn, bk]  # vLLM's fused loaders read it for the scale offsets
        layer.fp8_parts = parts
        layer.register_parameter("weight", _vllm.ModelWeightParameter(
            data=torch.empty(sum(parts), input_size_per_partition, dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale_inv", _vllm.BlockQuantScaleParameter(
            data=torch.full((scale_rows(parts, bn), math.ceil(input_size_per_partition / bk)), UNLOADED_SCALE,
                            dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=loader))

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "fp8_dequantized", False):
            layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)
            return
        if bool((layer.weight_scale_inv.data == UNLOADED_SCALE).any()):
            raise ValueError(
                f"{layer.prefix}: the checkpoint gave this layer no (or not every) weight_scale_inv, so it is not "
                "block-FP8 there; list it in quantization_config.modules_to_not_convert")
        # plain parameters: the loaders' attributes are not needed any more
        layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(layer.weight_scale_inv.data, requires_grad=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from vllm_glm53.backends.cpu.fp8 import fp8_linear

        if getattr(layer, "fp8_dequantized", False):
            return torch.nn.functional.linear(x, layer.weight, bias)
        shape = x.shape
        out = fp8_linear(x.reshape(-1, shape[-1]), layer.weight, layer.weight_scale_inv, layer.fp8_parts,
                         self.block_size)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def fp8_mlp(gate_up, down, x: torch.Tensor, limit: float) -> torch.Tensor | None:
    """``down(clamped_swiglu(gate_up(x)))`` in one compiled call (backends/cpu/fp8.py's ``mlp_fp8``) where both
    linear layers keep block-FP8 weights on the CPU and ``x`` ``[T, D]`` is decode-sized; this rank's partial sum in
    x's dtype (down's all-reduce left to the caller). None elsewhere: the layers run one after the other."""
    from vllm_glm53.backends.cpu.fp8 import MLP_FP8_MAX_TOKENS, mlp_fp8

    method = gate_up.quant_method
    if (x.dim() != 2 or x.shape[0] > MLP_FP8_MAX_TOKENS or not isinstance(method, CpuBlockFp8LinearMethod)
            or not isinstance(down.quant_method, CpuBlockFp8LinearMethod)
            or getattr(gate_up, "fp8_dequantized", False) or getattr(down, "fp8_dequantized", False)):
        return None
    return mlp_fp8(x, gate_up.weight, gate_up.weight_scale_inv, down.weight, down.weight_scale_inv, limit,
                   method.block_size).to(x.dtype)


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
