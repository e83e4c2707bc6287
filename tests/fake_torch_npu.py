"""A numerical stand-in for the few ``torch_npu`` ops the plugin calls, for CPU tests of the Ascend code paths.

The real ``torch_npu`` cannot even be imported without CANN (ascend.md §3), so tests put this module in
``sys.modules["torch_npu"]``. Each op checks the argument shapes, dtypes and group sizes that torch-npu's own
meta registrations (``op_plugin/meta/_meta_registrations.py`` of torch-npu 2.14) enforce, and computes the
result from the documented formats in plain float32 arithmetic. The MX layout and arithmetic follow CANN's own
operator documentation (repository hicann/ops-nn, mirrored from gitcode.com/cann/ops-nn), not our notes:

* ``matmul/quant_batch_matmul_v4/docs/aclnnQuantMatmulV5_en.md``, "Restrictions on the mx quantization
  scenario": mx full quantization takes FLOAT8_E4M3FN x1 ``(m, k)`` and x2 ``(k, n)`` (non-transposed), x1Scale
  ``(m, ceil(k / 64), 2)``, x2Scale ``(ceil(k / 64), n, 2)``, FLOAT8_E8M0, ``[gsM, gsN, gsK] = [1, 1, 32]``, and
  computes ``out[m, n] = sum_j (x1 . x2 over K-slice j) * x1Scale[m, j] * x2Scale[j, n]`` for the 32-element
  K-slices j;
* ``quant/dynamic_mx_quant/docs/aclnnDynamicMxQuant_en.md``: the scale output has ``rank(x) + 1`` dimensions,
  ``ceil(ceil(x.shape[axis] / blocksize) / 2)`` on the quantized axis and 2 last, an odd group count padded with
  0, and "when axis is not the last axis, the mxscaleOut output needs to interleave every two rows"; scaleAlg 0 is
  ``2**(floor(log2 amax) - emax)`` (emax 8 for E4M3), scaleAlg 1 is ``amax / 448`` with its exponent rounded up.

So the scale of K-slice ``g`` sits at ``[r, g // 2, g % 2]`` for activation row ``r`` (quantized along its last
axis) and at ``[g // 2, n, g % 2]`` for weight column ``n`` (a ``(k, n)`` weight quantized along axis 0, two
K-rows of scales interleaved): exactly the x1Scale / x2Scale shapes above.
* int8 w8a8: ``y = (x_q @ w_q) * x_scale[m] * w_scale[n]`` with exact integer sums.

``make_fake(swap_pairs=True)`` builds a fake that reads the two scales of each pair in the wrong order: a
layout test that passes with it would not be testing the layout.
"""

from __future__ import annotations

import importlib.machinery
import math
import types

import torch

FLOAT8_E8M0FNU = 293  # torch_npu's dtype enums are plain ints
FLOAT4_E2M1FN_X2 = 296
HIFLOAT8 = 290
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"fake torch_npu: {msg}")


def _pow2(byte: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, byte.to(torch.float32) - 127)


class _Ops:
    def __init__(self, swap_pairs: bool) -> None:
        self.swap_pairs = swap_pairs

    # --- scale expansion ---------------------------------------------------------------------------------

    def _pair_index(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.arange(groups)
        slot = g % 2
        return g // 2, (1 - slot) if self.swap_pairs else slot

    def _weight_group_scales(self, scale: torch.Tensor, groups: int) -> torch.Tensor:
        """``[ceil(K/64), N, 2]`` bytes -> fp32 ``[groups, N]``."""
        pair, slot = self._pair_index(groups)
        return _pow2(scale[pair, :, slot])

    def _token_group_scales(self, scale: torch.Tensor, groups: int) -> torch.Tensor:
        """``[M, ceil(K/64), 2]`` bytes -> fp32 ``[M, groups]``."""
        pair, slot = self._pair_index(groups)
        return _pow2(scale[:, pair, slot])

    def _mx_matmul(self, x1, x2, scale, pertoken_scale) -> torch.Tensor:
        m, k = x1.shape
        _check(x2.dim() == 2 and x2.shape[0] == k, f"x2 must be [K={k}, N], got {tuple(x2.shape)}")
        n = x2.shape[1]
        groups = math.ceil(k / 32)
        _check(tuple(scale.shape) == (math.ceil(k / 64), n, 2), f"scale must be [{math.ceil(k / 64)}, {n}, 2], "
               f"got {tuple(scale.shape)}")
        _check(tuple(pertoken_scale.shape) == (m, math.ceil(k / 64), 2),
               f"pertoken_scale must be [{m}, {math.ceil(k / 64)}, 2], got {tuple(pertoken_scale.shape)}")
        _check(scale.dtype == torch.uint8 and pertoken_scale.dtype == torch.uint8, "MX scales are uint8 bytes")
        col = torch.arange(k) // 32
        a = x1.float() * self._token_group_scales(pertoken_scale, groups)[:, col]
        b = x2.float() * self._weight_group_scales(scale, groups)[col, :]
        return a @ b

    # --- ops -----------------------------------------------------------------------------------------------

    def npu_dynamic_mx_quant(self, x, *, axis=-1, round_mode="rint", dst_type=FLOAT4_E2M1FN_X2, block_size=32,
                             scale_alg=0, dst_type_max=0.0, max_low_bound=0.0):
        _check(block_size == 32 and round_mode == "rint", "only 1x32 blocks and rint are modelled")
        if x.dim() == 2 and axis in (0, -2):  # a (k, n) weight along k: scales (ceil(k/64), n, 2), rows interleaved
            q, byte = self.npu_dynamic_mx_quant(x.t(), dst_type=dst_type, scale_alg=scale_alg)
            return q.t(), byte.transpose(0, 1).contiguous()
        _check(axis in (-1, x.dim() - 1), "only the last axis, or axis 0 of a 2-D tensor, is modelled")
        _check(dst_type is E4M3, f"dst_type must be torch.float8_e4m3fn, got {dst_type}")
        _check(scale_alg in (0, 1), f"scale_alg {scale_alg} is not modelled")
        _check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"input dtype {x.dtype}")
        lead, k = x.shape[:-1], x.shape[-1]
        groups = math.ceil(k / 32)
        xg = torch.nn.functional.pad(x.float().reshape(-1, k), (0, groups * 32 - k)).view(-1, groups, 32)
        amax = xg.abs().amax(-1)
        mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
        if scale_alg == 0:  # OCP: floor(log2 amax) - emax(E4M3)=8
            e = exp - 1 - 8
        else:  # "cuBLAS": amax / 448 rounded up to a power of two
            e = exp - 9 + (mant > 0.875).to(exp.dtype)
        e = e.clamp(-127, 127)
        byte = torch.where(amax > 0, e + 127, torch.zeros_like(e)).to(torch.uint8)
        q = (xg * torch.pow(2.0, -e.float())[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        q = q.view(-1, groups * 32)[:, :k].reshape(*lead, k)
        if groups % 2:
            byte = torch.nn.functional.pad(byte, (0, 1))
        return q, byte.reshape(*lead, math.ceil(groups / 2), 2)

    def npu_dynamic_quant(self, x, *, smooth_scales=None, group_index=None, dst_type=1, quant_mode="pertoken",
                          dst_type_max=0.0):
        _check(smooth_scales is None and quant_mode == "pertoken" and dst_type == 1,
               "only per-token int8 without smoothing is modelled")
        xf = x.float()
        amax = xf.abs().amax(-1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8), scale

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                         group_sizes=None, y_scale=None):
        _check(offset is None and y_scale is None and x1_dtype is None and x2_dtype is None, "unmodelled arguments")
        _check(x1.dim() == 2, "x1 must be 2-D here")
        _check(bias is None or bias.dtype == torch.float32, "bias must be float32")
        if scale_dtype is not None:  # MX
            _check(scale_dtype == FLOAT8_E8M0FNU and pertoken_scale_dtype == FLOAT8_E8M0FNU,
                   "MX scales must be float8_e8m0fnu")
            _check(list(group_sizes) == [1, 1, 32], f"MX needs group_sizes [1, 1, 32], got {group_sizes}")
            _check(x1.dtype == E4M3 and x2.dtype == E4M3, "MX inputs are float8_e4m3fn")
            _check(pertoken_scale.size(-2) == scale.size(-3), "k dimension of scale and pertoken_scale differ")
            out = self._mx_matmul(x1, x2, scale, pertoken_scale)
        else:  # int8 w8a8, per-channel weight scale, per-token activation scale
            _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "w8a8 inputs are int8")
            _check(group_sizes is None, "w8a8 per-channel takes no group_sizes")
            _check(x2.shape[0] == x1.shape[1], f"x2 must be [K={x1.shape[1]}, N], got {tuple(x2.shape)}")
            _check(scale.dim() == 1 and scale.shape[0] == x2.shape[1], "scale must be [N]")
            _check(pertoken_scale.dim() == 1 and pertoken_scale.shape[0] == x1.shape[0], "pertoken_scale must be [M]")
            acc = torch.mm(x1.to(torch.int32), x2.to(torch.int32)).float()
            out = acc * pertoken_scale.float()[:, None] * scale.float()[None, :]
        if bias is not None:
            out = out + bias
        return out.to(output_dtype or torch.int8)

    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                           activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                           group_type=None, group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                           x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
        _check(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, "one x and one stacked [E, K, N] weight")
        _check(split_item in (2, 3) and group_type == 0 and group_list_type == 0,
               "modelled: one output, groups along M, cumulative group_list")
        _check(bias is None and offset is None and antiquant_scale is None and x_dtype is None
               and weight_dtype is None, "unmodelled arguments")
        xs, w, s, pts = x[0], weight[0], scale[0], per_token_scale[0]
        ends = group_list.tolist()
        _check(len(ends) == w.shape[0] and ends == sorted(ends) and ends[-1] <= xs.shape[0],
               f"group_list {ends} does not fit {w.shape[0]} experts and {xs.shape[0]} rows")
        out = torch.zeros(xs.shape[0], w.shape[2], dtype=output_dtype)
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                rows = slice(start, end)
                if scale_dtype is not None:
                    _check(scale_dtype == FLOAT8_E8M0FNU and per_token_scale_dtype == FLOAT8_E8M0FNU,
                           "MX scales must be float8_e8m0fnu")
                    out[rows] = self._mx_matmul(xs[rows], w[e], s[e], pts[rows]).to(output_dtype)
                else:
                    out[rows] = self.npu_quant_matmul(xs[rows], w[e], s[e], pertoken_scale=pts[rows],
                                                      output_dtype=output_dtype)
            start = end
        return [out]


def make_fake(swap_pairs: bool = False) -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    # importlib.util.find_spec (which transformers asks about torch_npu) needs a spec on a module in sys.modules
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    ops = _Ops(swap_pairs)
    for name in ("npu_dynamic_mx_quant", "npu_dynamic_quant", "npu_quant_matmul", "npu_grouped_matmul"):
        setattr(module, name, getattr(ops, name))
    module.float8_e8m0fnu = FLOAT8_E8M0FNU
    module.float4_e2m1fn_x2 = FLOAT4_E2M1FN_X2
    module.hifloat8 = HIFLOAT8
    return module
