"""FP8-resident weights on CPU (backends/cpu/fp8.py, csrc/linear.cpp, csrc/moe.cpp): the compiled block-FP8
products against dequantize-then-multiply, and the layers that keep the checkpoint's bytes.

Weights are quantized from random floats, then every block scale is multiplied by its own power of two in [1/4, 4]
(exact), so blocks of one weight differ in magnitude by up to 16x: reading a neighbour's scale (a swapped axis, a
ragged block, a fused part's offset) changes the output by far more than any tolerance here. Shapes have ragged
last blocks in both directions, fused parts whose first block rows are ragged, and token counts on every kernel
path (direct: at most 2 x kTok tokens, 28 on avx2; dense linears: tile below 256 tokens (32 on the portable path),
panels from there; experts: rows dotted a few tokens at a time, then tokens across the lanes). Outputs are
compared in units of ``ulp(max|reference|)`` as in test_cpu_kernels.py; each tolerance is about 4x the largest
error measured on the avx2 and the portable path.

Every instruction set this CPU runs is checked: ``test_other_instruction_sets`` runs this module again in a
subprocess for each path other than the loaded one. The engine side (an FP8 checkpoint served with resident
weights gives the dequantized reference's tokens, and its parameters are E4M3) is in test_fp8_cpu.py, on the
engine starts that were there already.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernel_isas import EMULATION_ENV, ISA, bf16_products, ops, other_isas, rerun_on  # noqa: F401
from test_cpu_kernels import F32_ULPS, _close, _gen, check_rounded_h, experts_down, kernel_h
from vllm_glm53.backends import dispatch
from vllm_glm53.backends.cpu import build
from vllm_glm53.backends.cpu import fp8 as fp8_ops
from vllm_glm53.backends.cpu import moe
from vllm_glm53.quant.fp8_block import quantize_block_fp8

BLOCK = (128, 128)
E4M3 = torch.float8_e4m3fn
SWIGLU_LIMIT = 0.5

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("compiled_kernels")


@pytest.mark.parametrize("isa", other_isas())
def test_other_instruction_sets(isa):
    rerun_on(isa, __file__, "other_instruction_sets or layer")


def _quantized(n: int, k: int, gen, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 ``[n, k]`` weight whose block scales vary by powers of two (see the module docstring)."""
    w, s = quantize_block_fp8(torch.randn(n, k, generator=gen) / k**0.5, block)
    return w, s * torch.pow(2.0, torch.randint(-2, 3, s.shape, generator=gen).float())


def _fused(parts: list[int], k: int, gen, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts quantized separately and stacked as vLLM's loaders stack them (scale rows at ceil(offset / bn))."""
    pieces = [_quantized(n, k, gen, block) for n in parts]
    return torch.cat([w for w, _ in pieces]), torch.cat([s for _, s in pieces])


# ---------------------------------------------------------------------------------------------------------
# The E4M3 conversion
# ---------------------------------------------------------------------------------------------------------


# direct; direct (bfloat16 pairs where the CPU has them); tile; tile (avx2, avx512) / panels (portable); panels
@pytest.mark.parametrize("M", [1, 4, 9, 33, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_e4m3_code_converts_exactly(M, dtype, bf16_products):
    """All 256 codes (subnormals, both zeros, the largest +-448), through every kernel path, bfloat16 tokens'
    included (their E4M3 values read as bfloat16): one-hot tokens pick one column of a weight holding every code,
    scale 1. e4m3fn's two NaN codes read as +-480 (csrc/vec.h). Every value is exact in bfloat16."""
    codes = torch.arange(256, dtype=torch.uint8)
    weight = torch.zeros(256, 20, dtype=torch.uint8)
    for j in range(20):
        weight[:, j] = codes.roll(j)
    weight = weight.view(E4M3)
    x = torch.zeros(M, 20, dtype=dtype)
    x[torch.arange(M), torch.arange(M) % 20] = 1.0
    got = ops.fp8_linear(x, weight, torch.ones(2, 1), [256], *BLOCK)
    want = weight.float()
    nan = want.isnan()
    want[nan] = torch.where(weight.view(torch.uint8)[nan] >= 128, -480.0, 480.0)
    torch.testing.assert_close(got, want[:, torch.arange(M) % 20].t().to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("exponent", [-40, 40])
@pytest.mark.parametrize("M", [1, 9, 40, 256])  # direct; tile; tile (avx2, avx512) / panels (portable); panels
def test_block_scales_far_from_one(exponent, M):
    """The kernels fold the E4M3 read unit (2^-120 on avx2, csrc/vec.h) into the token rows and the sums: token
    times scale far above 2^8 must not overflow (the whole 2^120 on the tokens would), nor far below 1 lose
    precision."""
    gen = _gen(M + exponent)
    weight, scale = _quantized(200, 320, gen)
    scale = scale * 2.0**exponent
    x = torch.randn(M, 320, generator=gen) * 8
    got = ops.fp8_linear(x, weight, scale, [200], *BLOCK)
    want = fp8_ops.fp8_linear_torch(x, weight, scale, [200], BLOCK)
    assert got.isfinite().all()
    _close(got, want, ulps=16)


# ---------------------------------------------------------------------------------------------------------
# Dense linears
# ---------------------------------------------------------------------------------------------------------

# (parts, K): exact blocks; one ragged part in both directions; fused ragged parts (the second starts inside a
# block row of the fused weight, its scales at row 2); three parts and a K below one lane group's multiple, the
# last part odd (a task of 9 rows: the direct paths' row pairs end on a row alone); two parts larger than a panel
# (K = 320: 3,276 rows), so panels end inside parts and inside row blocks; a K of two column chunks of the tile
# path (512 each), the second ending in a ragged block.
LINEAR_SHAPES = [([256], 256), ([200], 320), ([200, 200], 320), ([72, 128, 41], 100), ([3300, 3500], 320),
                 ([200], 700)]


@pytest.mark.parametrize("parts,K", LINEAR_SHAPES)
# direct (up to 2 x kTok tokens, 28 on avx2: 3 takes the one-row form on portable, row pairs against 3 tokens on
# avx2, whose 6, 16 and 28 go in passes of 3 and 4; 6 and 16 are tile elsewhere); tile (one, two token groups: 16
# and 28 off avx2); 40: tile (avx2, avx512) / panels (portable); panels
@pytest.mark.parametrize("M", [1, 3, 6, 16, 28, 40, 256])
def test_fp8_linear_matches_dequantize_then_matmul(parts, K, M):
    gen = _gen(M * 100 + K)
    weight, scale = _fused(parts, K, gen)
    x = torch.randn(M, K + 5, generator=gen)[:, 2 : 2 + K]  # a strided view
    got = ops.fp8_linear(x, weight, scale, parts, *BLOCK)
    want = fp8_ops.fp8_linear_torch(x, weight, scale, parts, BLOCK)
    assert got.dtype == torch.float32 and got.shape == (M, sum(parts))
    # measured (ulps of max|reference|, avx2 / portable): 5.5 / 5.2
    _close(got, want, ulps=16)


# (parts, K): fused ragged parts; a K inside one ragged block and an odd last part (its last row alone); two column
# blocks, the second ragged; an odd K (no column pairs: the float32 tile path everywhere)
@pytest.mark.parametrize("parts,K", [([200, 200], 320), ([72, 128, 41], 100), ([200], 700), ([200], 99)])
# direct (row pairs against up to kTok tokens; one row alone against more, avx2 row pairs in passes of 3-5 up to
# 16; bfloat16 pairs from 2 tokens where the CPU has bfloat16 dot products: both rows against all tokens, in two
# passes at 11); tile (one token group at 11 and 16 without bfloat16 dot products, not on avx2; three groups, the
# last partly empty)
@pytest.mark.parametrize("M", [1, 3, 6, 8, 11, 16, 40])
def test_fp8_linear_in_bfloat16(parts, K, M, bf16_products):
    """bfloat16 activations: computed in float32 from the exact weights, rounded once to bfloat16. Where the CPU has
    bfloat16 dot products both paths multiply the E4M3 values as bfloat16 with the tokens in pairs of columns, each
    column block's sums times its scale (csrc/gemv.h): the products are still exact."""
    gen = _gen(7 + M + K)
    weight, scale = _fused(parts, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16()
    got = ops.fp8_linear(x, weight, scale, parts, *BLOCK)
    assert got.dtype == torch.bfloat16
    want = fp8_ops.fp8_linear_torch(x.float(), weight, scale, parts, BLOCK)
    # measured (ulps of max|reference|, in bfloat16 ulps, avx2 / portable / avx512 with bfloat16 dot products):
    # 0.53 / 0.03 / 0.01 (one rounding of nearly equal sums; avx2 adds a row's columns in another order)
    _close(got, want.bfloat16(), ulps=2)


# Block sizes other than the release's 128 x 128 (the ops take any multiple of 16): column blocks that leave the
# bfloat16 pairs' 64-column groups partly empty (48: one short group a block; 80: a full group and a short one,
# zero-padded in the tokens' unpack order, csrc/gemv.h), on the direct paths (1, 3, 11 tokens) and the tile path;
# 32: avx2's one-token form (dot_quads) with one 32-column group a block (48 and 80 are not whole groups of 32: the
# scaled-token form there).
@pytest.mark.parametrize("block", [(32, 48), (48, 80), (16, 32)])
@pytest.mark.parametrize("M", [1, 3, 11, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_linear_other_block_sizes(block, M, dtype, bf16_products):
    gen = _gen(M + block[1])
    K = 250
    weight, scale = quantize_block_fp8(torch.randn(200, K, generator=gen) / K**0.5, block)
    scale = scale * torch.pow(2.0, torch.randint(-2, 3, scale.shape, generator=gen).float())
    x = torch.randn(M, K, generator=gen).to(dtype)
    got = ops.fp8_linear(x, weight, scale, [200], *block)
    want = fp8_ops.fp8_linear_torch(x.float(), weight, scale, [200], block)
    # measured (ulps of max|reference|, avx512 with bfloat16 dot products (also emulated) / avx2 / portable):
    # float32 5.1 / 4.1 / 5.1, bfloat16 (in bfloat16 ulps) 0.08 / 0.13 / 0.08
    _close(got, want.to(dtype), ulps=16 if dtype == torch.float32 else 2)


def test_bfloat16_dot_products_where_the_cpu_has_them():
    """The avx512 kernels say whether they use the CPU's bfloat16 dot products (the emulated rerun's instructions
    always do): a CPU with AVX512_BF16 must not lose the paths that use them, VBMI or not (Cooper Lake has none),
    and no other may run them."""
    flags = build.cpu_flags()
    has = ISA == "avx512" and ("avx512_bf16" in flags or bool(os.environ.get(EMULATION_ENV)))
    assert ("bfloat16 dot products" in ops.build_info()) == has


def test_fp8_linear_rejects_a_scale_grid_that_does_not_fit_the_parts():
    gen = _gen(3)
    weight, scale = _fused([200, 200], 320, gen)
    with pytest.raises(RuntimeError, match=r"scale must be \[4, 3\]"):
        ops.fp8_linear(torch.randn(1, 320), weight, scale[:3], [200, 200], *BLOCK)
    with pytest.raises(RuntimeError, match="do not add up"):
        ops.fp8_linear(torch.randn(1, 320), weight, scale, [200, 199], *BLOCK)


# ---------------------------------------------------------------------------------------------------------
# Routed experts
# ---------------------------------------------------------------------------------------------------------

E, HOT = 6, 2  # expert 2 is every token's first choice but every fourth one's; experts 1 and 4 get none


def _expert_stacks(D: int, inter: int, gen, block=BLOCK):
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(E):
        w, s = _fused([inter, inter], D, gen, block)
        w13.append(w), s13.append(s)
        w, s = _quantized(D, inter, gen, block)
        w2.append(w), s2.append(s)
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


def _experts_reference(x, w13, s13, w2, s2, ids, weights, block=BLOCK):
    """The routed experts in float64 from the dequantized weights (which are exact in float32): the float32 torch
    loop is itself several ulps off on these sums (measured 5-14 ulps), as much as the kernel, so it would
    measure its own error."""
    inter, D = w13.shape[1] // 2, w13.shape[2]
    out = torch.zeros(x.shape[0], D, dtype=torch.float64)
    for e in ids.unique().tolist():
        w_up = fp8_ops.dequantize_parts(w13[e], s13[e], [inter, inter], block, torch.float64)
        w_down = fp8_ops.dequantize_parts(w2[e], s2[e], [D], block, torch.float64)
        for t, j in (ids == e).nonzero().tolist():
            g, u = (w_up @ x[t].double()).split(inter)
            h = F.silu(g.clamp(max=SWIGLU_LIMIT)) * u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            out[t] += weights[t, j].double() * (w_down @ h)
    return out


def _routing(T: int, k: int, gen):
    used = [0, 2, 3, 5]
    keys = torch.rand(T, len(used), generator=gen)
    keys[torch.arange(T) % 4 != 3, used.index(HOT)] += 1.0
    return torch.tensor(used)[keys.topk(k, dim=-1).indices], torch.rand(T, k, generator=gen)


# Tokens per expert (experts 0, 2, 3, 5): T = 1: 0-1, the direct path; 8: 2-4 on the direct path (more than kTok:
# portable one row at a time against all of them, avx2 row pairs against all) and the hot expert's 5-6 (direct on
# avx2, elsewhere rows dotted kTok tokens at a time); 16: 5-6, and 7-15, one token group across the lanes (avx2:
# the direct path in passes of 3-5 tokens); 58: 15-50, up to four groups (avx2: 15-27 direct, 25 and 27 past its
# earlier end at 24; the hot expert's 49-50 across the lanes); 400: 132-356, the hot expert's 22 groups in two
# passes of at most 16.
@pytest.mark.parametrize("D,inter", [(256, 128), (320, 200), (320, 72)])
@pytest.mark.parametrize("T", [1, 8, 16, 58, 400])
def test_fp8_experts_match_dequantize_then_loop(T, D, inter):
    gen = _gen(T * 1000 + inter)
    w13, s13, w2, s2 = _expert_stacks(D, inter, gen)
    ids, weights = _routing(T, 2, gen)
    x = 4 * torch.randn(T, D, generator=gen)  # large enough that both clamps of the SwiGLU are active
    got = ops.moe_experts_fp8(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, *BLOCK)
    assert got.dtype == torch.float32 and got.shape == (T, D)
    # measured (float32 ulps of max|float64 reference|, avx2 and avx512-emulated / portable): 17.9 / 24.4 (T = 400
    # and 16: across the lanes each output sums a chunk of 256 columns in one accumulator)
    _close(got.double(), _experts_reference(x, w13, s13, w2, s2, ids, weights), ulps=F32_ULPS * 96)
    # measured 18.2 on all: the plain-torch form (what runs where the kernel declines) computes the same
    _close(fp8_ops.routed_experts_fp8_torch(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, BLOCK).double(),
           _experts_reference(x, w13, s13, w2, s2, ids, weights), ulps=F32_ULPS * 64)
    g = torch.nn.functional.linear(x, fp8_ops.dequantize_parts(w13[HOT], s13[HOT], [inter, inter], BLOCK))
    assert (g[:, :inter] > SWIGLU_LIMIT).any() and (g[:, inter:].abs() > SWIGLU_LIMIT).any()


# Column blocks that are not whole groups of avx2's 32 columns (48: every other group straddles two blocks, in the
# scaled token rows' quad order as well; 80) and ragged row blocks: T = 1, one-token experts on the scaled-token
# form (avx2: a gate row and its up row each against its own scaled token row, csrc/gemv.h's dot_row_tokens; the
# release's blocks take dot_quads there); T = 8, 2-7 tokens on the direct path.
@pytest.mark.parametrize("block", [(32, 48), (48, 80)])
@pytest.mark.parametrize("T", [1, 8])
def test_fp8_experts_other_block_sizes(block, T):
    gen = _gen(T + block[1])
    D, inter = 320, 200
    w13, s13, w2, s2 = _expert_stacks(D, inter, gen, block)
    ids, weights = _routing(T, 2, gen)
    x = 4 * torch.randn(T, D, generator=gen)
    got = ops.moe_experts_fp8(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, *block)
    # measured (float32 ulps of max|float64 reference|, avx2 / portable / avx512-emulated): 8.5 / 7.4 / 7.7
    _close(got.double(), _experts_reference(x, w13, s13, w2, s2, ids, weights, block), ulps=F32_ULPS * 16)


# Tokens per expert: T = 5: 0-4 (direct; one token: bfloat16 pairs too, float32 forms for float16); 8: 2-7 (direct,
# one row alone past kTok, avx2 row pairs; few-token path on portable); 24: 6-21 (10 and 11 on bfloat16 pairs:
# direct in two passes; avx2 direct; across the lanes elsewhere); 40: 13-37 (across the lanes; avx2 13-28
# direct). h is rounded to the tokens' dtype (csrc/moe.cpp as_h); where the CPU has bfloat16 dot products both steps
# of bfloat16 tokens take bfloat16 pairs on the direct and tile paths (float16 tokens keep the float32 forms). The
# intermediate size spans a whole and a ragged column block of W2, and 4 x inter <= D for kernel_h.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [5, 8, 24, 40])
def test_fp8_experts_16bit_tokens(T, dtype, bf16_products):
    gen = _gen(11 + T)
    D, inter = 560, 136
    w13, s13, w2, s2 = _expert_stacks(D, inter, gen)
    ids, weights = _routing(T, 2, gen)
    x = (4 * torch.randn(T, D, generator=gen)).to(dtype)
    got = ops.moe_experts_fp8(x, w13, s13, w2, s2, ids.int(), weights, SWIGLU_LIMIT, *BLOCK)

    def probe(w2_probe):  # ones and zeros: exact in E4M3 with unit scales
        return ops.moe_experts_fp8(x, w13, s13, w2_probe.to(E4M3), torch.ones(s2.shape), ids.int(), weights,
                                   SWIGLU_LIMIT, *BLOCK)

    w13_f = torch.stack([fp8_ops.dequantize_parts(w13[e], s13[e], [inter, inter], BLOCK, torch.float64)
                         for e in range(E)])
    w2_f = torch.stack([fp8_ops.dequantize_parts(w2[e], s2[e], [D], BLOCK, torch.float64) for e in range(E)])
    h = check_rounded_h(kernel_h(probe, ids, weights, inter, E, D), x, w13_f, ids, SWIGLU_LIMIT, dtype)
    # the down products and the sum against the kernel's own h; measured (float32 ulps of max|float64 reference|,
    # avx2 / portable / avx512 with bfloat16 dot products, also emulated): bfloat16 1.3 / 3.0 / 1.3, float16
    # 1.6 / 2.8 / 3.5
    _close(got.double(), experts_down(h, w2_f, ids, weights), ulps=F32_ULPS * 12)


# ---------------------------------------------------------------------------------------------------------
# bfloat16 GEMMs on dequantized copies (CPUs with native bfloat16 arithmetic)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("parts,K", [([200, 200], 320), ([72, 128, 40], 100), ([3300, 3500], 320)])
def test_fp8_dequantize_is_the_reference_bit_for_bit(parts, K, dtype):
    """The kernels' dequantization into a kept buffer: float(w) * scale in float32, rounded once, as the
    dequantize-at-load path (quant/fp8_block.py) does it, fused ragged parts included."""
    weight, scale = _fused(parts, K, _gen(K + len(parts)))
    out = torch.full((sum(parts), K), float("nan"), dtype=dtype)
    ops.fp8_dequantize(weight, scale, parts, *BLOCK, out)
    assert torch.equal(out, fp8_ops.dequantize_parts(weight, scale, parts, BLOCK, dtype))
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU tensor"):
        ops.fp8_dequantize(weight, scale, parts, *BLOCK, out[:, :-1])


@pytest.fixture
def native_bf16(monkeypatch):
    """This CPU as one with native bfloat16 arithmetic (the bf16_gemm forms' condition)."""
    monkeypatch.setattr(fp8_ops, "native_16bit", lambda dtype: dtype == torch.bfloat16)


# the weight dequantized and multiplied in one panel, or a row block at a time (panels inside the ragged parts, each
# part's scale rows from its own first one)
PANELS = pytest.mark.parametrize("panel_bytes", [None, 1], ids=["one panel", "a row block a panel"])


@PANELS
@pytest.mark.parametrize("parts", [[200, 200], [72, 128, 40]])
def test_large_bfloat16_linears_run_the_dequantized_models_gemm(native_bf16, monkeypatch, parts, panel_bytes):
    """From bf16_gemm_min()'s tokens a bfloat16 model's FP8 linear is the dequantize-at-load model's product exactly:
    the same bfloat16 weight, the same GEMM; below it, and for float32 tokens, the E4M3 kernel."""
    if panel_bytes is not None:
        monkeypatch.setattr(fp8_ops, "_PANEL_BYTES", panel_bytes)
    K = 320
    weight, scale = _fused(parts, K, _gen(31))
    many = torch.randn(fp8_ops.bf16_gemm_min()[0], K, generator=_gen(32)).bfloat16()
    want = F.linear(many, fp8_ops.dequantize_parts(weight, scale, parts, BLOCK, torch.bfloat16))
    assert torch.equal(fp8_ops.fp8_linear(many, weight, scale, parts, BLOCK), want)
    assert fp8_ops._linear_bf16_check(many, weight, scale, parts, BLOCK) is None
    assert "fewer than" in fp8_ops._linear_bf16_check(many[:-1], weight, scale, parts, BLOCK)
    assert "float32 activations" in fp8_ops._linear_bf16_check(many.float(), weight, scale, parts, BLOCK)


@PANELS
def test_large_bfloat16_expert_batches_run_the_dequantized_models_loop(native_bf16, monkeypatch, panel_bytes):
    """From bf16_gemm_min()'s pairs per expert the FP8 experts are the dequantize-at-load model's bfloat16 expert
    loop exactly (each expert's w13 fused from ragged parts: inter = 200 is not a multiple of the 128-row block)."""
    if panel_bytes is not None:
        monkeypatch.setattr(fp8_ops, "_PANEL_BYTES", panel_bytes)
    D, inter = 320, 200
    w13, s13, w2, s2 = _expert_stacks(D, inter, _gen(33))
    T = fp8_ops.bf16_gemm_min()[1] * E // 2
    ids, weights = _routing(T, 2, _gen(34))
    x = (4 * torch.randn(T, D, generator=_gen(35))).bfloat16()
    w13_bf16 = torch.stack([fp8_ops.dequantize_parts(w13[e], s13[e], [inter, inter], BLOCK, torch.bfloat16)
                            for e in range(E)])
    w2_bf16 = torch.stack([fp8_ops.dequantize_parts(w2[e], s2[e], [D], BLOCK, torch.bfloat16) for e in range(E)])
    want = moe.routed_experts_torch(x, w13_bf16, w2_bf16, ids, weights, SWIGLU_LIMIT)
    got = fp8_ops.routed_experts_fp8(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, BLOCK)
    assert torch.equal(got, want)
    assert ("routed_experts_fp8", "bf16_gemm", ()) in dispatch.decisions()
    fewer = (ids[:-1], weights[:-1])
    assert "fewer than" in fp8_ops._experts_bf16_check(x[:-1], w13, s13, w2, s2, *fewer, SWIGLU_LIMIT, BLOCK)


@pytest.mark.parametrize("flags, cap, kernel_amx, want", [
    ({"avx512_bf16"}, None, False, (64, 64)), ({"avx512_bf16", "amx_bf16"}, None, False, (24, 24)),
    ({"avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", False, (64, 64)),
    ({"avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX", False, (24, 24)),
    ({"avx512_bf16", "amx_bf16"}, None, True, (256, 256))])
def test_bf16_gemms_start_earlier_on_amx(monkeypatch, flags, cap, kernel_amx, want):
    """Where torch's bfloat16 GEMMs run on AMX tiles (the CPU has them, oneDNN is not capped below) and the kernels
    do not, the bf16_gemm forms take over from 24 tokens / pairs per expert (the crossovers measured there), else
    from 64; where the kernels multiply on AMX tiles themselves, from 256."""
    from vllm_glm53.backends.cpu import build, kernels
    from vllm_glm53.backends.cpu import linear as linear_ops

    monkeypatch.setattr(kernels, "amx_tiles", lambda: kernel_amx)
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", *flags})
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    linear_ops.amx_bf16.cache_clear()
    try:
        assert fp8_ops.bf16_gemm_min() == want
        gen = _gen(37)
        weight, scale = _fused([256], 256, gen)
        x = torch.randn(want[0] - 1, 256, generator=gen).bfloat16()
        assert f"fewer than {want[0]} tokens" in fp8_ops._linear_bf16_check(x, weight, scale, [256], BLOCK)
    finally:
        linear_ops.amx_bf16.cache_clear()


def test_bf16_gemm_forms_need_native_bfloat16():
    gen = _gen(36)
    weight, scale = _fused([256], 256, gen)
    x = torch.randn(fp8_ops.bf16_gemm_min()[0], 256, generator=gen).bfloat16()
    reason = fp8_ops._linear_bf16_check(x, weight, scale, [256], BLOCK)
    if fp8_ops.native_16bit(torch.bfloat16):
        assert reason is None
    else:
        assert "no native bfloat16" in reason


# ---------------------------------------------------------------------------------------------------------
# The layers: what they keep after loading, and the dispatch
# ---------------------------------------------------------------------------------------------------------


def _plan(modules: set[str]):
    from vllm_glm53.quant.plan import CheckpointQuant, LayerQuant

    return LayerQuant(CheckpointQuant("fp8", frozenset(modules), {"weight_block_size": list(BLOCK)}), "cpu")


def test_fused_linear_layer_keeps_the_checkpoint_bytes_and_runs_the_kernel():
    """A vLLM MergedColumnParallelLinear (gate | up of 200 rows each: the up part's scales start at row 2) with
    the CPU plan: the loaders keep E4M3 bytes and scales, nothing dequantized, and the layer's output is the
    dequantized reference's."""
    from vllm_glm53 import _vllm, testing
    from vllm_glm53.backends.dispatch import decisions
    from vllm_glm53.quant.fp8 import BlockFp8Weight, block_fp8_parts
    from vllm_glm53.quant.linear import CpuBlockFp8LinearMethod

    gen = _gen(21)
    K, inter = 320, 200
    gate, up = _quantized(inter, K, gen), _quantized(inter, K, gen)
    with testing.standalone_model_parallel():
        layer = _vllm.MergedColumnParallelLinear(K, [inter, inter], bias=False, quant_config=_plan(
            {"m.gate_proj", "m.up_proj"}), prefix="m.gate_up_proj")
        assert isinstance(layer.quant_method, CpuBlockFp8LinearMethod)
        params = dict(layer.named_parameters())
        for shard, (w, s) in enumerate((gate, up)):
            for leaf, part in block_fp8_parts(BlockFp8Weight(w, s), params):
                params[leaf].weight_loader(params[leaf], part, shard)
        testing.finish_loading(layer)
        assert layer.weight.dtype == E4M3 and layer.weight.nbytes == 2 * inter * K
        assert layer.weight_scale_inv.dtype == torch.float32 and layer.weight_scale_inv.shape == (4, 3)
        assert torch.equal(layer.weight.view(torch.uint8), torch.cat([gate[0], up[0]]).view(torch.uint8))
        x = torch.randn(3, K, generator=gen)
        got, _ = layer(x)
    want = x @ torch.cat([fp8_ops.dequantize_parts(w, s, [inter], BLOCK) for w, s in (gate, up)]).t()
    _close(got, want, ulps=16)  # measured 2.0 (avx2)
    assert ("fp8_linear", "compiled", (f"bf16_gemm declined: fewer than {fp8_ops.bf16_gemm_min()[0]} tokens: the "
                                       "E4M3 kernel reads fewer bytes",)) in decisions()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mlp_of_fp8_layers_runs_as_one_call_at_decode_sizes(dtype):
    """``fp8_mlp`` (what Glm5NextMLP runs first): gate | up (ragged 200-row parts) and down as vLLM layers with the
    CPU plan give down(clamped_swiglu(gate_up(x))) in one kernel call up to MLP_FP8_MAX_TOKENS tokens, and
    decline past them (the layers then run one after the other)."""
    from vllm_glm53 import _vllm, testing
    from vllm_glm53.backends.dispatch import decisions
    from vllm_glm53.quant.fp8 import BlockFp8Weight, block_fp8_parts
    from vllm_glm53.quant.linear import fp8_mlp

    gen = _gen(23)
    D, inter = 320, 200
    ckpt = {"gate_proj": _quantized(inter, D, gen), "up_proj": _quantized(inter, D, gen),
            "down_proj": _quantized(D, inter, gen)}
    with testing.standalone_model_parallel():
        plan = _plan({f"m.{name}" for name in ckpt})
        gate_up = _vllm.MergedColumnParallelLinear(D, [inter, inter], bias=False, quant_config=plan,
                                                   prefix="m.gate_up_proj")
        down = _vllm.RowParallelLinear(inter, D, bias=False, quant_config=plan, prefix="m.down_proj")
        for layer, names in ((gate_up, ("gate_proj", "up_proj")), (down, ("down_proj",))):
            params = dict(layer.named_parameters())
            for shard, name in enumerate(names):
                for leaf, part in block_fp8_parts(BlockFp8Weight(*ckpt[name]), params):
                    loader = params[leaf].weight_loader
                    loader(params[leaf], part, shard) if len(names) > 1 else loader(params[leaf], part)
            testing.finish_loading(layer)
        w13 = torch.cat([fp8_ops.dequantize_parts(*ckpt[n], [inter], BLOCK, torch.float64)
                         for n in ("gate_proj", "up_proj")])
        w2 = fp8_ops.dequantize_parts(*ckpt["down_proj"], [D], BLOCK, torch.float64)
        for T in (1, 5, 16, fp8_ops.MLP_FP8_MAX_TOKENS):
            x = (4 * torch.randn(T, D, generator=gen)).to(dtype)
            got = fp8_mlp(gate_up, down, x, SWIGLU_LIMIT)
            assert got.dtype == dtype and got.shape == (T, D)
            h = moe.clamped_swiglu(x.double() @ w13.t(), SWIGLU_LIMIT)
            if dtype == torch.bfloat16:  # the kernel rounds h to the tokens' dtype (as the experts' h)
                h = h.to(dtype).double()
            want = h @ w2.t()
            # measured (ulps of max|reference|, avx2 / portable / avx512, also emulated): float32 5.1 / 5.2 / 6.0,
            # bfloat16 0.22 / 0.0 / 0.22 (the output's rounding)
            if dtype == torch.float32:
                _close(got.double(), want, ulps=F32_ULPS * 16)
            else:
                _close(got, want.to(dtype), ulps=2)
        assert fp8_mlp(gate_up, down, x[:1].expand(fp8_ops.MLP_FP8_MAX_TOKENS + 1, D), SWIGLU_LIMIT) is None
    assert any(d[0] == "routed_experts_fp8" and d[1] == "compiled" for d in decisions())


def test_expert_layer_keeps_the_checkpoint_bytes():
    """CpuFp8Experts filled from per-expert checkpoint tensors (ragged I = 72): E4M3 stacks, gate and up scales
    in their own block rows, and the forward of the dequantized reference."""
    from vllm_glm53.model.moe_routing import route
    from vllm_glm53.quant.experts import CpuFp8Experts
    from vllm_glm53.quant.fp8 import BlockFp8Weight

    gen = _gen(31)
    D, inter, k = 320, 72, 2
    bias = torch.zeros(E)
    router = lambda logits: route(logits, bias, k, 1, 1, True, 1.0)  # noqa: E731
    experts = CpuFp8Experts(E, D, inter, 0, SWIGLU_LIMIT, router, BLOCK)
    ckpt = {}
    for e in range(E):
        for which, shape in (("gate_proj", (inter, D)), ("up_proj", (inter, D)), ("down_proj", (D, inter))):
            ckpt[e, which] = _quantized(*shape, gen)
            experts.load(e, which, "weight", BlockFp8Weight(*ckpt[e, which]))
    assert experts.w13.dtype == E4M3 and experts.w2.dtype == E4M3
    assert experts.w13.nbytes + experts.w2.nbytes == E * 3 * inter * D
    assert torch.equal(experts.w13_scale_inv[3, 1], ckpt[3, "up_proj"][1][0])  # up's scales at row ceil(72/128)
    x, logits = 4 * torch.randn(9, D, generator=gen), torch.randn(9, E, generator=gen)
    got = experts(x, logits)
    weights, ids = router(logits)
    w13 = torch.stack([torch.cat([ckpt[e, p][0] for p in ("gate_proj", "up_proj")]) for e in range(E)])
    s13 = torch.stack([torch.cat([ckpt[e, p][1] for p in ("gate_proj", "up_proj")]) for e in range(E)])
    w2, s2 = (torch.stack([ckpt[e, "down_proj"][i] for e in range(E)]) for i in (0, 1))
    # measured 9.9 (avx2), 6.0 (portable)
    _close(got.double(), _experts_reference(x, w13, s13, w2, s2, ids, weights), ulps=F32_ULPS * 40)


def test_expert_parallel_ranks_keep_fp8_and_sum_to_the_whole_layer():
    """Expert parallel on CPU keeps the FP8 kernel: two ranks' CpuFp8Experts, each filled with its half of the
    experts from the same checkpoint tensors (E4M3 bytes, half the bytes), sum to the unpartitioned layer."""
    from vllm_glm53.model.moe_routing import route
    from vllm_glm53.quant.experts import CpuFp8Experts
    from vllm_glm53.quant.fp8 import BlockFp8Weight

    gen = _gen(37)
    D, inter, k = 256, 72, 3
    bias = torch.zeros(E)
    router = lambda logits: route(logits, bias, k, 1, 1, True, 1.0)  # noqa: E731
    whole = CpuFp8Experts(E, D, inter, 0, SWIGLU_LIMIT, router, BLOCK)
    ranks = [CpuFp8Experts(E, D, inter, 0, SWIGLU_LIMIT, router, BLOCK, first_expert=r * E // 2, num_local=E // 2)
             for r in range(2)]
    for e in range(E):
        for which, shape in (("gate_proj", (inter, D)), ("up_proj", (inter, D)), ("down_proj", (D, inter))):
            tensor = BlockFp8Weight(*_quantized(*shape, gen))
            whole.load(e, which, "weight", tensor)
            filled = [rank.load(e, which, "weight", tensor) for rank in ranks]
            assert [bool(f) for f in filled] == [e < E // 2, e >= E // 2]
    for r, rank in enumerate(ranks):
        assert rank.w13.dtype == E4M3 and rank.w13.nbytes + rank.w2.nbytes == E // 2 * 3 * inter * D
        assert torch.equal(rank.w13.view(torch.uint8), whole.w13[r * E // 2 : (r + 1) * E // 2].view(torch.uint8))
    x, logits = 4 * torch.randn(11, D, generator=gen), torch.randn(11, E, generator=gen)
    _close(sum(rank(x, logits) for rank in ranks).double(), whole(x, logits).double(), ulps=F32_ULPS * 40)


def test_weight_form_says_why_it_declines():
    assert fp8_ops.fp8_weight_form(BLOCK) == "fp8"
    assert fp8_ops.fp8_weight_form((128, 100)) == "dequantized"
    from vllm_glm53.backends.dispatch import decisions

    assert ("fp8_weight_form", "torch", ("compiled declined: block [128, 100] is not a multiple of 16 on both "
                                         "sides",)) in decisions()
