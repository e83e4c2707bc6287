"""KDA (Kimi Delta Attention) ops for the CPU — architecture.md section 5.

The batch-wide ops the layer calls, one call per step for every request (decodes, prefills, prefill chunks
continuing a cached state, speculative verification), reading and writing vLLM's state pools through the step
plan (:class:`~vllm_glm53.backends.plans.StateSlots`):

  * :data:`causal_conv1d_varlen`: the short causal conv + SiLU over the conv-state pool;
  * :data:`kda_varlen`: the delta rule over the recurrent-state pool.

Each is an :class:`~vllm_glm53.backends.dispatch.Op` with a ``compiled`` implementation (csrc/kda.cpp, the exact
recurrence token by token with each state group held in L1) and a ``torch`` one (per request: the chunked form
below between store points), the reference the kernel is tested against. So are the per-head ops around them,
:data:`kda_gate` (the bounded forget gate), :data:`l2norm_qk` and :data:`gated_rmsnorm` (csrc/kda_gates.cpp: one
pass per head instead of five to a dozen tensor ops, whose dispatch was their cost in a decode step), with their
``*_torch`` forms as references. The per-sequence forms stay as the references they are: :func:`kda_recurrent`
(naive, token by token), :func:`kda_chunked` (the chunked WY form, always chunked) and :func:`causal_conv1d`.

Layouts:
  * activations ``[T, C]`` token-major; heads ``[T, H, d]``;
  * short-conv weight ``[C, K]`` (tap ``K-1`` multiplies the current token), conv state ``[C, K-1]`` = the last
    ``K-1`` *pre-conv* inputs, oldest first; pools ``[N, C, K-1]`` at any strides (the layer passes a view of
    vLLM's pool: tap after tap, its default, or channel after channel);
  * recurrent state ``[H, dk, dv]`` float32, KEY-major (rows are key channels), the layout of transformers and
    fla; pools ``[N, H, dk, dv]``. vLLM's own Triton kernels use the transposed ``[H, dv, dk]``; callers that
    share a pool with them must transpose.

The delta rule, per head, for token t (decay before the read):
    S <- Diag(exp g_t) S ;  r = S^T k_t ;  S <- S + k_t (beta_t (v_t - r))^T ;  o_t = S^T q_t
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check
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


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence, then SiLU.

    x: ``[T, C]`` pre-conv activations; weight: ``[C, K]`` (float32 in the checkpoint); state: ``[C, K-1]`` the
    previous ``K-1`` inputs (oldest first) or None for a fresh sequence (zeros).
    Returns ``y [T, C]`` in ``x.dtype`` (conv and SiLU in float32, like the reference) and the new state
    ``[C, K-1]`` = the last ``K-1`` inputs of (history + x), so a short chunk (``T < K-1``) keeps the older
    history it still needs. The new state has the old state's dtype (``x.dtype`` when there was none).
    """
    T, C = x.shape
    K = weight.shape[-1]
    if state is None:
        state = x.new_zeros(C, K - 1)
    # [C, K-1+T]: history followed by the new inputs, in the conv's float32 working precision.
    window = torch.cat([state.to(torch.float32), x.t().to(torch.float32)], dim=1)
    y = F.conv1d(window.unsqueeze(0), weight.to(torch.float32).unsqueeze(1), groups=C).squeeze(0)  # [C, T]
    new_state = window[:, window.shape[1] - (K - 1) :].to(state.dtype).contiguous()
    return F.silu(y).t().to(x.dtype), new_state


# --------------------------------------------------------------------------------------------------------------
# Gates and normalisations
# --------------------------------------------------------------------------------------------------------------


kda_gate = Op("kda_gate")
l2norm_qk = Op("l2norm_qk")
gated_rmsnorm = Op("gated_rmsnorm")


def _per_head_check(*tensors_of):
    """The compiled check of a per-head op: the kernels' dtypes on the CPU, and the first tensor ``[T, H, d]``."""
    kernel_check = compiled_kernels_check(*tensors_of)

    def check(x, *args, **kwargs):
        if x.dim() != 3:
            return f"reads [T, H, d], got {tuple(x.shape)}"
        return kernel_check(x, *args, **kwargs)

    return check


_gate_tensors = _per_head_check(lambda a, A_log, lower_bound: (a, A_log))


def _bounded_gate_check(a, A_log, lower_bound):
    if lower_bound is None:
        return "the unbounded (softplus) gate is torch's only"
    return _gate_tensors(a, A_log, lower_bound)


@kda_gate.register("compiled", _bounded_gate_check)
def _kda_gate_compiled(a, A_log, lower_bound):
    return kernels.ops().kda_gate(a, A_log, lower_bound)


@kda_gate.register("torch")
def kda_gate_torch(a: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g ``[..., H, dk]`` (float32) from ``a = f_b(f_a(x)) + dt_bias`` viewed ``[..., H, dk]``.

    Bounded ("safe") gate: ``g = lower_bound * sigmoid(exp(A_log[h]) * a)`` in (lower_bound, 0).
    Unbounded (``lower_bound is None``): ``g = -exp(A_log[h]) * softplus(a)`` (softplus is linear above 20, like
    the reference, and uses log1p below, which differs from ``log(1 + exp(a))`` only by rounding).
    """
    a = a.to(torch.float32)
    rate = torch.exp(A_log.to(torch.float32)).unsqueeze(-1)  # [H, 1]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * a)
    return -rate * F.softplus(a, beta=1.0, threshold=20.0)


@l2norm_qk.register("compiled", _per_head_check(lambda q, k, head_dim: (q, k)))
def _l2norm_qk_compiled(q, k, head_dim):
    return kernels.ops().kda_l2norm_qk(q, k, head_dim**-0.5)


@l2norm_qk.register("torch")
def l2norm_qk_torch(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k per head in float32 (``x / sqrt(|x|^2 + 1e-6)``, eps inside the root as in fla)
    and fold the attention scale ``head_dim ** -0.5`` into q."""
    q = q.to(torch.float32)
    k = k.to(torch.float32)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * head_dim**-0.5, k


@gated_rmsnorm.register("compiled", _per_head_check(lambda o, gate, weight, *a, **k: (o, gate, weight)))
def _gated_rmsnorm_compiled(o, gate, weight, eps, out_dtype=None):
    return kernels.ops().kda_gated_rmsnorm(o, gate, weight, eps, out_dtype or o.dtype)


@gated_rmsnorm.register("torch")
def gated_rmsnorm_torch(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Output gate of KDA: RMSNorm over the last dim (``dv``) with the weight ``[dv]`` shared by all heads, times
    ``sigmoid(gate)``. All in float32; returned in ``out_dtype`` (default ``o.dtype``)."""
    of = o.to(torch.float32)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    of = of * weight.to(torch.float32) * torch.sigmoid(gate.to(torch.float32))
    return of.to(out_dtype or o.dtype)


# --------------------------------------------------------------------------------------------------------------
# The delta rule
# --------------------------------------------------------------------------------------------------------------


def _initial_state(initial_state: torch.Tensor | None, H: int, dk: int, dv: int, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(H, dk, dv, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32).clone()


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule for one sequence — the oracle for :func:`kda_chunked` (fine for tiny T).

    q, k ``[T, H, dk]`` (already normalised / scaled), v ``[T, H, dv]``, g ``[T, H, dk]`` log-decay,
    beta ``[T, H]``, initial_state ``[H, dk, dv]`` or None. Returns ``(o [T, H, dv] fp32, state [H, dk, dv] fp32)``;
    the input state is not modified.
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.to(torch.float32) for t in (q, k, v, g, beta))
    S = _initial_state(initial_state, H, dk, dv, k.device)
    o = torch.empty(T, H, dv, dtype=torch.float32, device=k.device)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)
        r = torch.einsum("hkv,hk->hv", S, k[t])
        S = S + k[t].unsqueeze(-1) * (beta[t].unsqueeze(-1) * (v[t] - r)).unsqueeze(-2)
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return o, S


# Sub-block size for the intra-chunk decay products: pairs inside a sub-block are formed elementwise
# ([H, C, c, dk] values), pairs across sub-blocks by GEMMs.
_SUB_BLOCK = 8


def _intra_chunk(
    G: torch.Tensor, G_lo: torch.Tensor, k: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted products inside one chunk, per head: ``A[t, s] = sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]}``
    for s < t and ``B[t, s]`` the same with ``q_t`` for s <= t (zeros elsewhere), both ``[H, C, C]``.

    ``G + G_lo`` is the cumulative log decay (non-increasing in t). Across sub-blocks J < I the decay is split at
    ``r`` = last token of block J: ``e^{G_t - G_s} = e^{G_t - G_r} e^{G_r - G_s}`` with s <= r <= t, so both
    factors are <= 1 and the product becomes a GEMM that cannot overflow. Inside a sub-block it is formed
    elementwise.
    """
    H, C, dk = k.shape
    c = math.gcd(C, _SUB_BLOCK)
    nb = C // c
    Gb, Lb, kb, qb = (x.reshape(H, nb, c, dk) for x in (G, G_lo, k, q))
    block_causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()

    # Diagonal sub-blocks: [H, nb, t, s, dk] = e^{G_t - G_s} k_s (zero for s > t), in place in one buffer.
    w = Gb.unsqueeze(3) - Gb.unsqueeze(2)
    w.add_(Lb.unsqueeze(3)).sub_(Lb.unsqueeze(2))
    w.masked_fill_(~block_causal[:, :, None], float("-inf"))
    w.exp_().mul_(kb.unsqueeze(2))
    diag = torch.matmul(w, torch.stack([kb, qb], dim=-1))  # [H, nb, t, s, 2]
    del w

    if nb == 1:
        A, B = diag[:, 0, ..., 0], diag[:, 0, ..., 1]
    else:
        Gr, Lr = Gb[:, :, -1:, :], Lb[:, :, -1:, :]  # [H, nb, 1, dk] reference = end of each block
        right = torch.exp((Gr - Gb) + (Lr - Lb)) * kb  # [H, J, s, dk], exponents <= 0
        later = torch.arange(nb, device=k.device)
        later = later.view(nb, 1) > later.view(1, nb)  # [I, J]: I strictly after J
        left = (Gb.unsqueeze(2) - Gr.unsqueeze(1)) + (Lb.unsqueeze(2) - Lr.unsqueeze(1))  # [H, I, J, t, dk]
        left = torch.exp(left.masked_fill_(~later[:, :, None, None], float("-inf")))
        right_t = right.transpose(-1, -2).unsqueeze(1)  # [H, 1, J, dk, s]
        blocks_A = torch.matmul(left * kb.unsqueeze(2), right_t)  # [H, I, J, t, s]
        blocks_B = torch.matmul(left * qb.unsqueeze(2), right_t)
        idx = torch.arange(nb, device=k.device)
        blocks_A[:, idx, idx] = diag[..., 0]
        blocks_B[:, idx, idx] = diag[..., 1]
        A = blocks_A.transpose(2, 3).reshape(H, C, C)
        B = blocks_B.transpose(2, 3).reshape(H, C, C)
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    return A.masked_fill(~strict, 0.0), B


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) delta rule for one sequence: same maths, shapes and results as
    :func:`kda_recurrent`, ``(o [T, H, dv], state [H, dk, dv])`` float32, the input state not modified. ``g`` must be <= 0 (a decay), which both gate forms guarantee.

    Within a chunk with entry state S0, cumulative log-decay ``G_t = sum_{s<=t} g_s`` (per key channel, summed
    inside the chunk only) and ``u_s = beta_s (v_s - r_s)``:
        u   = L^{-1} diag(beta) (V - (e^G * K) S0),   L = I + diag(beta) A,
        A[t,s] = sum_c k_t[c] k_s[c] e^{G_t[c]-G_s[c]}        (s < t)
        o_t = (e^{G_t} * q_t)^T S0 + sum_{s<=t} B[t,s] u_s,  B[t,s] = sum_c q_t[c] k_s[c] e^{G_t[c]-G_s[c]}
        S1  = e^{G_last} * S0 + sum_s (e^{G_last-G_s} * k_s) u_s^T
    Every exponential is of some ``G_t - G_s`` with s <= t, hence <= 0: nothing can overflow however long the
    sequence or however strong the decay. The tail is zero-padded (k = v = g = beta = 0 leaves the state
    untouched).
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    device = k.device
    n_chunks = (T + C - 1) // C
    pad = n_chunks * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, C, ...] float32
        x = x.to(torch.float32)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.reshape(n_chunks, C, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    # Within-chunk cumulative log decay [N, H, C, dk] (<= 0, decreasing in t), summed in float64 and kept as an
    # fp32 pair hi + lo: with strong decay |G| reaches hundreds, where one fp32 ulp (~3e-5) would show up as a
    # relative error in exp(G_t - G_s) for nearby t, s; hi_t - hi_s is exact there, lo restores the rest.
    G64 = gc.to(torch.float64).cumsum(dim=2)
    G = G64.to(torch.float32)
    G_lo = (G64 - G.to(torch.float64)).to(torch.float32)

    eye = torch.eye(C, dtype=torch.float32, device=device).expand(H, C, C)
    S = _initial_state(initial_state, H, dk, dv, device)
    out = torch.empty(n_chunks, H, C, dv, dtype=torch.float32, device=device)

    for n in range(n_chunks):
        Gn, Gl, kn, qn, bn = G[n], G_lo[n], kc[n], qc[n], bc[n]
        A, B = _intra_chunk(Gn, Gl, kn, qn)
        # L^{-1} by a triangular solve against I, then one GEMM: measured ~1.7x faster on CPU than solving for
        # the (dv + dk)-wide right-hand side directly.
        L_inv = torch.linalg.solve_triangular(eye + bn.unsqueeze(-1) * A, eye, upper=False, unitriangular=True)
        decay_q, decay_k = torch.exp(Gn) * qn, torch.exp(Gn) * kn
        W = L_inv @ (torch.cat([vc[n], decay_k], dim=-1) * bn.unsqueeze(-1))  # [H, C, dv + dk]
        U = W[..., :dv] - W[..., dv:] @ S  # [H, C, dv]

        out[n] = decay_q @ S + B @ U
        G_last = Gn[:, -1:, :]  # [H, 1, dk]
        to_end = (G_last - Gn) + (Gl[:, -1:, :] - Gl)  # G_last - G_s, same split as above
        S = torch.exp(G_last).transpose(1, 2) * S + (torch.exp(to_end) * kn).transpose(1, 2) @ U

    o = out.transpose(1, 2).reshape(n_chunks * C, H, dv)[:T]
    return o, S


# --------------------------------------------------------------------------------------------------------------
# Batch-wide ops over the state pools
# --------------------------------------------------------------------------------------------------------------

causal_conv1d_varlen = Op("causal_conv1d_varlen")
kda_varlen = Op("kda_varlen")


def _pool_rows_contiguous(*args, **kwargs) -> str | None:
    pool = args[5] if len(args) > 5 else kwargs["pool"]
    if pool.dtype != torch.float32:
        return f"needs a float32 state pool, got {pool.dtype}"
    return None if pool.stride(-1) == 1 else "needs state rows with contiguous values"


def _both(*checks):
    def check(*args, **kwargs):
        for c in checks:
            reason = c(*args, **kwargs)
            if reason is not None:
                return reason
        return None

    return check


@causal_conv1d_varlen.register("compiled", compiled_kernels_check(lambda x, weight, pool, plan: (x, weight, pool)))
def _causal_conv1d_varlen_compiled(x, weight, pool, plan):
    return kernels.ops().causal_conv1d_varlen(x, weight, pool, plan.cu_seqlens, plan.state_in, plan.state_out,
                                              plan.state_out_at)


@causal_conv1d_varlen.register("torch")
def causal_conv1d_varlen_torch(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                               plan: StateSlots) -> torch.Tensor:
    """Short causal conv + SiLU for a whole batch over the conv-state pool ``[N, C, K-1]``: x ``[T, C]``,
    weight ``[C, K]``; each request reads its window from ``pool[plan.state_in[r]]`` (zeros for -1) and stores
    the window after each of its store points (:class:`StateSlots`). Returns ``[T, C]`` in ``x.dtype``, zeros
    for tokens outside every request. Plain torch: :func:`conv_per_request` with :func:`causal_conv1d`."""
    return conv_per_request(causal_conv1d, x, weight, pool, plan)


def conv_per_request(conv, x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                     plan: StateSlots) -> torch.Tensor:
    """:data:`causal_conv1d_varlen` one request at a time with a backend's per-sequence ``conv`` (the signature
    of :func:`causal_conv1d`), split at the request's store points. It reads the plan back to the host: a
    reference form, not a decode path."""
    y = torch.zeros_like(x)
    for first, length, slot_in, outs in plan.rows():
        if length == 0:
            continue
        state = pool[slot_in] if slot_in >= 0 else torch.zeros_like(pool[0])
        t = 0
        for after, slot in outs + [(length - 1, None)]:
            if after + 1 > t:
                y[first + t : first + after + 1], state = conv(x[first + t : first + after + 1], weight, state)
                t = after + 1
            if slot is not None:
                pool[slot] = state
    return y


@kda_varlen.register("compiled", _both(
    compiled_kernels_check(lambda q, k, v, g, beta, pool, plan, chunk_size=64: (q, k, v, g, beta)),
    _pool_rows_contiguous))
def _kda_varlen_compiled(q, k, v, g, beta, pool, plan, chunk_size=64):
    f32 = (t.to(torch.float32) for t in (q, k, v, g, beta))
    return kernels.ops().kda_varlen(*f32, pool, plan.cu_seqlens, plan.state_in, plan.state_out, plan.state_out_at)


@kda_varlen.register("torch")
def kda_varlen_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, plan: StateSlots, chunk_size: int = 64) -> torch.Tensor:
    """The delta rule for a whole batch over the state pool ``[N, H, dk, dv]`` float32: q, k, g ``[T, H, dk]``
    (q, k normalised and scaled), v ``[T, H, dv]``, beta ``[T, H]``; request r starts from
    ``pool[plan.state_in[r]]`` (zeros for -1) and stores the state after each of its store points
    (:class:`StateSlots`). Returns o ``[T, H, dv]`` float32, zeros for tokens outside every request.

    Plain torch: a batch of single tokens that store in place (plain decode) is one gather, step and scatter,
    without reading the plan back; anything else :func:`delta_rule_per_request` with :func:`kda_chunked`
    (``chunk_size``)."""
    if plan.max_query_len == 1 and plan.state_out.shape[1] == 1:
        o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
        return _decode_torch(q, k, v, g, beta, pool, plan, o)
    return delta_rule_per_request(kda_chunked, q, k, v, g, beta, pool, plan, chunk_size)


def delta_rule_per_request(chunked, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, pool: torch.Tensor, plan: StateSlots,
                           chunk_size: int = 64) -> torch.Tensor:
    """:data:`kda_varlen` one request at a time with a backend's per-sequence ``chunked`` delta rule (the
    signature of :func:`kda_chunked`), split at the request's store points. It reads the plan back to the host:
    a reference form, not a decode path."""
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    for first, length, slot_in, outs in plan.rows():
        if length == 0:
            continue
        state = pool[slot_in] if slot_in >= 0 else None
        t = 0
        for after, slot in outs + [(length - 1, None)]:
            if after + 1 > t:
                span = slice(first + t, first + after + 1)
                o[span], state = chunked(q[span], k[span], v[span], g[span], beta[span], state, chunk_size)
                t = after + 1
            if slot is not None:
                pool[slot] = state
    return o


def _decode_torch(q, k, v, g, beta, pool, plan, o):
    """One token per request, in plain torch without reading the plan back: gather, one step, scatter."""
    n = plan.num_reqs
    tok = plan.cu_seqlens[:n]
    live = ((plan.cu_seqlens[1 : n + 1] > tok) & (plan.state_out_at[:, 0] >= 0)).nonzero().squeeze(1)
    tok, slot_in = tok[live], plan.state_in[live]
    state = pool[slot_in.clamp(min=0)].masked_fill((slot_in < 0).view(-1, 1, 1, 1), 0.0)
    q, k, v, g, beta = (t[tok].to(torch.float32) for t in (q, k, v, g, beta))
    state = state * torch.exp(g).unsqueeze(-1)
    r = torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - r)).unsqueeze(-2)
    o[tok] = torch.einsum("bhkv,bhk->bhv", state, q)
    pool[plan.state_out[live, 0]] = state
    return o
