"""Native block-FP8 checkpoints of GLM-5.3: pairing the streamed tensors and what each platform stores.

The released checkpoint says ``quant_method: fp8`` with 128x128 block scales (architecture.md §12.2). vLLM
would hand it to its own ``Fp8Config``, which rejects ``--dtype float32`` and, on CPUs without AMX, finds no
kernel at all; the plugin claims such checkpoints of this model (:mod:`.configs`) and its layers follow the
per-tensor plan of :mod:`.plan`:

* CPU with the compiled kernels loaded: the FP8 layers keep the checkpoint's bytes and block scales, and the
  kernels dequantize inside their products (:mod:`vllm_glm53.backends.cpu.fp8`); RAM is about the
  checkpoint's size.
* CPU without them, and any platform without a native path: every FP8 weight is dequantized once, while the
  checkpoint streams in, straight into the model dtype (float32 under ``--dtype float32``, bfloat16 by default). Only
  the tensor being converted exists twice, so loading peaks near one layer above the final size.
* CUDA/ROCm: the FP8 layers keep their bytes and run vLLM's block-FP8 linear and fused-MoE methods.
* Ascend (the plugin's own model): the FP8 weights are re-grouped to MXFP8 at load (:mod:`.mxfp8`,
  :mod:`.npu`).

Which tensors are FP8 is never taken from a list: a weight is FP8 iff the checkpoint stores its
``weight_scale_inv`` (the loader rule of architecture.md §12.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_glm53.quant.fp8_block import DEFAULT_BLOCK, dequantize_block_fp8, is_block_fp8

CONFIG_NAME = "glm5_next_fp8"
SCALE_SUFFIX = ".weight_scale_inv"
# model_type of the checkpoint config, its text part, and vLLM's rewrite for the MTP draft.
GLM5_NEXT_TYPES = ("glm5_next", "glm5_next_text", "glm5_next_mtp")


def is_glm5_next(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in GLM5_NEXT_TYPES


@dataclass
class BlockFp8Weight:
    """One checkpoint weight in block FP8: the E4M3 bytes ``[N, K]`` with their fp32 block multipliers."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = DEFAULT_BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.scale_inv, self.block, dtype=dtype)

    def to_mxfp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm_glm53.quant.mxfp8 import regroup

        return regroup(self.weight, self.scale_inv, self.block)


class Fp8Pairing:
    """Pairs each streamed FP8 ``<m>.weight`` with its ``<m>.weight_scale_inv``, whichever comes first.

    Safetensors files list names sorted, so a weight and its scale are adjacent and at most one tensor waits;
    a checkpoint that puts them in different files holds back at most that file's FP8 weights.
    """

    def __init__(self, block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        self.block = block
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    @staticmethod
    def wants(name: str, tensor: torch.Tensor) -> bool:
        return name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.float8_e4m3fn

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, BlockFp8Weight] | None:
        """Returns ``(<m>.weight, pair)`` once both halves of module ``m`` are in, else None."""
        if name.endswith(SCALE_SUFFIX):
            module = name[: -len(SCALE_SUFFIX)]
            self._scales[module] = tensor
        elif name.endswith(".weight"):
            module = name[: -len(".weight")]
            self._weights[module] = tensor
        else:
            raise ValueError(f"{name}: an FP8 tensor that is not a linear weight ({tensor.dtype})")
        if module in self._weights and module in self._scales:
            weight, scale = self._weights.pop(module), self._scales.pop(module)
            if not is_block_fp8(weight, scale):
                raise ValueError(f"{module}: weight_scale_inv next to a {weight.dtype} weight")
            return module + ".weight", BlockFp8Weight(weight, scale, self.block)
        return None

    def unpaired(self) -> list[str]:
        return sorted([f"{m}.weight (no weight_scale_inv)" for m in self._weights]
                      + [f"{m}.weight_scale_inv (no FP8 weight)" for m in self._scales])


def block_fp8_parts(pair: BlockFp8Weight, params: dict[str, torch.nn.Parameter]) -> list[tuple[str, torch.Tensor]]:
    """What a linear module with ``params`` (its parameters by local name) stores for ``pair``.

    The module's own parameters say which form it runs: ``weight_scale_inv`` (vLLM's block-FP8 methods) keeps
    the checkpoint bytes, a ``uint8`` ``weight_scale`` takes the MXFP8 re-grouping, anything else gets the
    weight dequantized into the dtype of its ``weight`` parameter.
    """
    if "weight_scale_inv" in params:
        return [("weight", pair.weight), ("weight_scale_inv", pair.scale_inv)]
    scale = params.get("weight_scale")
    if scale is not None and scale.dtype == torch.uint8:
        weight, mx_scale = pair.to_mxfp8()
        return [("weight", weight), ("weight_scale", mx_scale)]
    return [("weight", pair.dequantize(params["weight"].dtype))]
