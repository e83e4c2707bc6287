"""The quantization configs the plugin registers with vLLM, and who serves GLM-5.3 on this platform.

These classes only claim checkpoints and pass vLLM's validation (dtype, capability); the plugin's layers take
their methods from the per-tensor plan (:mod:`.plan`). Registration imports vLLM's quantization package only
(no layer modules): ``register()`` runs in every vLLM process.

Names never fight: ``glm5_next_fp8`` is the plugin's own, and ``ascend`` (msmodelslim checkpoints) is
registered only where no vllm-ascend is installed, since vllm-ascend owns that name on Ascend.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from typing import Any

import torch

from vllm_glm53 import _vllm
from vllm_glm53.quant import fp8, w8a8

logger = logging.getLogger("vllm_glm53")


class _PluginQuantConfig(_vllm.QuantizationConfig):
    """What both configs share: activations stay in the model dtype, and no vLLM module but the plugin's own
    layers (which ignore this object) reads these checkpoints."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # On GPUs the FP8 layers delegate to vLLM's Fp8Config methods, which pick their kernels (Marlin below
        # SM89); nothing else here needs a GPU.
        return 0

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, _vllm.LinearBase):
            return _vllm.UnquantizedLinearMethod()
        return None


class Glm5NextFp8Config(_PluginQuantConfig):
    """``quant_method: fp8`` checkpoints of GLM-5.3, claimed before vLLM's ``Fp8Config`` on every platform
    except where vllm-ascend serves the model itself."""

    def __init__(self, hf_quant_config: dict[str, Any]) -> None:
        super().__init__()
        self.hf_quant_config = dict(hf_quant_config)
        block = self.hf_quant_config.get("weight_block_size") or [128, 128]
        if len(block) != 2 or int(block[1]) % 32:
            raise ValueError(f"weight_block_size {block}: expected [N, K] with K a multiple of 32")
        scheme = self.hf_quant_config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"GLM-5.3 FP8 checkpoints quantize activations dynamically, not {scheme!r}")

    def get_name(self) -> str:
        return fp8.CONFIG_NAME

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the config is config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Glm5NextFp8Config:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if hf_quant_cfg.get("quant_method") != "fp8" or user_quant not in (None, "fp8", fp8.CONFIG_NAME):
            return None
        if not fp8.is_glm5_next(hf_config) or _vllm.ascend_glm5next_module() is not None:
            return None
        return fp8.CONFIG_NAME


class Glm5NextW8A8Config(_PluginQuantConfig):
    """``--quantization ascend`` for msmodelslim checkpoints (built by vLLM from the description file)."""

    def __init__(self, description: dict[str, Any]) -> None:
        super().__init__()
        self.modules = w8a8.quantized_modules(description)

    def get_name(self) -> str:
        return w8a8.CONFIG_NAME

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [w8a8.DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Glm5NextW8A8Config:
        return cls(config)


def register_configs() -> list[str]:
    """Register the configs (and log who serves the model); returns what was registered."""
    done = []
    _vllm.register_quantization_config(fp8.CONFIG_NAME, Glm5NextFp8Config)
    done.append(f"quantization {fp8.CONFIG_NAME}")
    if find_spec("vllm_ascend") is None and w8a8.CONFIG_NAME not in _vllm.quantization_methods():
        _vllm.register_quantization_config(w8a8.CONFIG_NAME, Glm5NextW8A8Config)
        done.append(f"quantization {w8a8.CONFIG_NAME}")
    ascend_module = _vllm.ascend_glm5next_module()
    if ascend_module is not None:
        logger.info("vllm-glm53: GLM-5.3 is served by vllm-ascend (%s); the plugin registers no model class",
                    ascend_module)
    else:
        logger.info("vllm-glm53: GLM-5.3 is served by vllm-glm53 (platform %s)", _vllm.platform_kind())
    return done
