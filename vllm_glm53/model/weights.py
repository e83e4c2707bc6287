"""Checkpoint names -> model parameters, in one place.

The checkpoint layout is the released one (architecture.md §12): nested ``model.language_model.*`` or flat
``model.*``, per-expert MoE tensors, q/k/v conv weights split, layer-level ``hc_{attn,ffn}_*``. The serving
model fuses some of them (gate|up, and each group of projections that read the same hidden state) and shards
them over TP ranks through each parameter's ``weight_loader``. Every tensor must land somewhere and every
parameter must be filled: anything else is a :class:`CheckpointError` naming the tensors, before the engine
starts.

Quantized checkpoints (:mod:`vllm_glm53.quant`): a block-FP8 weight is paired with its ``weight_scale_inv``
as they stream in, and the module it lands in decides what to keep (``quant.fp8.block_fp8_parts``); w8a8
``weight_scale`` / ``weight_offset`` tensors follow their weight into the same (fused) parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from vllm_glm53._vllm import default_weight_loader
from vllm_glm53.checkpoint_names import canonical_name
from vllm_glm53.quant.fp8 import BlockFp8Weight, Fp8Pairing, block_fp8_parts
from vllm_glm53.quant.w8a8 import MTP_ROTATION


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


# Checkpoint module -> (serving module, shard id) for the fused projections.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkvb_proj", 0),
    "self_attn.k_proj": ("self_attn.qkvb_proj", 1),
    "self_attn.v_proj": ("self_attn.qkvb_proj", 2),
    "self_attn.b_proj": ("self_attn.qkvb_proj", 3),
    "self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj", 0),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", 1),
    "self_attn.indexer.wk": ("self_attn.indexer.wk_gate_weights_proj", 0),
    "self_attn.indexer.weights_proj": ("self_attn.indexer.wk_gate_weights_proj", 2),
    "self_attn.f_a_proj": ("self_attn.fg_a_proj", 0),
    "self_attn.g_a_proj": ("self_attn.fg_a_proj", 1),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}
# Checkpoint tensors outside any linear module that are one shard of a fused one (no ".weight" suffix).
_FUSED_TENSORS = {"self_attn.indexer.index_kpool_compress_gate": ("self_attn.indexer.wk_gate_weights_proj", 1)}
# What a (possibly quantized) linear module stores: weight, w8a8 scale/offset, block-FP8 scale.
_LINEAR_LEAVES = ("weight", "weight_scale", "weight_offset", "weight_scale_inv")
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)$")
_CONV = re.compile(r"self_attn\.([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_offset)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class WeightLoader:
    """Streams checkpoint tensors into ``model`` (a module holding ``model.*`` and ``lm_head``)."""

    def __init__(self, root: nn.Module, num_layers: int, layer_offset: int = 0,
                 skip: Callable[[str], bool] | None = None) -> None:
        self.root = root
        self.num_layers = num_layers
        self.layer_offset = layer_offset  # the MTP module maps checkpoint layer N to its block 0
        self.skip = skip  # checkpoint names (canonical) that belong to another module
        self.params = dict(root.named_parameters())
        self.module_params: dict[str, dict[str, nn.Parameter]] = {}
        for name, param in self.params.items():
            module, _, leaf = name.rpartition(".")
            self.module_params.setdefault(module, {})[leaf] = param
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        # tensors that could not be loaded, and the parameters they were going to: reported together with the
        # missing ones by check_complete, so one start-up names every problem of a checkpoint
        self.unloadable: list[str] = []
        self.failed: set[str] = set()
        self.skipped = 0
        self._target: tuple[str, tuple[int, ...]] | None = None  # the parameter being filled, for errors

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        fp8 = Fp8Pairing()
        for raw_name, tensor in weights:
            name = canonical_name(raw_name)
            # The QuaRot rotation of w8a8 checkpoints belongs to the MTP layer's input.
            if (self.skip is not None and self.skip(name)) or (name == MTP_ROTATION and self.layer_offset == 0):
                self.skipped += 1
                continue
            self._target = None
            try:
                if Fp8Pairing.wants(name, tensor):
                    paired = fp8.add(name, tensor)
                    if paired is None:
                        continue  # the other half of this FP8 weight is still to come
                    name, tensor = paired
                self._load_one(name, tensor)
            except Exception as e:  # shape mismatch and friends: name the tensor and where it was going
                target = self._target
                if target is not None:
                    self.failed.add(target[0])
                if isinstance(e, CheckpointError):
                    self.unloadable.append(str(e))
                    continue
                into = f" into {target[0]} {target[1]}" if target else ""
                self.unloadable.append(f"cannot load checkpoint tensor {raw_name} {tuple(tensor.shape)}{into} "
                                       f"(shape on this tensor-parallel rank): {e or type(e).__name__}")
        if fp8.unpaired():
            self.unloadable.append(f"FP8 tensors without their other half: {', '.join(fp8.unpaired()[:12])}")
        return self.loaded

    def check_complete(self, optional: Iterable[str] = ()) -> None:
        """Raise one :class:`CheckpointError` naming every problem :meth:`load` met and every parameter no tensor
        filled."""
        missing = sorted(set(self.params) - self.loaded - self.failed - set(optional))
        problems = self.unloadable[:12] + ([f"... {len(self.unloadable) - 12} more"] if len(self.unloadable) > 12
                                           else [])
        if missing:
            problems.append(f"missing tensors for {len(missing)} parameters: {', '.join(missing[:12])}"
                            + (" ..." if len(missing) > 12 else ""))
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected tensors: {', '.join(self.unexpected[:12])}"
                            + (" ..." if len(self.unexpected) > 12 else ""))
        if problems:
            raise CheckpointError("checkpoint does not match the glm5_next config: " + "; ".join(problems))

    # --------------------------------------------------------------------------------------------------------

    def _load_one(self, name: str, tensor: torch.Tensor | BlockFp8Weight) -> None:
        m = _LAYER.match(name)
        if m is None:
            self._linear_or_direct(name, tensor)
            return
        layer = int(m.group(1)) - self.layer_offset
        sub = m.group(2)
        if not 0 <= layer < self.num_layers:
            self.skipped += 1  # another module's layer (the MTP layer for the main model, and vice versa)
            return
        base = f"model.layers.{layer}."
        module, _, leaf = sub.rpartition(".")
        if sub in _FUSED_TENSORS:
            target, shard = _FUSED_TENSORS[sub]
            self._linear(base + target, "weight", tensor, shard)
        elif module in _FUSED and leaf in _LINEAR_LEAVES:
            target, shard = _FUSED[module]
            self._linear(base + target, leaf, tensor, shard)
        elif mm := _HC.match(sub):
            self._direct(f"{base}{mm.group(1)}_hc.{mm.group(2)}", tensor)
        elif mm := _CONV.match(sub):
            attn = self.root.get_submodule(base + "self_attn")
            attn.load_conv("qkv".index(mm.group(1)), tensor)
            self.loaded.add(base + "self_attn.conv_weight")
        elif mm := _EXPERT.match(sub):
            moe = self.root.get_submodule(base + "mlp")
            filled = moe.load_expert(int(mm.group(1)), mm.group(2), mm.group(3), tensor)
            self.loaded.update(base + "mlp." + n for n in filled)
        elif sub in ("self_attn.dt_bias", "self_attn.A_log"):
            param = self._param(base + sub)
            if param is not None:
                self.root.get_submodule(base + "self_attn").load_sharded_vector(param, tensor)
                self.loaded.add(base + sub)
        else:
            self._linear_or_direct(base + sub, tensor)

    def _linear_or_direct(self, name: str, tensor: torch.Tensor | BlockFp8Weight) -> None:
        if isinstance(tensor, BlockFp8Weight):
            self._linear(name[: -len(".weight")], "weight", tensor, None)
        else:
            self._direct(name, tensor)

    def _linear(self, module: str, leaf: str, tensor: torch.Tensor | BlockFp8Weight, shard: int | None) -> None:
        """One tensor of linear ``module`` (a shard of it when fused); FP8 pairs become what the module keeps."""
        if isinstance(tensor, BlockFp8Weight):
            params = self.module_params.get(module)
            if params is None or "weight" not in params:
                self.unexpected.append(f"{module}.weight")
                return
            parts = block_fp8_parts(tensor, params)
        else:
            parts = [(leaf, tensor)]
        for part_leaf, part in parts:
            if shard is None:
                self._direct(f"{module}.{part_leaf}", part)
            else:
                self._sharded(f"{module}.{part_leaf}", part, shard)

    def _param(self, name: str) -> nn.Parameter | None:
        param = self.params.get(name)
        if param is None:
            self.unexpected.append(name)
        else:
            self._target = (name, tuple(param.shape))
        return param

    def _direct(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if param is None:
            return
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                                      f"{tuple(param.shape)}")
            default_weight_loader(param, tensor)
        else:
            loader(param, tensor)
        self.loaded.add(name)

    def _sharded(self, name: str, tensor: torch.Tensor, shard: int) -> None:
        param = self._param(name)
        if param is None:
            return
        param.weight_loader(param, tensor, shard)
        self.loaded.add(name)


def before_weights_processed() -> None:
    """What must be in place before vLLM post-processes a CPU model's layers (it picks each linear layer's GEMM
    then): its AMX GEMM ruled out where oneDNN is capped below AMX (``_vllm`` ledger 12)."""
    from vllm_glm53 import _vllm

    if _vllm.is_cpu_platform():
        from vllm_glm53.backends.cpu.linear import onednn_allows_amx

        _vllm.cpu_amx_gemm_follows_onednn_cap(onednn_allows_amx)


def after_weights_processed(model: nn.Module) -> None:
    """What a loaded model does once vLLM has post-processed every layer (its model-level
    ``process_weights_after_loading`` hook): on a CPU, the linear layers whose 16-bit weights the CPU has no
    arithmetic for move to the compiled kernel (``backends/cpu/linear.py``)."""
    from vllm_glm53 import _vllm

    if _vllm.is_cpu_platform():
        from vllm_glm53.backends.cpu.linear import take_16bit_gemms

        take_16bit_gemms(model)
