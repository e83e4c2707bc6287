"""KDA on GPUs through fla-core (``fla.ops.kda``, ``fla.modules``): Triton kernels for the short conv, the fused
gate, the gated RMSNorm and the chunked / fused-recurrent delta rule — architecture.md section 5.

Same functions, arguments and layouts as :mod:`vllm_glm53.backends.cpu.kda` (the oracle the tests compare with),
so a layer can use either module. What this module adapts around fla:

  * conv state: the ops see ``[C, K-1]`` (the last K-1 pre-conv inputs, oldest first; the layer passes a view of
    vLLM's pool in whichever of its two layouts it uses); fla's prefill conv keeps all ``K`` columns (``[N, C,
    K]``, the oldest never read): a zero column is prepended on the way in and dropped on the way out. The
    decode-time conv is this module's own small Triton kernel, which reads and writes the states in place,
    through slot indices, at any strides.
  * recurrent state: key-major ``[H, dk, dv]`` float32 on both sides (fla's default; vLLM's own Triton kernels
    use the transposed value-major layout — ``state_v_first`` would select it).
  * state slots: the batch ops :data:`kda_varlen` and :data:`causal_conv1d_varlen` read the step plan
    (:class:`~vllm_glm53.backends.plans.StateSlots`). A step of plain decodes runs fla's fused recurrent kernel
    and this module's conv kernel directly on vLLM's pools (read and written in place through slot indices);
    a step whose requests all verify drafts runs fla's speculative mode (one slot per draft position, starting
    from the slot of the last accepted token). Other steps (prefills, mixes) go request by request through
    the per-sequence kernels (:func:`vllm_glm53.backends.cpu.kda.delta_rule_per_request`), which reads the plan
    back to the host.
  * scale: the layer passes q already L2-normalised and scaled (``l2norm_qk``), so fla's own scale is 1.

fla's ``chunk_kda`` works in chunks of 64 tokens; the ``chunk_size`` argument is accepted for signature
compatibility with the oracle (whose result does not depend on it either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.modules.causal_conv1d import causal_conv1d as _fla_conv
from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.ops.kda import chunk_kda as _fla_chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as _fla_recurrent_fwd
from fla.ops.kda.gate import fused_kda_gate as _fla_kda_gate

# L2 normalisation stays plain torch: two elementwise passes that fuse well under torch.compile, and the exact
# expression the oracle uses (fla's fused variant lives inside chunk_kda, which the layer does not ask for).
from vllm_glm53.backends.cpu.kda import conv_per_request, delta_rule_per_request
from vllm_glm53.backends.cpu.kda import l2norm_qk_torch as l2norm_qk
from vllm_glm53.backends.dispatch import Op
from vllm_glm53.backends.plans import StateSlots

__all__ = [
    "causal_conv1d",
    "causal_conv1d_varlen",
    "kda_gate",
    "l2norm_qk",
    "kda_chunked",
    "kda_recurrent",
    "kda_varlen",
    "gated_rmsnorm",
]


# --------------------------------------------------------------------------------------------------------------
# Short causal depthwise convolution (+ SiLU)
# --------------------------------------------------------------------------------------------------------------


def _full_window(state: torch.Tensor) -> torch.Tensor:
    """``[..., C, K-1]`` -> fla's ``[..., C, K]`` (a leading zero column, which no output reads)."""
    return torch.nn.functional.pad(state, (1, 0)).contiguous()


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence, then SiLU (see the oracle for the exact contract).

    x ``[T, C]``, weight ``[C, K]``, state ``[C, K-1]`` or None. Returns ``(y [T, C] x.dtype, new state [C, K-1])``,
    the new state in the old state's dtype (``x.dtype`` without one). fla accumulates in float32.
    """
    h0 = None if state is None else _full_window(state.to(x.dtype)).unsqueeze(0)
    y, final = _fla_conv(
        x.unsqueeze(0), weight=weight.contiguous(), initial_state=h0, output_final_state=True, activation="silu"
    )
    new_state = final[0, :, 1:].to(x.dtype if state is None else state.dtype)
    return y[0], new_state.contiguous()


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, pool_ptr, slots_ptr, y_ptr,
    C, stride_xb, stride_pn, stride_pc, stride_pk,
    K: tl.constexpr, BC: tl.constexpr,
):
    b = tl.program_id(0)
    chans = tl.program_id(1) * BC + tl.arange(0, BC)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # A negative slot is padding: its state is left alone, its output is 0. (The slot is broadcast before the
    # `&`: Triton's interpreter rejects a scalar-and-vector mask.)
    ok = (chans < C) & (tl.zeros((BC,), tl.int64) + slot >= 0)
    state = pool_ptr + slot * stride_pn + chans * stride_pc
    x = tl.load(x_ptr + b * stride_xb + chans, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.load(w_ptr + chans * K + (K - 1), mask=ok, other=0.0)
    for j in tl.static_range(K - 1):  # window column j = the j-th oldest input; the state keeps the last K-1
        old = tl.load(state + j * stride_pk, mask=ok, other=0.0).to(tl.float32)
        y += old * tl.load(w_ptr + chans * K + j, mask=ok, other=0.0)
        if j > 0:
            tl.store(state + (j - 1) * stride_pk, old.to(pool_ptr.dtype.element_ty), mask=ok)
    tl.store(state + (K - 2) * stride_pk, x.to(pool_ptr.dtype.element_ty), mask=ok)
    y = y * tl.sigmoid(y)
    tl.store(y_ptr + b * C + chans, y.to(y_ptr.dtype.element_ty), mask=chans < C)


causal_conv1d_varlen = Op("causal_conv1d_varlen")
kda_varlen = Op("kda_varlen")


def _plain_decode_check(*args, **kwargs) -> str | None:
    plan = args[3] if len(args) > 3 else kwargs["plan"]
    if plan.max_query_len != 1 or plan.state_out.shape[1] != 1:
        return "a step of single-token requests storing in place only"
    return None


def _zero_fresh(pool: torch.Tensor, plan: StateSlots) -> None:
    """Fresh requests (no state in) start from zeros: clear their output slot first, without reading the plan
    back (other rows write their own value back; padding rows address slot -1 the same way)."""
    dst = plan.state_out[:, 0]
    fresh = (plan.state_in < 0).view(-1, *([1] * (pool.dim() - 1)))
    pool[dst] = torch.where(fresh, torch.zeros((), dtype=pool.dtype, device=pool.device), pool[dst])


@causal_conv1d_varlen.register("triton", _plain_decode_check)
def _conv_decode(x, weight, pool, plan):
    """One token per request on the conv states ``pool[slot]`` in place (this module's Triton kernel)."""
    _zero_fresh(pool, plan)
    T, C = x.shape
    n = plan.num_reqs
    y = torch.zeros_like(x)
    if T == 0:
        return y
    # Each token's slot, -1 for tokens of no request (the kernel leaves -1 alone and writes zeros); requests
    # without a token (padding) scatter into a spare last entry.
    first = plan.cu_seqlens[:n]
    live = (plan.cu_seqlens[1 : n + 1] > first) & (plan.state_out_at[:, 0] >= 0)
    token_slot = torch.full((T + 1,), -1, dtype=torch.int64, device=x.device)
    token_slot.scatter_(0, torch.where(live, first, T), torch.where(live, plan.state_out[:, 0], -1))
    xs = x if x.stride(-1) == 1 else x.contiguous()
    K = weight.shape[-1]
    BC = 256
    _conv_update_kernel[(T, triton.cdiv(C, BC))](
        xs, weight.to(torch.float32).contiguous(), pool, token_slot[:T].contiguous(), y,
        C, xs.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        K=K, BC=BC,
    )
    return y


@causal_conv1d_varlen.register("fla")
def causal_conv1d_varlen_fla(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                             plan: StateSlots) -> torch.Tensor:
    """Short causal conv + SiLU for a whole batch over the conv-state pool (the oracle's contract): request by
    request through fla's conv kernel."""
    return conv_per_request(causal_conv1d, x, weight, pool, plan)


# --------------------------------------------------------------------------------------------------------------
# Gates and normalisations
# --------------------------------------------------------------------------------------------------------------


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g ``[..., H, dk]`` float32 from ``a`` (``dt_bias`` already added) — fla's fused gate:
    ``lower_bound * sigmoid(exp(A_log) * a)`` when bounded, ``-exp(A_log) * softplus(a)`` otherwise."""
    return _fla_kda_gate(a.contiguous(), A_log.to(torch.float32).contiguous(), None, lower_bound, torch.float32)


def gated_rmsnorm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over ``dv`` (weight ``[dv]`` shared by the heads) times ``sigmoid(gate)``, fla's fused kernel."""
    dv = o.shape[-1]
    y = _fla_rms_norm_gated(
        o.reshape(-1, dv).contiguous(), gate.reshape(-1, dv).contiguous(), weight, None, activation="sigmoid", eps=eps
    )
    return y.view(o.shape).to(out_dtype or o.dtype)


# --------------------------------------------------------------------------------------------------------------
# The delta rule
# --------------------------------------------------------------------------------------------------------------


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule for one sequence (fla ``chunk_kda``): q, k, g ``[T, H, dk]`` (q, k normalised and
    scaled), v ``[T, H, dv]``, beta ``[T, H]``, initial_state ``[H, dk, dv]`` or None (not modified).
    Returns ``(o [T, H, dv] fp32, state [H, dk, dv] fp32)``."""
    h0 = None if initial_state is None else initial_state.to(torch.float32).unsqueeze(0).contiguous()
    o, state = _fla_chunk_kda(
        *(t.unsqueeze(0).contiguous() for t in (q, k, v, g, beta)),
        scale=1.0,
        initial_state=h0,
        output_final_state=True,
    )
    return o[0].to(torch.float32), state[0]


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule for one sequence (fla's fused recurrent kernel); shapes as :func:`kda_chunked`."""
    H, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    state = torch.zeros(1, H, dk, dv, dtype=torch.float32, device=k.device)
    if initial_state is not None:
        state[0] = initial_state
    o, state = _fla_recurrent_fwd(
        *(t.unsqueeze(0).contiguous() for t in (q, k, v, g, beta)),
        scale=1.0,
        initial_state=state,
        inplace_final_state=True,
    )
    return o[0].to(torch.float32), state[0]


def _recurrent_on_pool(q, k, v, g, beta, pool, slots, num_accepted_tokens, query_start_loc) -> torch.Tensor:
    """fla's fused recurrent kernel reading and writing ``pool`` in place through ``slots`` (its continuous-
    batching mode). fla addresses a slot as ``pool + slot * pool.stride(0)`` with the [H, dk, dv] state inside
    contiguous, which is how vLLM lays out its state pools."""
    o, _ = _fla_recurrent_fwd(
        *(t.unsqueeze(0).contiguous() for t in (q, k, v, g, beta)),
        scale=1.0,
        initial_state=pool,
        inplace_final_state=True,
        cu_seqlens=query_start_loc.to(torch.int64),
        ssm_state_indices=slots.to(torch.int64).contiguous(),
        num_accepted_tokens=None if num_accepted_tokens is None else num_accepted_tokens.to(torch.int64),
    )
    return o[0].to(torch.float32)


def _pool_check(*args, **kwargs) -> str | None:
    pool = args[5] if len(args) > 5 else kwargs["pool"]
    if pool.dtype != torch.float32 or not pool[0].is_contiguous():
        return "needs a float32 pool whose [H, dk, dv] states are contiguous"
    return None


def _decode_check(*args, **kwargs) -> str | None:
    plan = args[6] if len(args) > 6 else kwargs["plan"]
    if plan.max_query_len != 1 or plan.state_out.shape[1] != 1:
        return "a step of single-token requests storing in place only"
    return _pool_check(*args, **kwargs)


def _speculative_check(*args, **kwargs) -> str | None:
    plan = args[6] if len(args) > 6 else kwargs["plan"]
    if plan.state_out.shape[1] == 1:
        return "no draft columns in the plan"
    if plan.num_tokens != plan.num_reqs * plan.state_out.shape[1]:
        return "needs every request to verify the full number of drafts"
    return _pool_check(*args, **kwargs)


@kda_varlen.register("fla_recurrent", _decode_check)
def _kda_decode(q, k, v, g, beta, pool, plan, chunk_size=64):
    """Plain decode: fla's fused recurrent kernel on the pool in place, one token per request (a request without
    a token, padding, has its state read and written back unchanged)."""
    _zero_fresh(pool, plan)
    return _recurrent_on_pool(q, k, v, g, beta, pool, plan.state_out[:, 0], None, plan.cu_seqlens)


@kda_varlen.register("fla_speculative", _speculative_check)
def _kda_speculative(q, k, v, g, beta, pool, plan, chunk_size=64):
    """Every request verifies drafts: fla's speculative mode on the pool. Its rule (start from draft column
    ``num_accepted - 1``, store after token i into column i) is the plan's when the start slot is copied into
    column 0 first and every request starts there."""
    pool[plan.state_out[:, 0]] = pool[plan.state_in]
    ones = torch.ones(plan.num_reqs, dtype=torch.int64, device=q.device)
    return _recurrent_on_pool(q, k, v, g, beta, pool, plan.state_out, ones, plan.cu_seqlens)


@kda_varlen.register("fla")
def kda_varlen_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   pool: torch.Tensor, plan: StateSlots, chunk_size: int = 64) -> torch.Tensor:
    """The delta rule for a whole batch over the state pool (the oracle's contract): request by request through
    fla's chunked kernel."""
    return delta_rule_per_request(kda_chunked, q, k, v, g, beta, pool, plan, chunk_size)
