"""KDA on GPUs through fla-core (``fla.ops.kda``, ``fla.modules``): Triton kernels for the short conv, the fused
gate, the gated RMSNorm and the chunked / fused-recurrent delta rule — architecture.md section 5.

Same functions, arguments and layouts as :mod:`vllm_glm53.backends.cpu.kda` (the oracle the tests compare with),
so a layer can use either module. What this module adapts around fla:

  * conv state: ours is ``[C, K-1]`` (the last K-1 pre-conv inputs, oldest first, as vLLM keeps it); fla's
    prefill conv keeps all ``K`` columns (``[N, C, K]``, the oldest never read): a zero column is prepended on
    the way in and dropped on the way out. The decode-time conv is this module's own small Triton kernel,
    which reads and writes vLLM's ``[C, K-1]`` states in place, through slot indices, at any strides.
  * recurrent state: key-major ``[H, dk, dv]`` float32 on both sides (fla's default; vLLM's own Triton kernels
    use the transposed value-major layout — ``state_v_first`` would select it).
  * state slots: :func:`kda_decode_step_slots` runs decode steps directly on a vLLM state pool
    ``[slots, H, dk, dv]`` (read and written in place through slot indices, no gather/scatter copies), and
    :func:`kda_spec_decode_slots` covers speculative decoding, where a request owns one slot per draft position
    and starts from the slot of its last accepted token (vLLM's GDN metadata provides exactly these tensors).
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
from vllm_glm53.backends.cpu.kda import l2norm_qk

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_update_slots",
    "kda_gate",
    "l2norm_qk",
    "kda_chunked",
    "kda_recurrent",
    "kda_decode_step",
    "kda_decode_step_slots",
    "kda_spec_decode_slots",
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


def causal_conv1d_update_slots(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One decode step on the conv states ``pool[slots[b]]`` of a state pool ``[N, C, K-1]`` (any strides),
    updated in place. x ``[B, C]``, weight ``[C, K]``. Returns SiLU(conv) ``[B, C]`` in ``x.dtype``; negative
    slots (padding) are left alone and give zeros."""
    B, C = x.shape
    K = weight.shape[-1]
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    BC = 256
    _conv_update_kernel[(B, triton.cdiv(C, BC))](
        x, weight.to(torch.float32).contiguous(), pool, slots.contiguous(), y,
        C, x.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        K=K, BC=BC,
    )
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One decode step for a batch: x ``[B, C]``, weight ``[C, K]``, state ``[B, C, K-1]`` updated IN PLACE.
    Returns SiLU(conv) ``[B, C]`` in ``x.dtype``."""
    return causal_conv1d_update_slots(x, weight, state, torch.arange(x.shape[0], device=x.device))


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


def _pool_ok(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.float32 and pool[0].is_contiguous()


def kda_decode_step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences on the states ``pool[slots[b]]`` of a state pool ``[N, H, dk, dv]``
    float32, updated in place (no gather/scatter copies). q, k, g ``[B, H, dk]``, v ``[B, H, dv]``, beta
    ``[B, H]``. Returns o ``[B, H, dv]`` float32; negative slots (padding) are left alone and give zeros."""
    B = q.shape[0]
    out = torch.zeros(B, v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    # fla's kernel has no padding slot: run the valid rows only (one host sync for the count).
    rows = torch.nonzero(slots >= 0).squeeze(1)
    if rows.numel() == 0:
        return out
    if rows.numel() < B:
        q, k, v, g, beta, slots = (t[rows] for t in (q, k, v, g, beta, slots))
    if _pool_ok(pool):
        o = _recurrent_on_pool(q, k, v, g, beta, pool, slots, None,
                               torch.arange(q.shape[0] + 1, device=q.device))
    else:  # an unusual layout: step gathered copies and write them back
        idx = slots.to(torch.int64)
        states = pool[idx].contiguous()
        o = _recurrent_on_pool(q, k, v, g, beta, states, torch.arange(q.shape[0], device=q.device), None,
                               torch.arange(q.shape[0] + 1, device=q.device))
        pool[idx] = states
    out[rows] = o
    return out


def kda_spec_decode_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> torch.Tensor:
    """Speculative decode steps on a state pool ``[N, H, dk, dv]`` float32, in place. ``query_start_loc [R+1]``
    splits the N tokens into R requests (1 + drafts each); ``slots [R, 1 + num_spec]`` holds each request's slot
    per draft position; ``num_accepted_tokens [R]`` how many tokens of the previous step were accepted. A
    request starts from the state in slot column ``num_accepted_tokens - 1`` and stores the state after its
    token i in column i, so the next step resumes from whichever draft is accepted. Returns o ``[N, H, dv]``."""
    if not _pool_ok(pool):
        raise ValueError("kda_spec_decode_slots needs a float32 pool whose [H, dk, dv] states are contiguous")
    return _recurrent_on_pool(q, k, v, g, beta, pool, slots, num_accepted_tokens, query_start_loc)


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences; ``state [B, H, dk, dv]`` float32 updated IN PLACE (see the oracle).
    Returns o ``[B, H, dv]`` float32."""
    return kda_decode_step_slots(q, k, v, g, beta, state, torch.arange(q.shape[0], device=q.device))
