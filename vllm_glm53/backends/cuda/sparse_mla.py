"""Absorbed NoPE sparse MLA over the cached latent on GPUs — architecture.md section 6.

Same functions and results as :mod:`vllm_glm53.backends.cpu.sparse_mla` (the oracle). ``split_kv_b``,
``absorb_q`` and ``apply_uv`` are batched GEMMs and stay torch; :func:`sparse_latent_attention` runs

  * FlashMLA's sparse kernel when the installed vLLM ships it for this device (Hopper / Blackwell DC), the
    query is bf16 and the latent is 512 wide: vLLM 0.32 serves GLM-5.3's NoPE layout (head size 512 =
    latent 512 + RoPE 0) through it. Queries are zero-padded to a multiple of 64 heads and index rows to a
    multiple of 128 columns (-1), as that kernel requires.
  * otherwise this module's Triton kernel: one program per (query, block of heads, split of the index row);
    it gathers the selected latent rows by index, keeps an online softmax in float32, and for decode (few
    queries) splits the index row across programs and merges the partial results by their log-sum-exp
    (flash-decoding), so a single query still spreads over the GPU.

:func:`sparse_latent_attention_paged` (the batch form) is the Triton kernel reading the selected rows in place
through the block table, one launch per batch; FlashMLA is not used there (it wants the latent as contiguous
512-wide rows, while the plugin's cache rows also carry the indexer keys).

``VLLM_GLM53_SPARSE_MLA=triton`` forces the Triton kernel (e.g. to compare, or if a FlashMLA build misbehaves).
FP8 latent caches are not handled here: on Hopper GLM-5.3 runs with a BF16 KV cache (FlashInfer's SM90 sparse
plan rejects the FP8 view, and FlashMLA's FP8 layout assumes a 64-wide RoPE part); FP8 KV is a Blackwell path.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from vllm_glm53.backends.cpu.sparse_mla import absorb_q_torch as absorb_q, apply_uv_torch as apply_uv, split_kv_b
from vllm_glm53.backends.dispatch import Op
from vllm_glm53.backends.pages import write_tokens_torch as write_tokens  # the torch form (indexing kernels)
from vllm_glm53.backends.plans import LatentCachePlan

__all__ = ["split_kv_b", "absorb_q", "apply_uv", "sparse_latent_attention", "sparse_latent_attention_paged",
           "write_tokens"]

# Programs that keep a current GPU busy; below this many (query, head-block) pairs the index row is split.
_TARGET_PROGRAMS = 256
_BLOCK_N = 32
_MAX_SPLITS = 32  # the merge holds one row per split in registers


@triton.jit
def _sparse_mla_kernel(
    q_ptr, lat_ptr, idx_ptr, o_ptr, lse_ptr, bt_ptr, req_ptr,
    H, N, n_per_split, scale,
    stride_qt, stride_qh, stride_lat, stride_it, stride_bt, stride_blk, block_size,
    L: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
    SPLIT: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    cols = tl.arange(0, BL)
    head_ok = heads < H
    col_ok = cols < L
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=head_ok[:, None] & col_ok[None, :], other=0.0)

    # A finite start for the running max keeps exp(m_old - m_new) defined while every index so far is invalid.
    m = tl.full((BH,), -1.0e30, tl.float32)
    denom = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BL), tl.float32)
    start = split * n_per_split
    end = tl.minimum(start + n_per_split, N)
    if PAGED:  # positions are the query's request's; its block-table row maps them to cache pages
        bt_row = bt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_bt
    for n0 in range(start, end, BN):
        offs = n0 + tl.arange(0, BN)
        idx = tl.load(idx_ptr + t * stride_it + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        pos = tl.where(valid, idx, 0).to(tl.int64)
        if PAGED:
            page = tl.load(bt_row + pos // block_size, mask=valid, other=0).to(tl.int64)
            row_off = page * stride_blk + (pos % block_size) * stride_lat
        else:
            row_off = pos * stride_lat
        kv = tl.load(lat_ptr + row_off[:, None] + cols[None, :],
                     mask=valid[:, None] & col_ok[None, :], other=0.0).to(q.dtype)  # [BN, BL]
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale  # [BH, BN] float32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m = m_new

    has_any = denom > 0
    out = acc / tl.where(has_any, denom, 1.0)[:, None]  # a query with nothing selected gets zeros
    o_mask = head_ok[:, None] & col_ok[None, :]
    if SPLIT:
        # Partial result of this split, normalised, plus its log-sum-exp for the merge.
        base = (t * tl.num_programs(2) + split) * H
        tl.store(o_ptr + (base + heads[:, None]) * L + cols[None, :], out, mask=o_mask)
        lse = tl.where(has_any, m + tl.log(tl.where(has_any, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + base + heads, lse, mask=head_ok)
    else:
        tl.store(o_ptr + (t * H + heads[:, None]) * L + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, o_ptr,
    H, SPLITS,
    L: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BL)
    splits = tl.arange(0, BS)
    split_ok = splits < SPLITS
    lse = tl.load(lse_ptr + (t * SPLITS + splits) * H + h, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(m > float("-inf"), m, 0.0))  # all -inf (nothing selected): all weights 0
    part = tl.load(part_ptr + ((t * SPLITS + splits)[:, None] * H + h) * L + cols[None, :],
                   mask=split_ok[:, None] & (cols < L)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + (t * H + h) * L + cols, acc.to(o_ptr.dtype.element_ty), mask=cols < L)


def _triton_sparse_attention(
    q_lat: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, scale: float, num_splits: int | None,
    paging: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """The Triton path. ``latent`` is ``[S, L]`` rows, or with ``paging = (block_table, request of each
    query, block stride, block size)`` the cache pages' base with rows ``latent.stride(0)`` apart."""
    Tq, H, L = q_lat.shape
    N = indices.shape[1]
    out = torch.empty(Tq, H, L, dtype=q_lat.dtype, device=q_lat.device)
    if Tq == 0:
        return out
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    indices = indices.contiguous()
    BH = 16  # tl.dot needs >= 16 rows; smaller head counts are masked
    BL = max(16, triton.next_power_of_2(L))
    head_blocks = triton.cdiv(H, BH)
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(N, 4 * _BLOCK_N), _TARGET_PROGRAMS // (Tq * head_blocks), _MAX_SPLITS))
    n_per_split = triton.cdiv(triton.cdiv(N, num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = triton.cdiv(N, n_per_split) if N else 1
    precision = "ieee" if q_lat.dtype == torch.float32 else None
    if paging is None:
        block_table, req, stride_blk, block_size, paged = indices, indices, 0, 1, False
    else:
        (block_table, req, stride_blk, block_size), paged = paging, True
    common = dict(L=L, BH=BH, BN=_BLOCK_N, BL=BL, PAGED=paged, PRECISION=precision)
    args = (H, N, n_per_split if num_splits > 1 else max(N, 1), scale,
            q_lat.stride(0), q_lat.stride(1), latent.stride(0), indices.stride(0), block_table.stride(0),
            stride_blk, block_size)
    if num_splits == 1:
        _sparse_mla_kernel[(Tq, head_blocks, 1)](
            q_lat, latent, indices, out, out, block_table, req, *args, SPLIT=False, **common
        )
        return out
    part = torch.empty(Tq, num_splits, H, L, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(Tq, num_splits, H, dtype=torch.float32, device=q_lat.device)
    _sparse_mla_kernel[(Tq, head_blocks, num_splits)](
        q_lat, latent, indices, part, lse, block_table, req, *args, SPLIT=True, **common
    )
    _merge_splits_kernel[(Tq, H)](part, lse, out, H, num_splits, L=L, BL=BL, BS=triton.next_power_of_2(num_splits))
    return out


def _flashmla_sparse_attention(fwd, q_lat: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor,
                               scale: float) -> torch.Tensor:
    Tq, H, L = q_lat.shape
    heads = -(-H // 64) * 64
    width = -(-indices.shape[1] // 128) * 128
    q = q_lat.new_zeros(Tq, heads, L)
    q[:, :H] = q_lat
    idx = torch.full((Tq, 1, width), -1, dtype=torch.int32, device=q_lat.device)
    idx[:, 0, : indices.shape[1]] = indices
    kv = latent.to(torch.bfloat16).contiguous().view(latent.shape[0], 1, L)
    out = fwd(q, kv, idx, scale)[0]
    return out[:, :H].to(q_lat.dtype)


sparse_latent_attention = Op("sparse_latent_attention")
sparse_latent_attention_paged = Op("sparse_latent_attention_paged")


def _flashmla_check(q_lat, latent, indices, scale, max_chunk_elems=1 << 24, num_splits=None) -> str | None:
    from vllm_glm53 import envs

    if envs.VLLM_GLM53_SPARSE_MLA == "triton":
        return "VLLM_GLM53_SPARSE_MLA=triton"
    if num_splits is not None:
        return "an explicit num_splits is a Triton setting"
    if not q_lat.is_cuda:
        return f"needs CUDA tensors, got {q_lat.device.type}"
    if q_lat.dtype != torch.bfloat16:
        return f"needs bfloat16, got {q_lat.dtype}"
    if q_lat.shape[-1] != 512 or latent.shape[-1] != 512:
        return f"needs a 512-wide latent, got {latent.shape[-1]}"
    from vllm_glm53 import _vllm

    return None if _vllm.flashmla_sparse_fwd() is not None else "this vLLM ships no FlashMLA sparse kernel"


@sparse_latent_attention.register("flashmla", _flashmla_check)
def _sparse_latent_attention_flashmla(q_lat, latent, indices, scale, max_chunk_elems=1 << 24, num_splits=None):
    from vllm_glm53 import _vllm

    return _flashmla_sparse_attention(_vllm.flashmla_sparse_fwd(), q_lat, latent, indices, scale)


@sparse_latent_attention.register("triton")
def sparse_latent_attention_triton(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    max_chunk_elems: int = 1 << 24,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of absorbed queries over the selected latent rows of one sequence (see the oracle).

    q_lat ``[Tq, H, L]``; latent ``[S, L]`` (rows may be strided, e.g. the latent columns of cache rows);
    indices ``[Tq, N]`` positions (distinct within a row, any order, -1 unused); softmax in float32. Returns
    ``o_lat [Tq, H, L]`` in ``q_lat.dtype``. ``max_chunk_elems`` is the oracle's memory knob (same default) and
    has no meaning here: nothing is materialised per query; ``num_splits`` overrides the split of each index row
    across programs (default: chosen from the batch size).
    """
    return _triton_sparse_attention(q_lat, latent, indices, scale, num_splits)


@sparse_latent_attention_paged.register("triton")
def sparse_latent_attention_paged(
    q_lat: torch.Tensor,
    rows: torch.Tensor,
    plan: LatentCachePlan,
    indices: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """:func:`sparse_latent_attention` for a whole batch, reading the selected rows straight from the paged
    cache (the oracle's contract): q_lat ``[T, H, L]`` with the plan's request r's queries at
    ``cu_seqlens[r]:cu_seqlens[r+1]``; rows ``[num_blocks, block_size, R]`` pages whose first ``latent_dim``
    values per row are the latent, found through the plan's block table; indices ``[T, N]`` positions within
    each query's request (-1 unused). One launch for the batch; nothing is gathered or read back."""
    if rows.stride(-1) != 1:
        raise ValueError("sparse_latent_attention_paged needs cache rows with contiguous values")
    cu = plan.cu_seqlens
    req = torch.repeat_interleave(torch.arange(plan.num_reqs, device=q_lat.device), cu[1:] - cu[:-1],
                                  output_size=q_lat.shape[0])
    # The kernel addresses row ``off`` of page ``b`` as base + b * rows.stride(0) + off * rows.stride(1): pass the
    # latent columns of the first page as the base view (its row stride is the pages' row stride).
    paging = (plan.block_table.contiguous(), req, rows.stride(0), rows.shape[1])
    return _triton_sparse_attention(q_lat, rows[0, :, :latent_dim], indices, scale, None, paging)
