"""Native FP8 checkpoints on CPU: the plugin claims them from vLLM's Fp8Config; with the compiled kernels the
block-FP8 weights stay FP8 in memory (backends/cpu/fp8.py), without them every one is dequantized into the model
dtype while loading. Either way greedy generation matches transformers run on the same weights dequantized by
the documented formula (architecture.md §12.2), which is what the dequantize-at-load path computes: the engine
tests below check tokens and logprobs against it and, in the engine, which form the weights took."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, hf_model, probe, prompt_set, run_engine
from test_model_parity import LENGTHS, assert_parity
from vllm_glm53.quant import fp8_block
from vllm_glm53.quant.fp8 import BlockFp8Weight, Fp8Pairing, block_fp8_parts

E4M3 = torch.float8_e4m3fn


def naive_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``W[i, j] = float(W8[i, j]) * scale_inv[i // 128, j // 128]``, by full expansion of the scales."""
    n, k = weight.shape
    return weight.float() * scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _pair(n=200, k=96, seed=0) -> BlockFp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w, s = fp8_block.quantize_block_fp8(torch.randn(n, k, generator=gen))
    return BlockFp8Weight(w, s)


# ---------------------------------------------------------------------------------------------------------
# Loader pieces
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_first", [False, True])
def test_pairing_joins_weight_and_scale_in_either_order(scale_first):
    pair = _pair()
    items = [("m.weight", pair.weight), ("m.weight_scale_inv", pair.scale_inv)]
    pairing = Fp8Pairing()
    first, second = items[::-1] if scale_first else items
    assert Fp8Pairing.wants(*first) and Fp8Pairing.wants(*second)
    assert pairing.add(*first) is None
    name, got = pairing.add(*second)
    assert name == "m.weight" and got.weight is pair.weight and got.scale_inv is pair.scale_inv
    assert pairing.unpaired() == []


def test_pairing_reports_halves_left_over_and_ignores_plain_tensors():
    pairing = Fp8Pairing()
    assert not Fp8Pairing.wants("x.weight", torch.zeros(2, 2))  # BF16/fp32 weights stream straight through
    pairing.add("a.weight", _pair().weight)
    pairing.add("b.weight_scale_inv", _pair().scale_inv)
    assert pairing.unpaired() == ["a.weight (no weight_scale_inv)", "b.weight_scale_inv (no FP8 weight)"]


def test_scale_next_to_a_non_fp8_weight_is_an_error():
    pairing = Fp8Pairing()
    pairing.add("c.weight_scale_inv", torch.ones(1, 1))
    with pytest.raises(ValueError, match="weight_scale_inv next to a torch.float32 weight"):
        pairing.add("c.weight", torch.zeros(3, 3, dtype=torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_module_gets_the_weight_dequantized_to_its_own_dtype(dtype):
    pair = _pair()
    (leaf, got), = block_fp8_parts(pair, {"weight": torch.nn.Parameter(torch.empty(200, 96, dtype=dtype))})
    assert leaf == "weight" and got.dtype == dtype
    # dequantized in fp32 and rounded once to the model dtype
    torch.testing.assert_close(got, naive_dequantize(pair.weight, pair.scale_inv).to(dtype), rtol=0, atol=0)


def test_native_fp8_module_keeps_the_checkpoint_bytes():
    pair = _pair()
    params = {"weight": torch.empty(200, 96, dtype=E4M3), "weight_scale_inv": torch.empty(2, 1)}
    parts = dict(block_fp8_parts(pair, params))
    assert parts["weight"] is pair.weight and parts["weight_scale_inv"] is pair.scale_inv


def test_mxfp8_module_gets_the_regrouped_weight():
    from vllm_glm53.quant import mxfp8

    pair = _pair()
    params = {"weight": torch.empty(200, 96, dtype=E4M3), "weight_scale": torch.empty(200, 3, dtype=torch.uint8)}
    parts = dict(block_fp8_parts(pair, params))
    assert parts["weight_scale"].dtype == torch.uint8 and parts["weight_scale"].shape == (200, 3)
    # the values are the checkpoint's to within one E4M3 re-rounding (2**-4 relative), never clipped
    got = mxfp8.dequantize(parts["weight"], parts["weight_scale"])
    want = naive_dequantize(pair.weight, pair.scale_inv)
    assert ((got - want).abs() <= want.abs() * 2**-4 + 1e-30).all()


# ---------------------------------------------------------------------------------------------------------
# The claim
# ---------------------------------------------------------------------------------------------------------


def test_fp8_checkpoints_of_this_model_are_claimed_before_vllms_fp8config():
    from types import SimpleNamespace

    from vllm_glm53.quant.configs import Glm5NextFp8Config

    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    glm = SimpleNamespace(model_type="glm5_next")
    claim = Glm5NextFp8Config.override_quantization_method
    assert claim(fp8, None, hf_config=glm) == "glm5_next_fp8"
    assert claim(fp8, "fp8", hf_config=glm) == "glm5_next_fp8"
    assert claim(fp8, None, hf_config=SimpleNamespace(model_type="glm5_next_mtp")) == "glm5_next_fp8"
    assert claim(fp8, None, hf_config=SimpleNamespace(model_type="deepseek_v3")) is None
    assert claim({**fp8, "quant_method": "awq"}, None, hf_config=glm) is None
    assert claim(fp8, "awq", hf_config=glm) is None
    # float32 serving is allowed: the weights are dequantized into the model dtype
    assert torch.float32 in Glm5NextFp8Config.from_config(fp8).get_supported_act_dtypes()


# ---------------------------------------------------------------------------------------------------------
# The per-tensor plan, and the CUDA path's wiring (its kernels need a GPU; the wiring does not)
# ---------------------------------------------------------------------------------------------------------


def test_plan_takes_the_fp8_modules_from_the_checkpoint_tensors(tiny_ckpt):
    from types import SimpleNamespace

    from vllm_glm53.quant.plan import LayerQuant, _checkpoint_modules, read_checkpoint_quant

    path = tiny_ckpt("fp8", fp8=True)
    cfg = json.loads((path / "config.json").read_text())
    model_config = SimpleNamespace(model=str(path), revision=None,
                                   hf_config=SimpleNamespace(quantization_config=cfg["quantization_config"]))
    checkpoint = read_checkpoint_quant(model_config)
    scales = {n[: -len(".weight_scale_inv")].replace("model.language_model.", "model.")
              for n in load_file(str(path / "model.safetensors")) if n.endswith(".weight_scale_inv")}
    assert checkpoint.scheme == "fp8" and checkpoint.modules == scales
    plan = LayerQuant(checkpoint, "native")
    assert plan.scheme_of(_checkpoint_modules("model.layers.0.mlp.gate_up_proj")) == "fp8"
    assert plan.scheme_of(_checkpoint_modules("model.layers.1.mlp.shared_experts.down_proj")) == "fp8"
    assert plan.scheme_of(_checkpoint_modules("model.layers.0.self_attn.qkvb_proj")) is None
    assert plan.scheme_of(_checkpoint_modules("model.layers.3.self_attn.q_a_proj")) is None
    assert plan.experts_scheme("model.layers.1.mlp", 8) == "fp8"
    mixed = LayerQuant(checkpoint.__class__("fp8", frozenset({"m.gate_proj"})), "native")
    with pytest.raises(ValueError, match="only some are fp8"):
        mixed.scheme_of(_checkpoint_modules("m.gate_up_proj"))


def test_cuda_expert_wiring_through_vllms_fused_moe():
    """``FusedFp8Experts`` on vLLM's fused MoE: construction arguments, the plugin's routing as vLLM's custom
    routing function (weights already scaled), loading through vLLM's expert weight loader, and the unreduced
    output. On CPU it runs the unquantized fused method, which drops ``swiglu_limit``, so the limit is set out
    of reach here; the FP8 kernels and the clamp itself need the GPU check (scripts/gpu_check_fp8.py)."""
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_glm53 import testing
    from vllm_glm53.model.moe_routing import clamped_swiglu, route
    from vllm_glm53.quant.experts import FusedFp8Experts

    gen = torch.Generator().manual_seed(0)
    E, k, D, inter, T = 8, 2, 64, 32, 5
    bias = 0.05 * torch.randn(E, generator=gen)
    router = lambda logits: route(logits, bias, k, 1, 1, True, 2.5)  # noqa: E731
    shapes = {"gate_proj": (inter, D), "up_proj": (inter, D), "down_proj": (D, inter)}
    ckpt = {(e, p): 0.1 * torch.randn(*shapes[p], generator=gen) for e in range(E) for p in shapes}
    x, logits = torch.randn(T, D, generator=gen), torch.randn(T, E, generator=gen)
    with testing.standalone_model_parallel():
        experts = FusedFp8Experts(E, k, D, inter, 1e4, router, None, prefix="model.layers.1.mlp.experts")
        filled = {n for (e, p), w in ckpt.items() for n in experts.load(e, p, "weight", w)}
        assert filled == {n for n, _ in experts.named_parameters()}
        testing.finish_loading(experts)
        with set_forward_context(None, get_current_vllm_config()):
            got = experts(x, logits)
    weights, ids = router(logits)
    want = torch.zeros(T, D)
    for t in range(T):
        for j, e in enumerate(ids[t].tolist()):
            h = clamped_swiglu(torch.cat([x[t] @ ckpt[e, "gate_proj"].t(), x[t] @ ckpt[e, "up_proj"].t()]), 1e4)
            want[t] += weights[t, j] * (h @ ckpt[e, "down_proj"].t())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------


def dequantized_twin(src, dst):
    """A copy of FP8 checkpoint ``src`` whose FP8 weights are replaced by their float32 values, without
    ``quantization_config``: what transformers runs as the reference."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale_inv")
        out[name] = naive_dequantize(t, scale) if scale is not None else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# FP8 weights of the tiny checkpoints (layer 0 dense, layer 1 MoE, layer 3 MLA with the projections
# _quantize_attention_inputs adds) as the engine holds them, and their sizes.
FP8_PARAMS = ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
              "model.layers.1.mlp.experts.w13", "model.layers.1.mlp.experts.w2",
              "model.layers.3.self_attn.fused_qkv_a_proj.weight"]
FUSED_QKV_A = FP8_PARAMS[-1]
FP8_PROBES = [f"{p}.{a}" for p in FP8_PARAMS for a in ("dtype", "shape", "nbytes")]


def assert_weight_form(values):
    """With the compiled kernels (this process loaded them, and the engine inherits the build) every FP8 weight
    stays E4M3, one byte per value; without them it is dequantized into the model dtype (float32 here)."""
    from vllm_glm53.backends.cpu import kernels

    resident = kernels.ops() is not None
    for worker in values:
        for p in FP8_PARAMS:
            numel = math.prod(int(n) for n in re.findall(r"\d+", worker[f"{p}.shape"]))
            assert worker[f"{p}.dtype"] == ("torch.float8_e4m3fn" if resident else "torch.float32"), (p, worker)
            assert int(worker[f"{p}.nbytes"]) == numel * (1 if resident else 4), (p, worker)


# Dimensions spanning several 128-blocks with a ragged last block in both directions, and grids that are not
# square: dense MLP [200, 320] / [320, 200] (scale grids 2x3 / 3x2), experts [72, 320] / [320, 72] (1x3 / 3x1);
# MLA q_a [200, 320] and kv_a [128, 320]: the fused q_a | kv_a layer's two FP8 parts, the first ragged.
RAGGED = {"hidden_size": 320, "intermediate_size": 200, "moe_intermediate_size": 72, "q_lora_rank": 200,
          "kv_lora_rank": 128}

# Projections of the hidden state that the released checkpoint may store in FP8 too (architecture.md §12.2) and
# the tiny builder leaves in bfloat16. The serving model fuses each group into one layer: q_a | kv_a stays FP8
# (whole blocks per part), the indexer's wk is dequantized into its unquantized wk | gate | weights_proj layer (as
# vLLM serves it), and KDA's f_a | g_a parts (16 rows each here) share a block row and are dequantized at load.
ATTENTION_INPUTS = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.indexer.wk",
                    "self_attn.f_a_proj", "self_attn.g_a_proj")


def _quantize_attention_inputs(path):
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(tuple(f"{m}.weight" for m in ATTENTION_INPUTS))]:
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        tensors[name], tensors[scale_name] = fp8_block.quantize_block_fp8(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _vary_block_scales(path, seed=0):
    """Multiply every block scale of FP8 checkpoint ``path`` by its own power of two in [1/4, 4]: blocks of one
    weight then differ in magnitude by up to 16x, so reading a neighbour's scale (a ragged block, a swapped
    axis, an off-by-one) changes the weights by far more than FP8 rounding does. Exact: powers of two."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            tensors[name] = t * torch.pow(2.0, torch.randint(-2, 3, t.shape, generator=gen).float())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def ragged_fp8_case(tiny_ckpt, tmp_path, overrides=RAGGED):
    """The flat-layout FP8 checkpoint of RAGGED sizes (or ``overrides``) with its attention inputs in FP8 too and
    varied block scales, some prompts, and transformers' greedy tokens on its dequantized twin:
    ``(path, prompts, want)``."""
    path = tmp_path / "fp8-ragged"
    name = "fp8-ragged" + "".join(f"-{k}{v}" for k, v in overrides.items() if RAGGED.get(k) != v)
    shutil.copytree(tiny_ckpt(name, fp8=True, overrides=overrides, seed=3, layout="flat"), path)
    _quantize_attention_inputs(path)
    _vary_block_scales(path)
    prompts = prompt_set(path, LENGTHS[::2])
    return path, prompts, hf_greedy(hf_model(dequantized_twin(path, tmp_path / "twin")), prompts, 12)


@pytest.mark.engine
def test_fp8_weights_of_several_ragged_blocks_match_the_dequantized_reference(tiny_ckpt, tmp_path):
    """Also the flat checkpoint layout (``model.layers.*``, ``Glm5NextForCausalLM``): its loader path and the
    transformers class that serves it; and FP8 attention-input projections in each form their fused layers take."""
    path, prompts, want = ragged_fp8_case(tiny_ckpt, tmp_path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Glm5NextForCausalLM"]
    tensors = load_file(str(path / "model.safetensors"))
    grids = {tuple(t.shape) for n, t in tensors.items() if n.endswith(".weight_scale_inv")}
    assert {(2, 3), (3, 2), (1, 3), (3, 1)} <= grids, grids  # several blocks, ragged, both orientations
    got, values = run_engine(path, prompts, 12, logprobs=1, probe=probe("model_attributes", paths=FP8_PROBES))
    assert_weight_form(values)
    assert_parity(got, want)


@pytest.mark.engine
def test_fp8_fused_attention_inputs_under_tensor_parallel_2(tiny_ckpt, tmp_path):
    """The ragged FP8 checkpoint on two TP ranks: the fused layers of the attention inputs stay whole on every rank
    (``disable_tp``) in each weight form, next to the experts' and the shared expert's slices (dequantized at load
    here: a rank's 36 intermediate rows start inside a block). The dense MLP's intermediate size is 256 here, so
    each rank's half is whole blocks and stays FP8: at decode it runs as one call (quant/linear.py's fp8_mlp) whose
    partial sum the MLP all-reduces itself."""
    dense = "model.layers.0.mlp.gate_up_proj.weight.dtype"
    path, prompts, want = ragged_fp8_case(tiny_ckpt, tmp_path, {**RAGGED, "intermediate_size": 256})
    got, values = run_engine(path, prompts, 12, logprobs=1, engine={"tensor_parallel_size": 2},
                             env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                             probe=probe("model_attributes", paths=[f"{FUSED_QKV_A}.dtype", dense]))
    from vllm_glm53.backends.cpu import kernels

    form = "torch.float8_e4m3fn" if kernels.ops() is not None else "torch.float32"
    assert [v[f"{FUSED_QKV_A}.dtype"] for v in values] == [form, form], values
    assert [v[dense] for v in values] == [form, form], values
    assert_parity(got, want)
