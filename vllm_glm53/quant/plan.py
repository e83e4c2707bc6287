"""The per-layer quantization plan of the plugin's model.

The layers ask :func:`layer_quant` for the ``quant_config`` they hand to vLLM's linear layers and for their
routed-expert implementation. The plan comes from the checkpoint itself, not from which vLLM config won
the name (on Ascend that may be vllm-ascend's): the tensor names for native FP8 (a module is FP8 iff
``<module>.weight_scale_inv`` exists) and ``quant_model_description.json`` for msmodelslim w8a8. What each
platform does with a quantized module:

=========== ====================================== ============================================
scheme      linear layers                          routed experts
=========== ====================================== ============================================
fp8, cuda   vLLM ``Fp8LinearMethod`` (block FP8)   vLLM fused MoE, ``Fp8MoEMethod``, swiglu limit
fp8, npu    MXFP8 ``npu_quant_matmul``              MXFP8 ``npu_grouped_matmul``
fp8, cpu    kept FP8, compiled ``fp8_linear``       kept FP8, compiled ``moe_experts_fp8``
fp8, other  dequantized at load (model dtype)       dequantized at load (model dtype)
w8a8, npu   int8 ``npu_quant_matmul``               int8 ``npu_grouped_matmul``
w8a8, other the plain-torch reference of the same   the plain-torch reference
=========== ====================================== ============================================

``cpu`` is a CPU whose compiled kernels are loaded and read the checkpoint's block size
(``backends.cpu.fp8.fp8_weight_form``, logged once with the reason when it declines); other CPUs take the
``reference`` row, which is also the numerical reference of the ``cpu`` one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_glm53 import _vllm
from vllm_glm53.checkpoint_names import canonical_name
from vllm_glm53.quant import w8a8
from vllm_glm53.quant.fp8 import SCALE_SUFFIX

logger = logging.getLogger("vllm_glm53")

# Fused serving modules -> the checkpoint modules they are built from (the shard order of weights._FUSED).
PACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "qkvb_proj": ("q_proj", "k_proj", "v_proj", "b_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "fg_a_proj": ("f_a_proj", "g_a_proj")}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_PLANS: dict[tuple, "LayerQuant | None"] = {}  # (checkpoint, revision, backend) -> plan


def backend() -> str:
    """``native`` (CUDA/ROCm FP8 kernels), ``npu`` (Ascend kernels) or ``reference`` (plain torch; on a CPU an
    FP8 checkpoint may still get the ``cpu`` plan, see :func:`layer_quant`)."""
    kind = _vllm.platform_kind()
    if kind in ("cuda", "rocm"):
        return "native"
    return "npu" if kind == "npu" else "reference"


@dataclass(frozen=True)
class CheckpointQuant:
    """What the checkpoint stores quantized: ``scheme`` and the canonical names of those linear modules."""

    scheme: str  # "fp8" or "w8a8"
    modules: frozenset[str]
    hf_quant_config: dict = field(default_factory=dict)


def read_checkpoint_quant(model_config, fp8_names: bool = True) -> CheckpointQuant | None:
    """Inspect the checkpoint of ``model_config`` (config files and tensor names only, no weights).

    ``fp8_names=False`` skips listing the tensors of an FP8 checkpoint (its ``modules`` are then empty).
    """
    description = _vllm.read_model_json(model_config, w8a8.DESCRIPTION_FILE)
    if description:
        return CheckpointQuant("w8a8", frozenset(canonical_name(m) for m in w8a8.quantized_modules(description)))
    hf_config = model_config.hf_config
    hf_quant = getattr(hf_config, "quantization_config", None) or getattr(
        getattr(hf_config, "text_config", None), "quantization_config", None)
    if hasattr(hf_quant, "to_dict"):  # a transformers quantization config object rather than the raw dict
        hf_quant = hf_quant.to_dict()
    if hf_quant and hf_quant.get("quant_method") == "fp8":
        names = checkpoint_tensor_names(model_config) if fp8_names else set()
        fp8 = frozenset(canonical_name(n[: -len(SCALE_SUFFIX)]) for n in names if n.endswith(SCALE_SUFFIX))
        return CheckpointQuant("fp8", fp8, dict(hf_quant))
    return None


def checkpoint_tensor_names(model_config) -> set[str]:
    """Every tensor name of the checkpoint: from the safetensors index, else from the files' headers."""
    index = _vllm.read_model_json(model_config, "model.safetensors.index.json")
    if index:
        return set(index["weight_map"])
    folder = Path(model_config.model)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"cannot list the tensors of {model_config.model}: no model.safetensors.index.json and no local "
            "*.safetensors files")
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), "pt") as f:  # reads the header only
            names.update(f.keys())
    return names


class LayerQuant(_vllm.QuantizationConfig):
    """The plan as a vLLM quantization config: vLLM's linear layers call :meth:`get_quant_method` with their
    prefix (the plugin's module name), and the MoE blocks call :meth:`experts_scheme`."""

    def __init__(self, checkpoint: CheckpointQuant, backend_name: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.backend = backend_name
        self._vllm_fp8 = None

    # --- the QuantizationConfig interface (this object is never looked up by name) -------------------------

    def get_name(self) -> str:
        return f"glm5_next_{self.checkpoint.scheme}"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LayerQuant:
        raise TypeError("LayerQuant is built from a checkpoint (read_checkpoint_quant), not from a config dict")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, _vllm.LinearBase):
            return None
        scheme = self.scheme_of(_checkpoint_modules(prefix))
        if scheme == "w8a8":
            from vllm_glm53.quant.linear import W8A8LinearMethod

            return W8A8LinearMethod(on_npu=self.backend == "npu")
        if scheme == "fp8" and self.backend == "native":
            return self.vllm_fp8_config().get_quant_method(layer, prefix)
        if scheme == "fp8" and self.backend == "npu":
            from vllm_glm53.quant.linear import Mxfp8LinearMethod

            return Mxfp8LinearMethod()
        if scheme == "fp8" and self.backend == "cpu":
            from vllm_glm53.quant.linear import CpuBlockFp8LinearMethod

            return CpuBlockFp8LinearMethod(self.block_size)
        return _vllm.UnquantizedLinearMethod()  # BF16 in the checkpoint, or FP8 dequantized while loading

    # --- plan queries ---------------------------------------------------------------------------------------

    def scheme_of(self, modules: list[str]) -> str | None:
        """The scheme the checkpoint stores ``modules`` (one serving layer's parts) in, None for plain."""
        stored = {m in self.checkpoint.modules for m in modules}
        if len(stored) > 1:
            raise ValueError(f"{', '.join(modules)} are fused into one layer but only some are "
                             f"{self.checkpoint.scheme} in the checkpoint")
        return self.checkpoint.scheme if stored.pop() else None

    @property
    def block_size(self) -> tuple[int, int]:
        """The checkpoint's FP8 ``weight_block_size``."""
        return tuple(int(b) for b in self.checkpoint.hf_quant_config.get("weight_block_size") or (128, 128))

    def experts_scheme(self, moe_prefix: str, num_experts: int) -> str | None:
        return self.scheme_of([f"{moe_prefix}.experts.{e}.{p}" for e in range(num_experts) for p in EXPERT_PROJS])

    def vllm_fp8_config(self):
        """vLLM's block-FP8 config for the layers this plan already knows to be FP8 (no ignore list: the
        checkpoint's ``modules_to_not_convert`` is not trusted, architecture.md §12.2)."""
        if self._vllm_fp8 is None:
            cfg = self.checkpoint.hf_quant_config
            self._vllm_fp8 = _vllm.Fp8Config.from_config({
                "quant_method": "fp8",
                "activation_scheme": cfg.get("activation_scheme", "dynamic"),
                "weight_block_size": cfg.get("weight_block_size", [128, 128]),
            })
        return self._vllm_fp8


def _checkpoint_modules(prefix: str) -> list[str]:
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}" for part in PACKED[leaf]] if leaf in PACKED else [prefix]


def layer_quant() -> LayerQuant | None:
    """The plan for the model being built: None for an unquantized checkpoint, outside an engine, and for FP8
    on ``reference`` platforms, whose layers stay unquantized while the loader dequantizes whatever arrives
    with a scale. On a CPU an FP8 checkpoint gets the ``cpu`` plan (weights kept FP8) when
    ``backends.cpu.fp8.fp8_weight_form`` says the compiled kernels take them."""
    vllm_config = _vllm.get_current_vllm_config_or_none()
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    name = backend()
    # One checkpoint scan per model and backend, not per layer. (Not cached on the VllmConfig: vLLM copies it
    # with dataclasses.replace for the MTP draft model, which refuses unknown attributes.)
    key = (str(model_config.model), getattr(model_config, "revision", None), name)
    if key not in _PLANS:
        checkpoint = read_checkpoint_quant(model_config, fp8_names=False)
        if checkpoint is not None and checkpoint.scheme == "fp8":
            if name == "reference" and _fp8_resident_on_cpu(checkpoint):
                name = "cpu"
            if name != "reference":  # the plan needs to know which modules are FP8
                checkpoint = read_checkpoint_quant(model_config)
        plan = None
        if checkpoint is not None and not (checkpoint.scheme == "fp8" and name == "reference"):
            plan = LayerQuant(checkpoint, name)
            logger.info("vllm-glm53: %s checkpoint, %d quantized linear modules, %s kernels",
                        checkpoint.scheme, len(checkpoint.modules), name)
        _PLANS[key] = plan
    return _PLANS[key]


def _fp8_resident_on_cpu(checkpoint: CheckpointQuant) -> bool:
    if _vllm.platform_kind() != "cpu":
        return False
    from vllm_glm53.backends.cpu.fp8 import fp8_weight_form

    block = tuple(int(b) for b in checkpoint.hf_quant_config.get("weight_block_size") or (128, 128))
    return fp8_weight_form(block) == "fp8"
