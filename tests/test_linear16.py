"""Linear layers with 16-bit weights on CPUs without native 16-bit arithmetic (backends/cpu/linear.py,
csrc/linear.cpp): the compiled ``linear16`` against a float64 product of the same weights, on its three paths
(direct: at most 2 x kTok tokens; tile: up to 31; panels: 32 or more, several panels when the weight is larger
than one), and the hand-over of vLLM's CPU linear layers to it after loading.

Outputs are compared in units of ``ulp(max|reference|)`` as in test_cpu_kernels.py; each tolerance is about 4x the
largest error measured on the avx2 and the portable path. Every instruction set this CPU runs is checked:
``test_other_instruction_sets`` runs this module again in a subprocess for each path other than the loaded one.
The engine side (a bfloat16 checkpoint served through these kernels gives transformers' tokens) is
test_model_parity.py's bfloat16 test, whose layers take the kernel on CPUs without native bfloat16.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernel_isas import ops, other_isas, rerun_on
from test_cpu_kernels import F32_ULPS, _close, _gen
from vllm_glm53 import _vllm, testing
from vllm_glm53.backends import dispatch
from vllm_glm53.backends.cpu import linear as linear_ops

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("compiled_kernels")


@pytest.mark.parametrize("isa", other_isas())
def test_other_instruction_sets(isa):
    rerun_on(isa, __file__, "other_instruction_sets or layers")


def _weight(n: int, k: int, dtype: torch.dtype, gen) -> torch.Tensor:
    """Rows of different magnitudes (1/4 to 4): a row read for its neighbour changes the output far beyond the
    tolerances."""
    scale = torch.pow(2.0, torch.randint(-2, 3, (n, 1), generator=gen).float())
    return (torch.randn(n, k, generator=gen) * scale / k**0.5).to(dtype)


def _want(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().t()).float()


# (N, K): one task; ragged rows and a K off the lane groups; a weight larger than one panel (K = 512: 2,048 rows a
# panel), its last panel and last task ragged; a K of three column chunks of the tile path (512 each), the last
# one ragged and off the lane groups.
SHAPES = [(16, 64), (37, 100), (4200, 512), (40, 1100)]


@pytest.mark.parametrize("N,K", SHAPES)
# direct up to 4 (avx2) / 8 (avx512); tile below 256 (avx2, avx512) / 32 (portable); panels
@pytest.mark.parametrize("M", [1, 3, 5, 16, 31, 40, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear16_matches_the_widened_product(dtype, M, N, K):
    gen = _gen(M * 1000 + N + K)
    weight = _weight(N, K, dtype, gen)
    x = torch.randn(M, K + 6, generator=gen)[:, 3 : 3 + K]  # a strided view
    got = ops.linear16(x, weight)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    # measured (ulps of max|reference|, avx2 / portable): 2.9 / 2.9
    _close(got.double(), _want(x, weight).double(), ulps=12 * F32_ULPS)


@pytest.mark.parametrize("M", [2, 16, 40, 256])
def test_linear16_in_bfloat16_activations(M):
    """bfloat16 tokens and weights: the float32 sums rounded once to bfloat16."""
    gen = _gen(11 + M)
    weight = _weight(300, 256, torch.bfloat16, gen)
    x = torch.randn(M, 256, generator=gen).bfloat16()
    got = ops.linear16(x, weight)
    assert got.dtype == torch.bfloat16
    # measured (bfloat16 ulps of max|reference|, avx2 / portable): 0.5 / 0.5 (one rounding of nearly equal sums)
    _close(got, _want(x, weight).bfloat16(), ulps=1)


def test_linear16_reads_a_weight_with_strided_rows():
    gen = _gen(5)
    weight = _weight(64, 200, torch.bfloat16, gen)
    padded = torch.zeros(64, 208, dtype=torch.bfloat16)
    padded[:, :200] = weight
    x = torch.randn(40, 200, generator=gen)
    for m in (1, 16, 40):
        _close(ops.linear16(x[:m], padded[:, :200]).double(), _want(x[:m], weight).double(), ulps=12 * F32_ULPS)


def test_linear16_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        ops.linear16(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="8 columns for 6 inputs"):
        ops.linear16(torch.randn(2, 6), torch.randn(4, 8).bfloat16())
    assert ops.linear16(torch.randn(0, 8), torch.randn(4, 8).bfloat16()).shape == (0, 4)


def test_the_op_takes_the_kernel_and_keeps_the_torch_reference():
    gen = _gen(9)
    weight, x = _weight(48, 64, torch.bfloat16, gen), torch.randn(7, 64, generator=gen)
    got = linear_ops.linear16(x, weight)
    assert ("linear16", "compiled", ()) in dispatch.decisions()
    _close(got.double(), linear_ops.linear16_torch(x, weight).double(), ulps=12 * F32_ULPS)
    assert "needs bfloat16 or float16" in linear_ops._linear16_check(x, weight.float())


# ---------------------------------------------------------------------------------------------------------
# vLLM's CPU linear layers after loading
# ---------------------------------------------------------------------------------------------------------


def _loaded_layers(dtype: torch.dtype):
    """A replicated linear with a bias and a column-parallel one without, loaded and post-processed as vLLM's
    loader does (its CPU dispatch sets each layer's ``cpu_linear``) on a CPU without native 16-bit arithmetic, the
    case :func:`take_16bit_gemms` is for (on a CPU with AVX512_BF16 vLLM would pack a bfloat16 weight for oneDNN)."""
    gen = _gen(21)
    model = torch.nn.Module()
    model.a = _vllm.ReplicatedLinear(96, 40, bias=True, params_dtype=dtype, prefix="a")
    model.b = _vllm.ColumnParallelLinear(40, 72, bias=False, params_dtype=dtype, prefix="b")
    for layer in (model.a, model.b):
        layer.weight.weight_loader(layer.weight, _weight(*layer.weight.shape, dtype, gen))
    model.a.bias.weight_loader(model.a.bias, torch.randn(40, generator=gen).to(dtype))
    with _vllm.cpu_gemm_dispatch_without_native_16bit():
        testing.finish_loading(model)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layers_with_16bit_weights_take_the_kernel_after_loading(dtype, monkeypatch):
    monkeypatch.setattr(linear_ops, "native_16bit", lambda d: False)
    x = torch.randn(3, 5, 96, generator=_gen(22)).to(dtype)  # leading dims as a layer may see them
    with testing.standalone_model_parallel():
        model = _loaded_layers(dtype)
        assert linear_ops.take_16bit_gemms(model) == 2
        y, _ = model.a(x)
        z, _ = model.b(y)
    assert z.dtype == dtype and z.shape == (3, 5, 72)
    w_a, b_a, w_b = model.a.weight.double(), model.a.bias.double(), model.b.weight.double()
    want_y = (x.double() @ w_a.t() + b_a).to(dtype)
    _close(y, want_y, ulps=2)
    _close(z, (want_y.double() @ w_b.t()).to(dtype), ulps=2)
    assert ("linear16", "compiled", ()) in dispatch.decisions()


def test_layers_stay_with_vllm_where_the_kernel_would_not_be_faster(monkeypatch):
    with testing.standalone_model_parallel():
        monkeypatch.setattr(linear_ops, "native_16bit", lambda d: True)
        model = _loaded_layers(torch.bfloat16)
        before = model.a.cpu_linear
        assert linear_ops.take_16bit_gemms(model) == 0 and model.a.cpu_linear is before
        monkeypatch.setattr(linear_ops, "native_16bit", lambda d: False)
        assert linear_ops.take_16bit_gemms(_loaded_layers(torch.float32)) == 0
        # a weight vLLM's dispatch packed for its own GEMM (and deleted) keeps that GEMM
        model.b.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        assert linear_ops.take_16bit_gemms(model) == 1
        # the portable build's loops are slower than torch's bfloat16 GEMM at decode sizes
        monkeypatch.setattr(linear_ops.kernels, "isa", lambda: "portable")
        assert linear_ops.take_16bit_gemms(_loaded_layers(torch.bfloat16)) == 0


def test_loaded_linear_runs_the_models_gemm(monkeypatch):
    """``testing.loaded_linear`` (the benchmarks' bfloat16 layers) holds a weight as the model does: linear16 where
    vLLM's dispatch would fall back to torch's bfloat16 GEMM, vLLM's own GEMM where the CPU multiplies natively."""
    gen = _gen(23)
    weight, x = _weight(40, 96, torch.bfloat16, gen), torch.randn(5, 96, generator=gen).bfloat16()
    want = (x.double() @ weight.double().t()).bfloat16()
    with testing.standalone_model_parallel():
        monkeypatch.setattr(linear_ops, "native_16bit", lambda d: False)
        with _vllm.cpu_gemm_dispatch_without_native_16bit():
            widened = testing.loaded_linear(weight.clone())
        # (not with the portable build, whose loops are slower than torch's bfloat16 GEMM at decode sizes)
        assert (widened.cpu_linear is linear_ops._cpu_linear) == (linear_ops.kernels.isa() != "portable")
        assert testing.linear_gemm_name(widened) == ("the compiled linear16" if linear_ops.kernels.isa() != "portable"
                                                     else "torch's F.linear (vLLM's fallback)")
        _close(widened(x)[0], want, ulps=2)
        monkeypatch.setattr(linear_ops, "native_16bit", lambda d: True)
        native = testing.loaded_linear(weight.clone())
        assert native.cpu_linear is not linear_ops._cpu_linear
        assert testing.linear_gemm_name(native) != "the compiled linear16"
        _close(native(x)[0], want, ulps=2)


@pytest.mark.parametrize("cap, bf16, fp16", [
    (None, True, True), ("ALL", True, True), ("AVX2", False, False), ("avx512_core_vnni", False, False),
    ("AVX512_CORE_BF16", True, False), ("AVX512_CORE_FP16", True, True), ("AVX10_1_512_AMX", True, True)])
@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_native_16bit_follows_onednns_instruction_set_cap(monkeypatch, variable, cap, bf16, fp16):
    """On a CPU with bfloat16 and float16 dot products, oneDNN capped below them (as ``--as-avx2-cpu`` of
    bench_fp8_resident does, or a user) leaves vLLM's and torch's 16-bit GEMMs converting: not native."""
    from vllm_glm53.backends.cpu import build

    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16"})
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    if cap is not None:
        monkeypatch.setenv(variable, cap)
    linear_ops.native_16bit.cache_clear()
    try:
        assert (linear_ops.native_16bit(torch.bfloat16), linear_ops.native_16bit(torch.float16)) == (bf16, fp16)
    finally:
        linear_ops.native_16bit.cache_clear()


@pytest.mark.parametrize("cap, amx_gemm", [
    (None, True), ("AVX2", False), ("AVX512_CORE_BF16", False), ("AVX512_CORE_FP16", False),
    ("AVX512_CORE_AMX", True), ("ALL", True)])
def test_vllms_amx_gemm_follows_onednns_instruction_set_cap(monkeypatch, cap, amx_gemm):
    """Ledger 12, on any CPU (AMX faked): with oneDNN capped below AMX on a CPU with AMX, vLLM's dispatch must not
    pick its AMX GEMM (whose brgemm would abort the worker); the plugin's model installs the rule on its CPU worker.
    Without a cap below AMX vLLM's own answer stands and nothing is installed."""
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", utils.check_cpu_sgl_kernel)  # restored after the test
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert utils.check_cpu_sgl_kernel(512, 512, torch.bfloat16)  # what vLLM answers on a CPU with AMX
    if cap is not None:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert _vllm.cpu_amx_gemm_follows_onednn_cap(linear_ops.onednn_allows_amx) == (not amx_gemm)
    assert _vllm.cpu_amx_gemm_follows_onednn_cap(linear_ops.onednn_allows_amx) == (not amx_gemm)  # one wrapper
    assert utils.check_cpu_sgl_kernel(512, 512, torch.bfloat16) == amx_gemm
    assert not utils.check_cpu_sgl_kernel(512, 512, torch.float32)  # vLLM's own no for float32 stays
