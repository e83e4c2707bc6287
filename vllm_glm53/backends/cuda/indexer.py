"""Lightning indexer with k-pool compression in Triton — architecture.md section 7.

Same functions, arguments and results as :mod:`vllm_glm53.backends.cpu.indexer` (the oracle): pools start at
position 0, only complete pools are scored, the query's own incomplete pool (the tail) is appended, rows come
back ascending and padded with -1.

Four kernels:
  * ``kpool_compress``: per (pool block, channel block), the softmax over the kp slots of each pool and channel
    and the weighted sum of the keys (key and gate rows may be strided views).
  * ``store_pooled_keys``: the same compression per token of the step that completes a pool, reading the raw
    inputs of the pool's tokens from the step where it writes them and from the page's raw slot otherwise, and
    writing ``K_p`` to the page's pooled keys (page layout: :mod:`vllm_glm53.backends.latent_cache`; the CPU
    module's docstring says why this needs no state outside the pages).
  * ``index_scores``: per (query block, pool block), one GEMM per indexer head, ReLU, and the head-weighted sum
    accumulated in registers: the ``[Tq, nI, P]`` logits never reach memory.
  * expansion (inside ``select_tokens``): selected pools -> their kp tokens, then the tail, then -1 padding.
The top-k itself is ``torch.topk`` over the masked scores, on the same row layout as the oracle, so exact ties
(ReLU makes many scores exactly 0) are broken the same way on the same device.

Precision: float32 inputs use exact float32 products (``ieee``), so a float32 checkpoint selects what the CPU
oracle selects up to near-ties; bf16/fp16 queries run the GEMM on tensor cores in that dtype with float32
accumulation (vLLM's own indexer goes further, to FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The dense shortcut and the row width are plain index arithmetic, identical on every device; the per-request
# batch loop is the CPU backend's, run with the Triton ops below.
from vllm_glm53.backends.cpu.indexer import (
    all_candidates_fit,
    dense_causal_indices,
    index_width,
    select_per_request,
)
from vllm_glm53.backends.dispatch import Op
from vllm_glm53.backends.pages import LatentPages
from vllm_glm53.backends.plans import LatentCachePlan

__all__ = [
    "kpool_compress",
    "store_pooled_keys",
    "index_scores",
    "select_tokens",
    "select_batch",
    "all_candidates_fit",
    "dense_causal_indices",
    "index_width",
]


def _precision(dtype: torch.dtype) -> str | None:
    """Exact float32 products for float32 inputs (TF32 would move near-tie selections); the default otherwise."""
    return "ieee" if dtype == torch.float32 else None


# --------------------------------------------------------------------------------------------------------------
# Pool compression
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _kpool_compress_kernel(
    k_ptr, gate_ptr, ape_ptr, out_ptr,
    P, stride_k, stride_g,
    D: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_d = tl.program_id(1)
    pools = pid_p * BP + tl.arange(0, BP)
    chans = pid_d * BD + tl.arange(0, BD)
    mask = (pools < P)[:, None] & (chans < D)[None, :]
    first = pools.to(tl.int64) * KP  # first token of each pool

    # Softmax over the KP slots, per pool and channel: max first, then the weighted sum (KP is 4: two cheap passes).
    m = tl.full((BP, BD), float("-inf"), tl.float32)
    for j in tl.static_range(KP):
        logit = tl.load(gate_ptr + (first + j)[:, None] * stride_g + chans[None, :], mask=mask, other=0.0)
        logit = logit.to(tl.float32) + tl.load(ape_ptr + j * D + chans, mask=chans < D, other=0.0)[None, :]
        m = tl.maximum(m, logit)
    denom = tl.zeros((BP, BD), tl.float32)
    acc = tl.zeros((BP, BD), tl.float32)
    for j in tl.static_range(KP):
        logit = tl.load(gate_ptr + (first + j)[:, None] * stride_g + chans[None, :], mask=mask, other=0.0)
        logit = logit.to(tl.float32) + tl.load(ape_ptr + j * D + chans, mask=chans < D, other=0.0)[None, :]
        e = tl.exp(logit - m)
        key = tl.load(k_ptr + (first + j)[:, None] * stride_k + chans[None, :], mask=mask, other=0.0)
        denom += e
        acc += e * key.to(tl.float32)
    tl.store(out_ptr + pools[:, None] * D + chans[None, :], acc / denom, mask=mask)


def kpool_compress(k: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """``K_p[c] = sum_j softmax_j(gate[p*kp+j, c] + ape[j, c]) * k[p*kp+j, c]`` over complete pools.

    k, gate_logits ``[T, dI]`` (rows may be strided views, the last dim must be contiguous), ape ``[kp, dI]``,
    T a multiple of kp. Returns ``[T // kp, dI]`` float32."""
    kp, D = ape.shape
    T = k.shape[0]
    if T % kp:
        raise ValueError(f"kpool_compress needs whole pools: {T} tokens, pool size {kp}")
    if k.stride(-1) != 1 or gate_logits.stride(-1) != 1:
        raise ValueError("kpool_compress needs contiguous channels in k and gate_logits")
    P = T // kp
    out = torch.empty(P, D, dtype=torch.float32, device=k.device)
    if P == 0:
        return out
    BP, BD = 16, min(triton.next_power_of_2(D), 128)
    grid = (triton.cdiv(P, BP), triton.cdiv(D, BD))
    _kpool_compress_kernel[grid](
        k, gate_logits, ape.to(torch.float32).contiguous(), out,
        P, k.stride(0), gate_logits.stride(0),
        D=D, KP=kp, BP=BP, BD=BD,
    )
    return out


@triton.jit
def _pool_token_inputs(raw_ptr, key_gate_ptr, slot_ptr, t, slot, block, raw_slot, j, stride_raw_block,
                       stride_raw_pool, stride_raw_tok, stride_kg, KP: tl.constexpr):
    """Where token j of the pool that batch token ``t`` completes has its raw inputs: the step's row when this step
    writes it (the batch token KP - 1 - j rows earlier, with a slot that much lower), else the page's raw slot."""
    d = KP - 1 - j
    earlier = tl.maximum(t - d, 0)
    in_step = (t >= d) & (tl.load(slot_ptr + earlier).to(tl.int64) == slot - d)
    page = raw_ptr + block * stride_raw_block + raw_slot * stride_raw_pool + j * stride_raw_tok
    return tl.where(in_step, key_gate_ptr + earlier * stride_kg, page)


@triton.jit
def _store_pooled_keys_kernel(
    pooled_ptr, raw_ptr, key_gate_ptr, slot_ptr, ape_ptr,
    stride_pooled_block, stride_pooled_pool, stride_raw_block, stride_raw_pool, stride_raw_tok, stride_kg,
    pools, raw_pools,
    D: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot % KP == KP - 1):
        block = slot // (pools * KP)
        pool = slot % (pools * KP) // KP
        raw_slot = pool % raw_pools
        chans = tl.arange(0, BD)
        ok = chans < D
        m = tl.full((BD,), float("-inf"), tl.float32)
        for j in tl.static_range(KP):
            src = _pool_token_inputs(raw_ptr, key_gate_ptr, slot_ptr, t, slot, block, raw_slot, j, stride_raw_block,
                                     stride_raw_pool, stride_raw_tok, stride_kg, KP)
            logit = tl.load(src + D + chans, mask=ok, other=0.0).to(tl.float32)
            m = tl.maximum(m, logit + tl.load(ape_ptr + j * D + chans, mask=ok, other=0.0))
        denom = tl.zeros((BD,), tl.float32)
        acc = tl.zeros((BD,), tl.float32)
        for j in tl.static_range(KP):
            src = _pool_token_inputs(raw_ptr, key_gate_ptr, slot_ptr, t, slot, block, raw_slot, j, stride_raw_block,
                                     stride_raw_pool, stride_raw_tok, stride_kg, KP)
            logit = tl.load(src + D + chans, mask=ok, other=0.0).to(tl.float32)
            e = tl.exp(logit + tl.load(ape_ptr + j * D + chans, mask=ok, other=0.0) - m)
            denom += e
            acc += e * tl.load(src + chans, mask=ok, other=0.0).to(tl.float32)
        dst = pooled_ptr + block * stride_pooled_block + pool * stride_pooled_pool
        tl.store(dst + chans, (acc / denom).to(pooled_ptr.dtype.element_ty), mask=ok)


store_pooled_keys = Op("store_pooled_keys")


@store_pooled_keys.register("triton")
def store_pooled_keys_triton(pages: LatentPages, plan: LatentCachePlan, key_gate: torch.Tensor,
                             ape: torch.Tensor) -> None:
    """Store the compressed key of every pool this step completes in the pages' pooled keys (the oracle's
    contract): one program per token of the step, those that complete no pool or are not stored (slot -1) exit
    at once. pages: the cache regions holding earlier steps' raw inputs (this step's are written after this
    call); key_gate ``[T, 2 dI]`` the step's raw inputs (those of the pool tokens this step writes are read from
    here); ape ``[kp, dI]``."""
    kp, D = ape.shape
    if plan.num_tokens == 0:
        return
    key_gate = key_gate[: plan.num_tokens].to(pages.raw.dtype).contiguous()
    pooled, raw = pages.pooled, pages.raw
    if pooled.stride(-1) != 1 or raw.stride(-1) != 1:
        raise ValueError("store_pooled_keys needs contiguous channels in the cache pages")
    _store_pooled_keys_kernel[(plan.num_tokens,)](
        pooled, raw, key_gate, plan.slot_mapping[: plan.num_tokens], ape.to(torch.float32).contiguous(),
        pooled.stride(0), pooled.stride(1), raw.stride(0), raw.stride(1), raw.stride(2), key_gate.stride(0),
        pooled.shape[1], raw.shape[1],
        D=D, KP=kp, BD=triton.next_power_of_2(D),
    )


# --------------------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, pooled_ptr, out_ptr,
    Tq, P, scale,
    stride_qt, stride_qh, stride_wt,
    NI: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_p = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    pools = pid_p * BP + tl.arange(0, BP)
    chans = tl.arange(0, BD)
    row_ok = rows < Tq
    pool_ok = pools < P
    chan_ok = chans < D

    # [BD, BP] pooled keys, loaded once for all heads.
    kT = tl.load(pooled_ptr + pools[None, :] * D + chans[:, None], mask=chan_ok[:, None] & pool_ok[None, :], other=0.0)
    acc = tl.zeros((BT, BP), tl.float32)
    for h in range(NI):
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + chans[None, :],
                    mask=row_ok[:, None] & chan_ok[None, :], other=0.0)
        logits = tl.dot(q, kT.to(q.dtype), input_precision=PRECISION)  # [BT, BP] float32
        w = tl.load(w_ptr + rows * stride_wt + h, mask=row_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(logits * scale, 0.0) * w[:, None]
    tl.store(out_ptr + rows[:, None] * P + pools[None, :], acc, mask=row_ok[:, None] & pool_ok[None, :])


def index_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Pool scores ``I[t, p] = sum_h w[t, h] * ReLU(dI**-0.5 * q[t, h] . K_p)`` in float32.

    q ``[Tq, nI, dI]``, weights ``[Tq, nI]`` (already scaled by ``nI**-0.5``), pooled ``[P, dI]``. Returns
    ``[Tq, P]``; causality is applied by :func:`select_tokens`."""
    Tq, NI, D = q.shape
    P = pooled.shape[0]
    out = torch.empty(Tq, P, dtype=torch.float32, device=q.device)
    if Tq == 0 or P == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    weights = weights.to(torch.float32)
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    # tl.dot wants every block dimension >= 16.
    BT, BP, BD = 16, 64, max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(Tq, BT), triton.cdiv(P, BP))
    _index_scores_kernel[grid](
        q, weights, pooled.to(torch.float32).contiguous(), out,
        Tq, P, D**-0.5,
        q.stride(0), q.stride(1), weights.stride(0),
        NI=NI, D=D, BT=BT, BP=BP, BD=BD, PRECISION=_precision(q.dtype),
    )
    return out


# --------------------------------------------------------------------------------------------------------------
# Selection: top-k over candidate pools, expansion to tokens plus the tail
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _expand_kernel(
    pools_ptr, n_chosen_ptr, positions_ptr, out_ptr,
    K, width,
    KP: tl.constexpr, TAIL: tl.constexpr, BW: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    n_pool_tokens = tl.load(n_chosen_ptr + t) * KP
    pos = tl.load(positions_ptr + t)
    in_pools = cols < n_pool_tokens
    slot = tl.where(in_pools, cols // KP, 0)
    pool = tl.load(pools_ptr + t * K + slot, mask=in_pools & (cols < width), other=0)
    out = tl.where(in_pools, pool * KP + cols % KP, -1)
    if TAIL:
        tail_start = (pos + 1) // KP * KP
        tail_len = (pos + 1) % KP
        in_tail = (cols >= n_pool_tokens) & (cols < n_pool_tokens + tail_len)
        out = tl.where(in_tail, tail_start + cols - n_pool_tokens, out)
    tl.store(out_ptr + t * width + cols, out, mask=cols < width)


def select_tokens(
    scores: torch.Tensor | None,
    positions: torch.Tensor,
    topk: int,
    kp: int,
    always_select_tail: bool = True,
) -> torch.Tensor:
    """Top-k pool selection and expansion to token indices — the oracle's contract exactly.

    scores ``[Tq, P]`` (P covering every complete pool of the latest query; ``ceil(seq_len / kp)`` columns
    reproduce transformers' tie-breaking), positions ``[Tq]``. Returns ``[Tq, index_width]`` int64, each row
    ascending, -1 padded."""
    positions = positions.to(torch.int64)
    if all_candidates_fit(int(positions.max()), topk, kp):
        return dense_causal_indices(positions, topk, kp, always_select_tail)
    if scores is None:
        raise ValueError("select_tokens needs scores once a query has more than topk // kp candidate pools")
    Tq, P = scores.shape
    K = topk // kp
    n_cand = (positions + 1) // kp
    if int(n_cand.max()) > P:
        raise ValueError(f"scores cover {P} pools but a query has {int(n_cand.max())} complete pools")

    candidate = torch.arange(P, device=scores.device).unsqueeze(0) < n_cand.unsqueeze(1)
    masked = scores.to(torch.float32).masked_fill(~candidate, torch.finfo(torch.float32).min)
    top = masked.topk(min(K, P), dim=1).indices
    # Non-candidates the top-k still returned (rows with fewer than K candidates) sort to the end and are cut
    # off by n_chosen; the rest come out ascending.
    n_chosen = torch.clamp(n_cand, max=K)
    top = torch.where(top < n_cand.unsqueeze(1), top, P).sort(dim=1).values.contiguous()

    width = index_width(topk, kp, always_select_tail)
    out = torch.empty(Tq, width, dtype=torch.int64, device=scores.device)
    BW = 256
    _expand_kernel[(Tq, triton.cdiv(width, BW))](
        top, n_chosen.contiguous(), positions.contiguous(), out,
        top.shape[1], width,
        KP=kp, TAIL=always_select_tail, BW=BW,
    )
    return out


select_batch = Op("select_batch")


@select_batch.register("triton")
def select_batch_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    pooled: torch.Tensor,
    plan: LatentCachePlan,
    topk: int,
    kp: int,
    always_select_tail: bool = True,
) -> torch.Tensor:
    """Index rows for every query of a batch from the paged cache (the oracle's contract): the plan's request r
    has its queries at ``cu_seqlens[r]:cu_seqlens[r+1]``, its last positions of ``seq_lens[r]``; pooled
    ``[num_blocks, block_size / kp, dI]`` holds the compressed key of every complete pool
    (:func:`store_pooled_keys`).

    Per request (:func:`~vllm_glm53.backends.cpu.indexer.select_per_request`, which reads the plan back to the
    host): its pooled keys are gathered from the pages, then scored and selected by the kernels above."""
    return select_per_request(index_scores, select_tokens, q, weights, pooled, plan, topk, kp, always_select_tail)
