"""vllm-ascend serves GLM-5.3 with its own model class; the plugin lends it the exact MXFP8 re-grouping.

A minimal fake ``vllm_ascend`` package (written to a temporary directory, put on ``sys.path`` for one test)
has what the plugin looks at: a GLM5Next model module, the device-generation query, and vllm-ascend's
registrations of the ``fp8`` and ``ascend`` quantization names (its ``fp8`` config raising for every layer, as
in vllm-ascend builds without block-FP8 support). ``torch_npu`` is the numerical fake of tests/fake_torch_npu.py.

* Registration: the model is left to vllm-ascend, ``glm5_next_mxfp8`` is registered (and allowed on the
  NPU platform) next to vllm-ascend's names without replacing them, and vLLM's own checkpoint detection
  (``ModelConfig._verify_quantization``) picks it for GLM-5.3 FP8 checkpoints on an Ascend 950 only.
* vLLM's own linear and fused-MoE layers built with that config load the checkpoint's FP8 tensors through
  their weight loaders, hold exactly :func:`~vllm_glm53.quant.mxfp8.regroup`'s bytes afterwards, and compute
  what "dequantize the re-grouped weight and the MX activations, then matmul" computes.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import fake_torch_npu
from test_ascend_quant import block_fp8, mx_reference, rel_err, varied_weight
from vllm_glm53 import _vllm, testing
from vllm_glm53.quant import mxfp8, npu
from vllm_glm53.quant.configs import MXFP8_CONFIG_NAME, Glm5NextMxfp8Config

torch.set_num_threads(2)

FP8_CFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["m.kept_bf16"]}
# NPUPlatform's allow-list (ascend.md §1.2): vLLM rejects any other --quantization name on an NPU
NPU_QUANTIZATION = ["ascend", "compressed-tensors", "fp8", "deepseek_v4_fp8", "modelopt_mxfp8", "mxfp8"]

FAKE_VLLM_ASCEND = {
    "__init__.py": "",
    "models/__init__.py": "",
    "models/glm5_next.py": "class Glm5NextForCausalLM:\n    pass\n",
    "device/__init__.py": "",
    "device/device_config.py": """
        from enum import Enum

        AscendDeviceType = Enum("AscendDeviceType", ["A2", "A3", "_310P", "A5"])
        DEVICE = ["A5"]  # tests set the generation here

        def get_ascend_device_type():
            return AscendDeviceType[DEVICE[0]]
    """,
    "ops/__init__.py": "",
    "ops/fused_moe/__init__.py": "",
    "ops/fused_moe/routed_experts.py": """
        from vllm.model_executor.layers.fused_moe import RoutedExperts


        # How vllm-ascend's experts layer talks to its method: the config is asked with tid2eid, and apply's
        # result is an object whose routed_out goes on to the communication method.
        class AscendRoutedExperts(RoutedExperts):

            def _get_quant_method(self, prefix, quant_config, moe_config):
                return quant_config.get_quant_method(self, prefix, tid2eid=None)

            def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
                result = self.quant_method.apply(layer=self, x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                                                 shared_experts=None, shared_experts_input=None)
                self.expert_tokens = result.expert_tokens
                return result.routed_out
    """,
    "quantization/__init__.py": "",
    "quantization/fp8_config.py": """
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config


        class AscendFp8Config(Fp8Config):
            def get_quant_method(self, layer, prefix, tid2eid=None):
                raise NotImplementedError


        class AscendModelSlimConfig(QuantizationConfig):
            pass


        def register():  # what NPUPlatform.pre_register_and_update does
            register_quantization_config("fp8")(AscendFp8Config)
            register_quantization_config("ascend")(AscendModelSlimConfig)
    """,
}


@pytest.fixture
def vllm_ascend(tmp_path, monkeypatch):
    """The fake vllm-ascend on an NPU, its quantization names registered; vLLM's registries, the platform's
    allow-list and ``sys.modules`` are restored afterwards. Returns the fake's device-config module."""
    import importlib

    from vllm.model_executor.layers import quantization as q
    from vllm.platforms import current_platform

    import vllm_glm53

    # The plugin's own CPU registration goes into the tables before they are copied (the copies are what stay
    # afterwards), and whatever the fake NPU registers is forgotten with them: later tests in this process
    # find the plugin as vLLM's plugin loader left it, whichever test ran first.
    vllm_glm53.register()
    monkeypatch.setattr(vllm_glm53, "_registered", vllm_glm53._registered)
    for name, text in FAKE_VLLM_ASCEND.items():
        path = tmp_path / "vllm_ascend" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    # The tables are restored in place, not replaced by copies: vLLM's ModelConfig reads them through a lazy
    # module proxy that keeps the objects it saw first, so a copy bound here was invisible to its detection loop
    # whenever an earlier test in this process had built an engine config (the detection test then failed).
    methods, configs = list(q.QUANTIZATION_METHODS), dict(q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG)
    monkeypatch.setattr(type(current_platform), "supported_quantization", list(NPU_QUANTIZATION))
    monkeypatch.setattr(_vllm, "platform_kind", lambda: "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu.make_fake())
    importlib.import_module("vllm_ascend.quantization.fp8_config").register()
    yield importlib.import_module("vllm_ascend.device.device_config")
    for name in [m for m in sys.modules if m == "vllm_ascend" or m.startswith("vllm_ascend.")]:
        del sys.modules[name]
    q.QUANTIZATION_METHODS[:] = methods
    q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.clear()
    q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.update(configs)


def _register(monkeypatch, caplog) -> list[str]:
    import vllm_glm53

    monkeypatch.setattr(vllm_glm53, "_registered", None)  # register() again in this process
    with caplog.at_level(logging.INFO, logger="vllm_glm53"):
        return vllm_glm53.register()


def _detected(hf_quant_cfg: dict, model_type: str = "glm5_next", user: str | None = None) -> str:
    """The ``--quantization`` vLLM settles on for a checkpoint, by vLLM's own detection loop."""
    from vllm.config import ModelConfig

    model = SimpleNamespace(quantization=user, model_arch_config=SimpleNamespace(quantization_config=hf_quant_cfg),
                            hf_config=SimpleNamespace(model_type=model_type), allow_deprecated_quantization=False)
    ModelConfig._verify_quantization(model)
    return model.quantization


# ---------------------------------------------------------------------------------------------------------
# Registration and the claim
# ---------------------------------------------------------------------------------------------------------


def test_registration_defers_the_model_and_adds_only_the_plugins_own_quantization_name(vllm_ascend, monkeypatch,
                                                                                         caplog):
    from vllm import ModelRegistry
    from vllm.model_executor.layers import quantization as q
    from vllm.platforms import current_platform

    theirs = {}
    for arch in ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTPModel"):
        theirs[arch] = SimpleNamespace(module_name="vllm_ascend.models.glm5_next", class_name=arch)
        monkeypatch.setitem(ModelRegistry.models, arch, theirs[arch])
    done = _register(monkeypatch, caplog)
    assert all(ModelRegistry.models[arch] is entry for arch, entry in theirs.items())
    assert not [item for item in done if item.startswith("model ")]  # the summary claims no model class
    assert f"quantization {MXFP8_CONFIG_NAME}" in done and "quantization ascend" not in done
    # vllm-ascend keeps its names; ours is new, known once, and allowed on the NPU platform
    assert q.get_quantization_config("fp8").__module__ == "vllm_ascend.quantization.fp8_config"
    assert q.get_quantization_config("ascend").__module__ == "vllm_ascend.quantization.fp8_config"
    assert q.get_quantization_config(MXFP8_CONFIG_NAME) is Glm5NextMxfp8Config
    assert len(q.QUANTIZATION_METHODS) == len(set(q.QUANTIZATION_METHODS))
    assert current_platform.supported_quantization.count(MXFP8_CONFIG_NAME) == 1
    current_platform.verify_quantization(MXFP8_CONFIG_NAME)
    # one line says who serves the model and who re-groups
    lines = [r.getMessage() for r in caplog.records if "GLM-5.3 is served by" in r.getMessage()]
    assert len(lines) == 1
    assert "vllm-ascend's GLM5Next: the installed vllm-ascend ships it (vllm_ascend.models.glm5_next)" in lines[0]
    assert "re-groups" in lines[0]


def test_vllms_detection_gives_glm5_next_fp8_checkpoints_to_the_plugin_on_ascend_950_only(vllm_ascend,
                                                                                          monkeypatch, caplog):
    _register(monkeypatch, caplog)
    assert _detected(FP8_CFG) == MXFP8_CONFIG_NAME
    assert _detected(FP8_CFG, model_type="glm5_next_mtp") == MXFP8_CONFIG_NAME  # the MTP draft too
    assert _detected(FP8_CFG, model_type="deepseek_v3") == "fp8"  # other models stay vllm-ascend's
    assert _detected(FP8_CFG, user="fp8") == "fp8"  # an explicit choice is kept
    assert _detected({**FP8_CFG, "weight_block_size": None}) == "fp8"  # per-tensor FP8: not ours
    vllm_ascend.DEVICE[0] = "A3"
    assert _detected(FP8_CFG) == "fp8"  # no MXFP8 matmul on A2/A3
    assert _detected(FP8_CFG, user=MXFP8_CONFIG_NAME) == MXFP8_CONFIG_NAME  # unless asked for


def test_without_an_ascend_950_the_log_line_leaves_the_fp8_weights_to_vllm_ascend(vllm_ascend, monkeypatch,
                                                                                  caplog):
    vllm_ascend.DEVICE[0] = "A2"
    _register(monkeypatch, caplog)
    lines = [r.getMessage() for r in caplog.records if "GLM-5.3 is served by" in r.getMessage()]
    assert len(lines) == 1 and "FP8 weights stay with vllm-ascend (device A2" in lines[0]


# ---------------------------------------------------------------------------------------------------------
# vLLM linear layers
# ---------------------------------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _load_linear(layer, parts: list) -> None:
    """What a model's load_weights does: each checkpoint tensor to its parameter's weight loader."""
    params = dict(layer.named_parameters())
    for shard, pair in enumerate(parts):
        for name, tensor in (("weight", pair.weight), ("weight_scale_inv", pair.scale_inv)):
            args = (shard,) if len(parts) > 1 else ()
            params[name].weight_loader(params[name], tensor, *args)


@pytest.mark.parametrize("kind", ["replicated", "merged"])
def test_vllm_linear_layer_loads_fp8_and_runs_the_regrouped_mxfp8(vllm_ascend, kind):
    gen = torch.Generator().manual_seed(7)
    k = 352  # 2.75 K-blocks, 11 groups: a partial last block and an odd group count
    sizes = [200] if kind == "replicated" else [256, 72]  # partial last row block
    parts = [block_fp8(varied_weight(n, k, gen)) for n in sizes]
    # one part with power-of-two block scales: its bytes must come through unchanged
    parts[0].scale_inv = torch.pow(2.0, torch.round(torch.log2(parts[0].scale_inv)))
    x = varied_weight(5, k, gen).to(torch.bfloat16)
    config = Glm5NextMxfp8Config.from_config(FP8_CFG)
    with testing.standalone_model_parallel():
        if kind == "replicated":
            layer = _vllm.ReplicatedLinear(k, sizes[0], bias=False, quant_config=config, prefix="m.proj")
        else:
            layer = _vllm.MergedColumnParallelLinear(k, sizes, bias=False, quant_config=config,
                                                     prefix="m.gate_up_proj")
        _load_linear(layer, parts)
        testing.finish_loading(layer)
        assert not hasattr(layer, "weight_scale_inv")
        regrouped = [mxfp8.regroup(p.weight, p.scale_inv) for p in parts]
        want_w, want_s = npu.mx_weight_layout(torch.cat([w for w, _ in regrouped]),
                                              torch.cat([s for _, s in regrouped]))
        assert torch.equal(_bytes(layer.weight), _bytes(want_w)) and torch.equal(layer.weight_scale, want_s)
        assert torch.equal(_bytes(regrouped[0][0]), _bytes(parts[0].weight))  # pow2 scales: bit-exact

        y, _ = layer(x)
        want = torch.cat([mx_reference(x, p) for p in parts], dim=1)
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        exact = x.float() @ torch.cat([p.dequantize(torch.float32) for p in parts]).t()
        assert rel_err(y, exact) < 0.06
        sys.modules["torch_npu"] = fake_torch_npu.make_fake(swap_pairs=True)
        assert rel_err(layer(x)[0], want) > 0.2, "a kernel reading the scale pairs swapped must fail here"


def test_layers_the_checkpoint_keeps_in_bf16_are_not_converted(vllm_ascend):
    config = Glm5NextMxfp8Config.from_config(FP8_CFG)
    with testing.standalone_model_parallel():
        kept = _vllm.ReplicatedLinear(64, 32, bias=False, quant_config=config, prefix="m.kept_bf16")
        assert type(kept.quant_method) is _vllm.UnquantizedLinearMethod and kept.weight.dtype != torch.float8_e4m3fn
        # a layer the config calls FP8 that the checkpoint gives no scale fails loudly, not with garbage
        unlisted = _vllm.ReplicatedLinear(64, 32, bias=False, quant_config=config, prefix="m.unlisted")
        unlisted.weight.weight_loader(unlisted.weight, torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
        with pytest.raises(ValueError, match="modules_to_not_convert"):
            testing.finish_loading(unlisted)
        # a fused part ending inside a block would shift the next part's scale rows
        with pytest.raises(ValueError, match="not whole 128-row blocks"):
            _vllm.MergedColumnParallelLinear(64, [72, 128], bias=False, quant_config=config, prefix="m.gate_up_proj")


# ---------------------------------------------------------------------------------------------------------
# vLLM fused-MoE layers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["vllm", "vllm_ascend"])  # vLLM's experts layer, or vllm-ascend's subclass
def test_vllm_fused_moe_layer_loads_fp8_experts_and_runs_the_regrouped_mxfp8(vllm_ascend, owner):
    import importlib

    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_glm53.model.moe_routing import clamped_swiglu
    from vllm_glm53.quant.experts import BlockFp8Mxfp8MoEMethod

    E, D, inter, limit = 4, 96, 128, 7.0
    gen = torch.Generator().manual_seed(11)
    shapes = {"gate_proj": (inter, D), "up_proj": (inter, D), "down_proj": (D, inter)}
    ckpt = {(e, p): block_fp8(varied_weight(*shapes[p], gen)) for e in range(E) for p in shapes}
    ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]], dtype=torch.int32)
    weights = torch.rand(ids.shape, generator=gen)
    x = varied_weight(ids.shape[0], D, gen).to(torch.bfloat16)
    config = Glm5NextMxfp8Config.from_config(FP8_CFG)
    with testing.standalone_model_parallel():
        runner = _vllm.FusedMoEFactory(
            num_experts=E, top_k=2, hidden_size=D, intermediate_size=inter, quant_config=config,
            prefix="model.layers.1.mlp.experts", scoring_func="sigmoid", swiglu_limit=limit,
            custom_routing_function=lambda hidden_states, gating_output, topk, renormalize: (weights, ids),
            reduce_results=False, router_logits_dtype=torch.float32, params_dtype=torch.bfloat16,
            routed_experts_cls=None if owner == "vllm" else importlib.import_module(
                "vllm_ascend.ops.fused_moe.routed_experts").AscendRoutedExperts)
        experts = runner.routed_experts
        assert isinstance(experts.quant_method, BlockFp8Mxfp8MoEMethod)
        stems = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}
        for (e, p), pair in ckpt.items():
            stem, shard = stems[p]
            for suffix, tensor in (("weight", pair.weight), ("weight_scale_inv", pair.scale_inv)):
                param = getattr(experts, f"{stem}_{suffix}")
                experts.weight_loader(param, tensor, f"{stem}_{suffix}", shard, e)
        testing.finish_loading(runner)
        for e in range(E):
            gate_up = [mxfp8.regroup(ckpt[e, p].weight, ckpt[e, p].scale_inv) for p in ("gate_proj", "up_proj")]
            w13, s13 = npu.mx_weight_layout(torch.cat([w for w, _ in gate_up]), torch.cat([s for _, s in gate_up]))
            w2, s2 = npu.mx_weight_layout(*mxfp8.regroup(ckpt[e, "down_proj"].weight, ckpt[e, "down_proj"].scale_inv))
            assert torch.equal(_bytes(experts.w13_weight[e]), _bytes(w13))
            assert torch.equal(experts.w13_weight_scale[e], s13)
            assert torch.equal(_bytes(experts.w2_weight[e]), _bytes(w2)) and torch.equal(experts.w2_weight_scale[e], s2)

        logits = torch.zeros(ids.shape[0], E)
        with set_forward_context(None, get_current_vllm_config()):
            got = runner(hidden_states=x, router_logits=logits).float()
            want = torch.zeros(x.shape, dtype=torch.float32)
            for t in range(x.shape[0]):
                for j, e in enumerate(ids[t].tolist()):
                    up = torch.cat([mx_reference(x[t : t + 1], ckpt[e, p]) for p in ("gate_proj", "up_proj")], dim=1)
                    h = clamped_swiglu(up, limit).to(torch.bfloat16)  # the grouped matmul's output dtype
                    want[t] += weights[t, j] * mx_reference(h, ckpt[e, "down_proj"])[0]
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
            if owner == "vllm_ascend":  # tokens per local expert, for its load balancer
                assert experts.expert_tokens.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
            sys.modules["torch_npu"] = fake_torch_npu.make_fake(swap_pairs=True)
            assert rel_err(runner(hidden_states=x, router_logits=logits), want) > 0.2
