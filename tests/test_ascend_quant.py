"""The Ascend code paths on CPU, with a numerical fake of ``torch_npu`` (tests/fake_torch_npu.py).

* MXFP8 (Ascend 950): the plugin's MX linear layer and expert stack, fed a block-FP8 checkpoint, give what
  "dequantize the re-grouped weight and the 1x32-quantized activations, then matmul" gives; a fake that reads
  the scale pairs in swapped order makes the same comparison fail.
* w8a8 (A2/A3): the msmodelslim format the tiny builder writes, the plain-torch reference of the w8a8 matmul
  against a slow integer formula, and the whole tiny w8a8 checkpoint, loaded through the plugin with
  ``--quantization ascend``, on the NPU code path against the reference path.

No test imports a real ``torch_npu``: the fake goes into ``sys.modules`` for one test at a time, together
with a patched platform query (the plugin asks ``_vllm.platform_kind()``).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

import fake_torch_npu
from vllm_glm53 import _vllm
from vllm_glm53.quant import fp8_block, mxfp8, npu, w8a8
from vllm_glm53.quant.fp8 import BlockFp8Weight, block_fp8_parts
from vllm_glm53.quant.plan import CheckpointQuant, LayerQuant

torch.set_num_threads(2)


@pytest.fixture
def on_npu(monkeypatch):
    """Run the plugin as on Ascend with the numerical fake; returns a function to swap in another fake."""

    def use(fake):
        monkeypatch.setitem(sys.modules, "torch_npu", fake)

    monkeypatch.setattr(_vllm, "platform_kind", lambda: "npu")
    use(fake_torch_npu.make_fake())
    return use


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def varied_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian weights whose 1x32 groups along K differ in magnitude by up to 2**+-3, so that neighbouring
    groups get different exponents (a swapped pair then decodes to wrong values)."""
    group_scale = torch.pow(2.0, torch.randint(-3, 4, (math.ceil(k / 32),), generator=gen).float())
    return torch.randn(n, k, generator=gen) * group_scale.repeat_interleave(32)[:k]


def block_fp8(w: torch.Tensor) -> BlockFp8Weight:
    return BlockFp8Weight(*fp8_block.quantize_block_fp8(w))


def decode_tokens(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """MX activations ``[M, K]`` with pair-packed scales ``[M, ceil(K/64), 2]`` -> float32, by the format."""
    k = xq.shape[-1]
    g = torch.arange(k) // 32
    return xq.float() * torch.pow(2.0, xs[:, g // 2, g % 2].float() - 127)


def mx_reference(x: torch.Tensor, pair: BlockFp8Weight) -> torch.Tensor:
    """Dequantize-then-matmul: the activations as the op quantizes them, the weight as re-grouped."""
    xq, xs = npu.mx_quantize_activations(x)
    return decode_tokens(xq, xs) @ mxfp8.dequantize(*pair.to_mxfp8()).t()


# ---------------------------------------------------------------------------------------------------------
# MXFP8 linear layer
# ---------------------------------------------------------------------------------------------------------


def test_scale_packing_follows_the_pair_layout():
    scale = torch.arange(5 * 3, dtype=torch.uint8).reshape(5, 3)  # 5 rows, 3 groups -> padded to 4
    packed = npu.pack_mx_scale(scale)
    assert packed.shape == (2, 5, 2) and packed.is_contiguous()
    for r in range(5):
        for g in range(4):
            assert packed[g // 2, r, g % 2] == (scale[r, g] if g < 3 else 0)


# The documented MX arithmetic (hicann/ops-nn quant/dynamic_mx_quant/docs/aclnnDynamicMxQuant_en.md, cited in
# fake_torch_npu): one row, five 32-element groups whose largest magnitudes are below; the scale bytes each
# scaleAlg gives, worked out by hand from the two formulas (scaleAlg 0: floor(log2 amax) - 8; scaleAlg 1:
# amax / 448, exponent rounded up when the mantissa is not zero), then + 127.
DOC_AMAX = [448.0, 449.0, 1.0, 0.875 * 2**-3, 3.0]
DOC_BYTES = {0: [127, 127, 119, 115, 120], 1: [127, 128, 119, 115, 120]}


@pytest.mark.parametrize("scale_alg", [0, 1])
def test_fake_mx_quantizer_follows_the_documented_formulas_and_layout(scale_alg):
    x = torch.zeros(1, 32 * len(DOC_AMAX))
    for g, amax in enumerate(DOC_AMAX):
        x[0, 32 * g] = -amax  # the group's largest magnitude, negative: the rule takes |x|
        x[0, 32 * g + 1] = amax / 4
    q, scale = fake_torch_npu.make_fake().npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=scale_alg)
    assert scale.shape == (1, 3, 2) and scale.dtype == torch.uint8  # (ceil(5 / 2), 2): pairs along K, padded
    assert [int(scale[0, g // 2, g % 2]) for g in range(5)] == DOC_BYTES[scale_alg]
    assert scale[0, 2, 1] == 0  # the documented padding value
    # -449: scaleAlg 0 (scale 1) saturates it to E4M3's -448; scaleAlg 1 (scale 2) stores -224.5 rounded, -224
    assert q[0, 32].float() == (-448.0 if scale_alg == 0 else -224.0)
    weight = x.t().repeat(1, 3)  # a (k, n) weight quantized along k: scales (ceil(k/64), n, 2), rows interleaved
    _, wscale = fake_torch_npu.make_fake().npu_dynamic_mx_quant(weight, axis=0, dst_type=torch.float8_e4m3fn,
                                                                scale_alg=scale_alg)
    assert wscale.shape == (3, 3, 2)
    assert all(int(wscale[g // 2, n, g % 2]) == DOC_BYTES[scale_alg][g] for g in range(5) for n in range(3))


def test_plugin_weight_scales_are_laid_out_as_the_op_lays_out_a_weight_quantized_along_k():
    """The plugin's kernel-side weight scale bytes (regroup, then pack_mx_scale) equal, byte for byte and place
    for place, what the documented ``npu_dynamic_mx_quant`` gives for the same weight in the kernel's ``(k, n)``
    form quantized along k, on a weight whose every 32-group has a different power-of-two magnitude (so both
    choose the same exponents and any other placement shows)."""
    gen = torch.Generator().manual_seed(4)
    n, k = 6, 224  # 7 groups along k: three pairs and a padded one
    exps = torch.randint(-4, 4, (n, k // 32), generator=gen)
    w = torch.rand(n, k, generator=gen) * 200.0
    # each group's largest magnitude is 0.9 * 448 * 2**e: block scales are then not powers of two, so the plugin
    # re-groups per 32 elements (its exact path keeps one exponent per 128-block), and both rules pick e
    w[:, ::32] = 0.9 * 448.0
    w = w * torch.pow(2.0, exps.float()).repeat_interleave(32, dim=1)
    pair = block_fp8(w)
    weight_kn, packed = npu.mx_weight_layout(*mxfp8.regroup(pair.weight, pair.scale_inv))
    _, documented = fake_torch_npu.make_fake().npu_dynamic_mx_quant(
        mxfp8.dequantize(*mxfp8.regroup(pair.weight, pair.scale_inv)).t(), axis=0, dst_type=torch.float8_e4m3fn,
        scale_alg=1)
    assert weight_kn.shape == (k, n) and packed.shape == documented.shape == (4, n, 2)
    assert torch.equal(packed, documented)
    assert len(set(exps.flatten().tolist())) > 4  # the groups really differ


def _mx_gate_up_layer(k: int, sizes: list[int], weights: list[BlockFp8Weight]):
    plan = LayerQuant(CheckpointQuant("fp8", frozenset({"m.gate_proj", "m.up_proj"})), "npu")
    layer = _vllm.MergedColumnParallelLinear(k, sizes, bias=False, quant_config=plan, prefix="m.gate_up_proj")
    params = dict(layer.named_parameters())
    for shard, pair in enumerate(weights):
        for leaf, tensor in block_fp8_parts(pair, params):
            params[leaf].weight_loader(params[leaf], tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("k", [96, 256])  # 3 groups (odd: padded pair) and 8 groups
def test_mxfp8_linear_matches_dequantize_then_matmul(on_npu, k):
    gen = torch.Generator().manual_seed(k)
    sizes = [40, 24]
    weights = [block_fp8(varied_weight(n, k, gen)) for n in sizes]
    x = varied_weight(7, k, gen).to(torch.bfloat16)
    with _vllm.standalone_model_parallel():
        layer = _mx_gate_up_layer(k, sizes, weights)
        assert layer.weight.shape == (k, sum(sizes)) and layer.weight_scale.shape == (math.ceil(k / 64), 64, 2)
        y, _ = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (7, 64)
        want = torch.cat([mx_reference(x, w) for w in weights], dim=1)
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        # and both stay close to the checkpoint's own values (weight and activation re-rounding only)
        exact = x.float() @ torch.cat([w.dequantize(torch.float32) for w in weights]).t()
        assert rel_err(y, exact) < 0.06

        on_npu(fake_torch_npu.make_fake(swap_pairs=True))
        swapped, _ = layer(x)
        assert rel_err(swapped, want) > 0.2, "a kernel reading the scale pairs swapped must not pass this test"


def test_mxfp8_linear_rejects_reduction_sizes_that_are_not_whole_groups(on_npu):
    with _vllm.standalone_model_parallel(), pytest.raises(ValueError, match="multiple of 32"):
        _mx_gate_up_layer(80, [16, 16], [])


# ---------------------------------------------------------------------------------------------------------
# MXFP8 experts
# ---------------------------------------------------------------------------------------------------------


def _mx_experts(E=4, D=64, inter=32, seed=0):
    from vllm_glm53.quant.experts import Mxfp8Experts

    gen = torch.Generator().manual_seed(seed)
    ckpt = {(e, p): block_fp8(varied_weight(*((D, inter) if p == "down_proj" else (inter, D)), gen))
            for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]])
    weights = torch.rand(ids.shape, generator=gen)
    router = lambda logits: (weights, ids)  # noqa: E731 - routing is not under test here
    experts = Mxfp8Experts(E, D, inter, tp_rank=0, swiglu_limit=7.0, router=router)
    for (e, p), pair in ckpt.items():
        experts.load(e, p, "weight", pair)
    x = varied_weight(ids.shape[0], D, gen)
    return experts, ckpt, x, weights, ids


def test_mxfp8_experts_match_dequantize_then_matmul_per_expert(on_npu):
    from vllm_glm53.model.moe_routing import clamped_swiglu

    experts, ckpt, x, weights, ids = _mx_experts()
    got = experts(x, router_logits=None)
    want = torch.zeros_like(got)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            up = torch.cat([mx_reference(x[t : t + 1], ckpt[e, "gate_proj"]),
                            mx_reference(x[t : t + 1], ckpt[e, "up_proj"])], dim=1)
            h = clamped_swiglu(up, 7.0)
            want[t] += weights[t, j] * mx_reference(h, ckpt[e, "down_proj"])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    on_npu(fake_torch_npu.make_fake(swap_pairs=True))
    assert rel_err(experts(x, router_logits=None), want) > 0.2


# ---------------------------------------------------------------------------------------------------------
# w8a8: format and reference numerics
# ---------------------------------------------------------------------------------------------------------


def test_w8a8_reference_matmul_is_the_integer_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, generator=gen)
    wq, ws, offset = w8a8.quantize_weight(torch.randn(5, 40, generator=gen))
    assert wq.dtype == torch.int8 and ws.shape == (5, 1) and not offset.any()
    got = w8a8.w8a8_matmul(x, wq.t(), ws.reshape(-1))
    for m in range(3):
        amax = max(abs(v) for v in x[m].tolist())
        xs = amax / 127
        xq = [max(-127, min(127, round(v / xs))) for v in x[m].tolist()]  # Python round: half to even
        for n in range(5):
            acc = sum(a * b for a, b in zip(xq, wq[n].tolist()))
            want = acc * xs * ws[n, 0].item()
            assert abs(got[m, n].item() - want) <= 1e-5 * max(1.0, abs(want))


def test_w8a8_weight_quantization_is_symmetric_per_channel():
    w = torch.randn(6, 33, generator=torch.Generator().manual_seed(4))
    w[2] = 0
    q, s, _ = w8a8.quantize_weight(w)
    assert q.abs().max() == 127 and s[2, 0] == 1 and not q[2].any()
    assert ((q.float() * s - w).abs() <= s / 2 + 1e-7).all()


def test_description_parsing():
    desc = {"version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC", "group_size": 0, "is_rot_used": True,
            "metadata": {}, "a.mlp.gate_proj.weight": "W8A8_DYNAMIC", "a.mlp.gate_proj.weight_scale": "W8A8_DYNAMIC",
            "a.self_attn.o_proj.weight": "FLOAT", "lm_head.weight": "FLOAT"}
    assert w8a8.quantized_modules(desc) == {"a.mlp.gate_proj"}
    with pytest.raises(ValueError, match="W4A8_DYNAMIC"):
        w8a8.quantized_modules({**desc, "a.mlp.up_proj.weight": "W4A8_DYNAMIC"})


@pytest.fixture(scope="module")
def w8a8_ckpt(tiny_ckpt):
    return tiny_ckpt("w8a8", w8a8=True, seed=5)


def test_tiny_w8a8_checkpoint_has_the_msmodelslim_layout(w8a8_ckpt, tiny_ckpt):
    cfg = json.loads((w8a8_ckpt / "config.json").read_text())
    assert "quantization_config" not in cfg
    desc = json.loads((w8a8_ckpt / w8a8.DESCRIPTION_FILE).read_text())
    tensors = load_file(str(w8a8_ckpt / "quant_model_weights.safetensors"))
    index = json.loads((w8a8_ckpt / "quant_model_weights.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) | {"rot.weight"}
    assert set(tensors) | {"rot.weight"} <= set(desc)  # the description names every tensor
    modules = w8a8.quantized_modules(desc)
    assert modules and all(".mlp." in m and "visual" not in m for m in modules)
    assert any(".layers.5.mlp.experts." in m for m in modules)  # the MTP layer's experts too
    reference = load_file(str(tiny_ckpt("w8a8-float", seed=5) / "model.safetensors"))
    for m in modules:
        q, s = tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"]
        assert q.dtype == torch.int8 and s.shape == (q.shape[0], 1) and not tensors[f"{m}.weight_offset"].any()
        assert ((q.float() * s - reference[f"{m}.weight"]).abs() <= s / 2 + 1e-6).all()
    # QuaRot's folding of the final norm weight w: into lm_head, out of the MTP layer's shared_head.norm (it
    # feeds the same lm_head), back in through rot = Q^T diag(w) Q with Q = I
    text = "model.language_model."
    w = reference[text + "norm.weight"]
    folded = {text + "norm.weight": torch.ones_like(w), "lm_head.weight": reference["lm_head.weight"] * w,
              text + "layers.5.shared_head.norm.weight": reference[text + "layers.5.shared_head.norm.weight"] / w}
    for name, t in tensors.items():  # everything else is stored unchanged
        if name.rpartition(".")[0] not in modules:
            assert desc[name] == "FLOAT" and torch.equal(t, folded.get(name, reference[name])), name
    rot = load_file(str(w8a8_ckpt / "rot.safetensors"))["rot.weight"]
    assert torch.equal(rot, torch.diag(w))


# ---------------------------------------------------------------------------------------------------------
# Whole tiny checkpoints, built and run in-process (no engine): NPU code path vs reference path
# ---------------------------------------------------------------------------------------------------------


def _engine_config(path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(path), dtype="float32", max_model_len=512, enforce_eager=True,
                      enable_prefix_caching=False, limit_mm_per_prompt={"image": 0, "video": 0}, **kwargs)
    return args.create_engine_config()


def _build(config, path):
    """The plugin's model for ``config`` on the current platform, with ``path`` loaded as vLLM loads it."""
    import glob

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from vllm_glm53.model import Glm5NextForConditionalGeneration

    config.compilation_config.static_forward_context.clear()  # layers register their names while built
    with set_current_vllm_config(config):
        model = Glm5NextForConditionalGeneration(vllm_config=config)
        files = sorted(glob.glob(f"{path}/*.safetensors"))
        model.load_weights(safetensors_weights_iterator(files, False))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def _run(model, config, ids: torch.Tensor):
    """One prefill of ``ids``: ``(logits, {layer: (input, output) of its MLP block})``."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    seen = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, (args[0], out)))
             for i, layer in enumerate(model.model.layers)]
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(ids.shape[0])))
    for hook in hooks:
        hook.remove()
    return logits, seen


@pytest.fixture(scope="module")
def prompt():
    return torch.tensor([5, 17, 30, 44, 81, 9, 120, 33, 2, 250, 64, 7])


def test_w8a8_checkpoint_on_the_npu_path_matches_the_reference(w8a8_ckpt, prompt, on_npu, monkeypatch):
    config = _engine_config(w8a8_ckpt, quantization="ascend")
    assert config.quant_config.get_name() == "ascend" and config.quant_config.modules
    with _vllm.standalone_model_parallel():
        npu_model = _build(config, w8a8_ckpt)
        assert all(type(layer.mlp.experts).__name__ == "W8A8Experts" for layer in npu_model.model.layers[1:])
        npu_logits, _ = _run(npu_model, config, prompt)
        monkeypatch.setattr(_vllm, "platform_kind", lambda: "cpu")
        monkeypatch.delitem(sys.modules, "torch_npu")  # the reference path must not touch it
        ref_logits, _ = _run(_build(config, w8a8_ckpt), config, prompt)
    torch.testing.assert_close(npu_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert ref_logits.std() > 0.1  # a live model, not constant logits


def test_fp8_checkpoint_on_the_mxfp8_path_stays_close_to_the_dequantized_model(tiny_ckpt, prompt, on_npu,
                                                                               monkeypatch):
    """Every MLP block of the MXFP8-loaded model (dense, shared and routed experts) against the same block of
    the dequantized model, on the inputs the dequantized model gives it. Whole-model logits are no measure
    here: a tiny random model amplifies the ~6 % block error far beyond anything a layout bug would need."""
    path = tiny_ckpt("fp8", fp8=True)
    config = _engine_config(path)
    assert config.quant_config.get_name() == "glm5_next_fp8"
    with _vllm.standalone_model_parallel():
        mx_model = _build(config, path)
        assert type(mx_model.model.layers[1].mlp.experts).__name__ == "Mxfp8Experts"
        monkeypatch.setattr(_vllm, "platform_kind", lambda: "cpu")
        _, blocks = _run(_build(config, path), config, prompt)
        with torch.no_grad():
            # MXFP8 re-rounds each quantized weight and activation once more (~2.7 % each, ascend.md §2.4)
            # in each of a block's two GEMMs
            errors = [rel_err(mx_model.model.layers[i].mlp(x), y) for i, (x, y) in blocks.items()]
            assert len(errors) == len(mx_model.model.layers) and max(errors) < 0.1, errors
            on_npu(fake_torch_npu.make_fake(swap_pairs=True))
            swapped = [rel_err(mx_model.model.layers[i].mlp(x), y) for i, (x, y) in blocks.items()]
            assert min(swapped) > 0.5, swapped


# ---------------------------------------------------------------------------------------------------------
# Registration on Ascend: no name is registered twice, and a GLM5Next-aware vllm-ascend serves the model
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def ascend_modules(monkeypatch):
    """Pretend to be on an NPU with vllm-ascend installed; the returned set holds the vllm-ascend modules that
    exist (add ``vllm_ascend.models.glm5_next`` for a GLM5Next-aware build)."""
    import importlib.machinery
    import importlib.util

    present = {"vllm_ascend"}
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return importlib.machinery.ModuleSpec(name, None) if name in present else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(_vllm, "platform_kind", lambda: "npu")
    return present


FP8_CFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _serving_state(caplog, monkeypatch):
    """register() afresh on the (faked) NPU; the registry entry, what it registered, and the FP8 claim."""
    from types import SimpleNamespace

    from vllm import ModelRegistry

    import vllm_glm53
    from vllm_glm53.quant import configs

    monkeypatch.setattr(_vllm, "platform_kind", lambda: "npu")
    monkeypatch.setattr(vllm_glm53, "_registered", None)
    with caplog.at_level("INFO", logger="vllm_glm53"):
        registered = vllm_glm53.register()
    claim = configs.Glm5NextFp8Config.override_quantization_method(
        FP8_CFG, None, hf_config=SimpleNamespace(model_type="glm5_next"))
    return ModelRegistry.models.get("Glm5NextForCausalLM"), registered, claim


def test_vllm_ascend_registered_first_keeps_the_model_and_the_fp8_checkpoint(ascend_modules, monkeypatch, caplog):
    from types import SimpleNamespace

    from vllm import ModelRegistry

    theirs = SimpleNamespace(module_name="vllm_ascend.models.glm5_next", class_name="Glm5NextForCausalLM")
    monkeypatch.setitem(ModelRegistry.models, "Glm5NextForCausalLM", theirs)
    entry, registered, claim = _serving_state(caplog, monkeypatch)
    assert entry is theirs  # not overwritten
    assert claim is None  # vllm-ascend's own fp8 config takes the checkpoint
    assert "quantization ascend" not in registered  # vllm-ascend owns that name
    assert "quantization glm5_next_mxfp8" in registered  # the plugin's re-grouping for vllm-ascend's model
    assert "served by vllm-ascend's GLM5Next: the installed vllm-ascend ships it (vllm_ascend.models.glm5_next)" in caplog.text


def test_vllm_ascend_registering_later_is_seen_from_its_model_module(ascend_modules, monkeypatch, caplog):
    from vllm import ModelRegistry

    ascend_modules.add("vllm_ascend.models.glm5_next")
    monkeypatch.setitem(ModelRegistry.models, "Glm5NextForCausalLM", ModelRegistry.models["Glm5NextForCausalLM"])
    monkeypatch.delitem(ModelRegistry.models, "Glm5NextForCausalLM")
    entry, _, claim = _serving_state(caplog, monkeypatch)
    assert entry is None and claim is None  # nothing registered: vllm-ascend's registration will come
    assert "served by vllm-ascend's GLM5Next" in caplog.text


def test_vllm_ascend_without_glm5next_leaves_the_model_to_the_plugin(ascend_modules, monkeypatch, caplog):
    from vllm import ModelRegistry

    monkeypatch.setitem(ModelRegistry.models, "Glm5NextForCausalLM", ModelRegistry.models["Glm5NextForCausalLM"])
    entry, registered, claim = _serving_state(caplog, monkeypatch)
    assert entry.module_name == "vllm_glm53.model" and claim == "glm5_next_fp8"
    assert "quantization ascend" not in registered and "quantization glm5_next_mxfp8" not in registered
    assert "served by the plugin's model (vllm_glm53.model): vLLM's own GLM5Next cannot run on npu" in caplog.text


# ---------------------------------------------------------------------------------------------------------
# w8a8 with QuaRot: the MTP layer's input rotation (rot.weight)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rotated_w8a8_ckpt(w8a8_ckpt, tmp_path_factory):
    """The tiny w8a8 checkpoint with its MTP layer rotated by a random orthogonal Q (tiny.rotate_w8a8_mtp)."""
    import shutil

    from vllm_glm53.tiny import rotate_w8a8_mtp

    path = tmp_path_factory.mktemp("rotated") / "w8a8-rot"
    shutil.copytree(w8a8_ckpt, path)
    rotate_w8a8_mtp(path, seed=3)
    return path


def _mtp_steps(path, ids, hidden):
    """The plugin's MTP model on ``path`` (built and loaded as vLLM does, the target's embedding installed as
    vLLM's proposer installs it): two draft steps, the second fed the first's output. Returns both outputs."""
    import glob

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from vllm_glm53.model.mtp import Glm5NextMTPModel

    config = _engine_config(path, quantization="ascend")
    config.compilation_config.static_forward_context.clear()
    tensors = load_file(str(path / "quant_model_weights.safetensors"))
    with set_current_vllm_config(config):
        model = Glm5NextMTPModel(vllm_config=config)
        files = sorted(glob.glob(f"{path}/*.safetensors"))
        model.load_weights(safetensors_weights_iterator(files, False))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        model.model.embed_tokens = torch.nn.Embedding.from_pretrained(
            tensors["model.language_model.embed_tokens.weight"])
        positions = torch.arange(1, ids.shape[0] + 1)
        with set_forward_context(None, config), torch.no_grad():
            h1, _ = model(ids, positions, hidden, spec_step_idx=0)
            h2, _ = model(ids.roll(1), positions + 1, h1, spec_step_idx=1)
    return model, h1, h2


def test_w8a8_mtp_rotation_is_loaded_and_applied(w8a8_ckpt, rotated_w8a8_ckpt, prompt):
    """The rotated checkpoint's MTP layer computes what the unrotated one computes, on the first draft step
    (from the target's hidden state) and on the next (from its own output), only if ``rot.weight`` is loaded
    and applied as ``h @ rot^T`` on every step: Q^T diag(w) is not symmetric, and the layer's ``eh_proj``
    expects the rotated basis. Measured difference 2.4e-6 of values ~1 (float32 rounding of the folded Q)."""
    hidden = torch.randn(prompt.shape[0], 64, generator=torch.Generator().manual_seed(0))
    with _vllm.standalone_model_parallel():
        plain, want1, want2 = _mtp_steps(w8a8_ckpt, prompt, hidden)
        rotated, got1, got2 = _mtp_steps(rotated_w8a8_ckpt, prompt, hidden)
    rot = load_file(str(rotated_w8a8_ckpt / "rot.safetensors"))["rot.weight"]
    assert not torch.allclose(rot, rot.t(), atol=1e-3)  # a transposed application would show
    assert plain.rot is not None and rotated.rot is not None  # is_rot_used declares it
    print(f"rotated vs unrotated MTP: max |diff| {(got1 - want1).abs().max():.2e} (step 1), "
          f"{(got2 - want2).abs().max():.2e} (step 2)")
    torch.testing.assert_close(got1, want1, rtol=0, atol=1e-5)
    torch.testing.assert_close(got2, want2, rtol=0, atol=1e-5)
    assert (got2 - got1).abs().max() > 0.1  # the two steps differ: the second really used the first's output


@pytest.mark.engine
def test_mtp_on_a_rotated_w8a8_checkpoint_keeps_greedy_outputs(rotated_w8a8_ckpt, prompt):
    """MTP speculation in the engine on the rotated w8a8 checkpoint gives the greedy tokens of the plugin's
    reference path run in-process without speculation (a full prefill per token)."""
    from conftest import prompt_set, run_engine

    prompts = prompt_set(rotated_w8a8_ckpt, [6, 40])
    config = _engine_config(rotated_w8a8_ckpt, quantization="ascend")
    want = []
    with _vllm.standalone_model_parallel():
        model = _build(config, rotated_w8a8_ckpt)
        for p in prompts:
            ids = list(p)
            for _ in range(10):
                logits, _ = _run(model, config, torch.tensor(ids))
                ids.append(int(logits[-1].argmax()))
            want.append(ids[len(p):])
    got = run_engine(rotated_w8a8_ckpt, prompts, 10, ignore_eos=True, engine={
        "quantization": "ascend", "enable_prefix_caching": False,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    assert [g["token_ids"] for g in got] == want
