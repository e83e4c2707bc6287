"""The quantization configs the plugin registers with vLLM for the model that serves GLM-5.3 on this platform.

These classes only claim checkpoints and pass vLLM's validation (dtype, capability); the plugin's layers take
their methods from the per-tensor plan (:mod:`.plan`). Registration imports vLLM's quantization package only
(no layer modules): ``register()`` runs in every vLLM process.

Names never fight: ``glm5_next_fp8`` is the plugin's own, and ``ascend`` (msmodelslim checkpoints) is
registered only where no vllm-ascend is installed, since vllm-ascend owns that name on Ascend (as it owns
``fp8`` there). Where vllm-ascend serves GLM-5.3 with its own model class, the plugin adds
``glm5_next_mxfp8`` (:class:`Glm5NextMxfp8Config`): the native FP8 checkpoint re-grouped to MXFP8 with the
plugin's exact rule on Ascend 950, inside vllm-ascend's model.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from typing import Any

import torch

from vllm_glm53 import _vllm
from vllm_glm53.quant import fp8, w8a8
from vllm_glm53.serving import VLLM_ASCEND, Serving

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
        # Registered only where the plugin's model serves (register_configs); asked again because a process can
        # hold the registration from an earlier decision (tests that fake another platform).
        if not fp8.is_glm5_next(hf_config) or not _plugin_model_serves():
            return None
        return fp8.CONFIG_NAME


MXFP8_CONFIG_NAME = "glm5_next_mxfp8"
_ASCEND_950 = "A5"  # vllm-ascend's AscendDeviceType name for Ascend 950


class Glm5NextMxfp8Config(_PluginQuantConfig):
    """The native block-FP8 checkpoint served by vllm-ascend's GLM5Next on Ascend 950, with the plugin's
    MXFP8 re-grouping (:func:`~.mxfp8.regroup`: smallest non-clipping exponent per 1x32 group, bit-exact for
    power-of-two block scales) in place of vllm-ascend's bf16 round trip and OCP-rule re-quantization
    (``npu_dynamic_mx_quant(scale_alg=0)``, which clips: ascend.md §2.4).

    vLLM asks every registered config's :meth:`override_quantization_method` (custom ones before its built-in
    overrides) and takes the first claim; ``fp8`` (vllm-ascend's ``AscendFp8Config``, like vLLM's) claims
    nothing, so this one takes GLM-5.3's FP8 checkpoints when nobody chose: on an Ascend 950, with vllm-ascend's
    model. ``--quantization fp8`` keeps vllm-ascend's own path; ``--quantization glm5_next_mxfp8`` forces this
    one on another NPU generation (whose kernels then decide).

    Decision, against vllm-ascend's newer block-FP8 scheme (``get_scheme_class("fp8", "linear")``,
    ``AscendFp8BlockLinearMethod``): ours wins for ``glm5_next`` only, because that scheme re-quantizes through
    bf16 with the clipping rule while ours converts the checkpoint exactly where it can and never clips; other
    models keep vllm-ascend's. Everything this config does not re-group (layers the checkpoint keeps in BF16,
    attention, other modules) goes to the ``fp8`` config registered in the process, so it is served as if
    vllm-ascend's config had the checkpoint.
    """

    def __init__(self, hf_quant_config: dict[str, Any]) -> None:
        super().__init__()
        self.hf_quant_config = dict(hf_quant_config)
        self.weight_block_size = [int(b) for b in self.hf_quant_config["weight_block_size"]]
        # vllm-ascend's fp8 config on Ascend (vLLM's elsewhere): parses the ignore list and serves what we skip
        self.fp8 = _vllm.get_quantization_config("fp8").from_config(self.hf_quant_config)

    def get_name(self) -> str:
        return MXFP8_CONFIG_NAME

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Glm5NextMxfp8Config:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, MXFP8_CONFIG_NAME) or not _is_block_fp8_config(hf_quant_cfg):
            return None
        if not fp8.is_glm5_next(hf_config) or _vllm.ascend_glm5next_module() is None:
            return None
        if user_quant is None and _vllm.ascend_device_type() != _ASCEND_950:
            return None  # A2/A3 have no MXFP8 matmul: vllm-ascend's fp8 config dequantizes there
        return MXFP8_CONFIG_NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.fp8.apply_vllm_mapper(hf_to_vllm_mapper)  # the ignore list, in the model's module names

    def get_quant_method(self, layer: torch.nn.Module, prefix: str, **ascend_kwargs):
        # vllm-ascend's experts layer asks with tid2eid=... (its fp8 config takes it): passed on when delegating
        linear = isinstance(layer, _vllm.LinearBase)
        moe = isinstance(layer, _vllm.moe_layer_types())
        self.fp8.packed_modules_mapping = self.packed_modules_mapping  # set on us by the model loader
        if (linear or moe) and not _vllm.is_layer_skipped(prefix, self.fp8.ignored_layers,
                                                          self.packed_modules_mapping):
            if linear:
                from vllm_glm53.quant.linear import BlockFp8Mxfp8LinearMethod

                return BlockFp8Mxfp8LinearMethod(self.weight_block_size)
            from vllm_glm53.quant.experts import BlockFp8Mxfp8MoEMethod

            return BlockFp8Mxfp8MoEMethod(layer.moe_config, self.weight_block_size)
        try:
            return self.fp8.get_quant_method(layer, prefix, **ascend_kwargs)
        except NotImplementedError:
            # vllm-ascend builds without block-FP8 support raise for every layer; BF16 layers then take
            # vLLM's unquantized methods (None makes an experts layer pick its own)
            return _vllm.UnquantizedLinearMethod() if linear else None


def _is_block_fp8_config(hf_quant_cfg: dict[str, Any]) -> bool:
    """``quant_method: fp8`` with 2-D weight blocks whose K side is whole 1x32 groups, dynamic activations."""
    block = hf_quant_cfg.get("weight_block_size") or []
    return (hf_quant_cfg.get("quant_method") == "fp8" and len(block) == 2 and int(block[1]) % 32 == 0
            and hf_quant_cfg.get("activation_scheme", "dynamic") == "dynamic")


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


def _plugin_model_serves() -> bool:
    from vllm_glm53 import envs, serving

    return serving.decide(_vllm.platform_kind(), envs.VLLM_GLM53_MODEL, _vllm.ascend_glm5next_module()).plugin_model


def register_configs(served: Serving) -> tuple[list[str], str | None]:
    """Register the configs that belong to the model that serves (:mod:`vllm_glm53.serving`). Returns what was
    registered, and what register()'s start-up line should add about FP8 checkpoints (None: nothing).
    vLLM's own model (CUDA, ROCm) takes FP8 checkpoints with vLLM's ``Fp8Config``: nothing here."""
    done = []
    if served.plugin_model:
        _vllm.register_quantization_config(fp8.CONFIG_NAME, Glm5NextFp8Config)
        done.append(f"quantization {fp8.CONFIG_NAME}")
        if find_spec("vllm_ascend") is None and w8a8.CONFIG_NAME not in _vllm.quantization_methods():
            _vllm.register_quantization_config(w8a8.CONFIG_NAME, Glm5NextW8A8Config)
            done.append(f"quantization {w8a8.CONFIG_NAME}")
        return done, None
    if served.model != VLLM_ASCEND:
        return done, None
    _vllm.register_quantization_config(MXFP8_CONFIG_NAME, Glm5NextMxfp8Config)
    done.append(f"quantization {MXFP8_CONFIG_NAME}")
    device = _vllm.ascend_device_type()
    if device == _ASCEND_950:
        return done, (f"vllm-glm53 re-groups its FP8 checkpoints to MXFP8 (quantization {MXFP8_CONFIG_NAME}; "
                      "--quantization fp8 keeps vllm-ascend's own conversion)")
    return done, f"FP8 weights stay with vllm-ascend (device {device}: the MXFP8 re-grouping needs an Ascend 950)"
