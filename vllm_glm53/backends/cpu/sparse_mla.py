"""Absorbed NoPE sparse MLA over the cached latent, plain PyTorch — architecture.md section 6.

Per head h, with ``[W_UK[h]; W_UV[h]]`` the rows of ``kv_b_proj`` for that head and ``c_s`` the normalised
latent (``kv_a_layernorm`` output) of token s:
    q_lat[t, h] = W_UK[h]^T q_nope[t, h]
    o_lat[t, h] = sum_{s in S_t} softmax_s(scale * q_lat[t, h] . c_s) c_s
    o[t, h]     = W_UV[h] o_lat[t, h]
which equals attention with ``k_s = W_UK[h] c_s``, ``v_s = W_UV[h] c_s`` restricted to the selected set S_t.

The attention is an :class:`~vllm_glm53.backends.dispatch.Op`: a ``compiled`` implementation (csrc/sparse_mla.cpp)
when the kernels are built and take the call, else plain PyTorch (the ``*_torch`` forms, the reference the kernel
is tested against). :data:`sparse_latent_attention_paged` is the batch-wide op the layer calls, over the paged
cache and the step plan (:class:`~vllm_glm53.backends.plans.LatentCachePlan`): the kernel reads only the selected
rows, in place, so a decode step costs O(index width) however long the context. :data:`write_tokens` stores a
step's latent rows and raw indexer inputs in the pages: the reference is
:func:`vllm_glm53.backends.pages.write_tokens_torch` (~20 tensor ops, ~55 us of a decode step on the development
machine), the compiled form copies the rows in one call. :data:`absorb_q` and :data:`apply_uv` (per-head
products with W_UK / W_UV) are torch's batched GEMM, except for bfloat16 on a CPU with AMX tiles, where the
compiled ``head_products`` streams the weights prepacked as tiles (:func:`head_tiles`).
"""

from __future__ import annotations

import torch

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.cpu.paged import sequence_rows
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check
from vllm_glm53.backends.pages import LatentPages, write_tokens_torch
from vllm_glm53.backends.plans import LatentCachePlan

__all__ = ["split_kv_b", "absorb_q", "apply_uv", "sparse_latent_attention", "sparse_latent_attention_paged",
           "write_tokens"]

# Upper bound on the elements of one query chunk's intermediate (gathered latents or logits): ~64 MiB in fp32.
_CHUNK_ELEMS = 1 << 24


def split_kv_b(
    kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_b_proj.weight [H*(dn+dv), L]`` (per head: dn key rows then dv value rows) into
    ``w_uk [H, dn, L]`` and ``w_uv [H, dv, L]``.

    On a CPU without native arithmetic for a 16-bit weight dtype the two come back in float32, so that
    :func:`absorb_q` and :func:`apply_uv` multiply in float32: torch's bfloat16 batched GEMMs there convert inside
    their loops (on an AVX2 machine a 2,048-token prefill spent 70 % of its time in these two products). They
    are a small part of the weights (2 x the latent x the heads' key and value widths per MLA layer)."""
    w = kv_b_weight.view(num_heads, nope_dim + v_dim, kv_b_weight.shape[-1])
    if w.device.type == "cpu":
        from vllm_glm53.backends.cpu.linear import widens

        if widens(w.dtype):
            w = w.float()
    return w[:, :nope_dim].contiguous(), w[:, nope_dim:].contiguous()


absorb_q = Op("absorb_q")
apply_uv = Op("apply_uv")


def head_tiles(w: torch.Tensor) -> torch.Tensor:
    """Per-head weights ``w [H, K, N]`` (input-major) laid out as the compiled ``head_products`` reads them:
    ``[H, N/16, K/32, 16, 16, 2]``, per block of 16 outputs and 32 inputs the AMX B tile (input pairs down the
    rows, outputs across), the blocks in the order the kernel streams them."""
    H, K, N = w.shape
    return w.reshape(H, K // 32, 16, 2, N // 16, 16).permute(0, 4, 1, 2, 5, 3).contiguous()


def _tiles_of(w: torch.Tensor, input_major) -> torch.Tensor:
    """``w``'s :func:`head_tiles`, made on first use and kept with the weight (a second copy of these small
    per-layer weights, as long as the weight lives)."""
    tiles = getattr(w, "_glm53_head_tiles", None)
    if tiles is None:
        tiles = head_tiles(input_major(w))
        w._glm53_head_tiles = tiles
    return tiles


def _tiles_check(x: torch.Tensor, w: torch.Tensor, k_dim: int, n_dim: int) -> str | None:
    if not kernels.amx_tiles():
        return "runs on AMX tiles only (a CPU with AMX-BF16, the avx512 kernels)"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"needs bfloat16 tokens and weights, got {x.dtype} and {w.dtype}"
    if w.shape[k_dim] % 32 or w.shape[n_dim] % 16 or x.stride(-1) != 1:
        return f"needs inputs in 32s and outputs in 16s (weight {tuple(w.shape)}) and unit-stride tokens"
    return _head_tensors(x, w)


_head_tensors = compiled_kernels_check(lambda x, w: (x, w))


@absorb_q.register("compiled", lambda q_nope, w_uk: _tiles_check(q_nope, w_uk, 1, 2))
def _absorb_q_compiled(q_nope, w_uk):
    return kernels.ops().head_products(q_nope, _tiles_of(w_uk, lambda w: w), w_uk.shape[2])


@absorb_q.register("torch")
def absorb_q_torch(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_lat[t, h] = W_UK[h]^T q_nope[t, h]``: ``[T, H, dn] x [H, dn, L] -> [T, H, L]`` in ``q_nope.dtype``,
    computed in the wider of the two dtypes."""
    wide = _wider(q_nope.dtype, w_uk.dtype)
    out = torch.bmm(q_nope.transpose(0, 1).to(wide), w_uk.to(wide))  # [H, T, L]
    return out.transpose(0, 1).to(q_nope.dtype)


@apply_uv.register("compiled", lambda o_lat, w_uv: _tiles_check(o_lat, w_uv, 2, 1))
def _apply_uv_compiled(o_lat, w_uv):
    return kernels.ops().head_products(o_lat, _tiles_of(w_uv, lambda w: w.transpose(1, 2)), w_uv.shape[1])


@apply_uv.register("torch")
def apply_uv_torch(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o[t, h] = W_UV[h] o_lat[t, h]``: ``[T, H, L] x [H, dv, L] -> [T, H, dv]`` in ``o_lat.dtype``, computed in
    the wider of the two dtypes."""
    wide = _wider(o_lat.dtype, w_uv.dtype)
    out = torch.bmm(o_lat.transpose(0, 1).to(wide), w_uv.to(wide).transpose(1, 2))  # [H, T, dv]
    return out.transpose(0, 1).to(o_lat.dtype)


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).bits >= torch.finfo(b).bits else b


def _masked_softmax(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``keep``; a row with nothing kept gives all zeros."""
    logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


sparse_latent_attention = Op("sparse_latent_attention")
sparse_latent_attention_paged = Op("sparse_latent_attention_paged")
write_tokens = Op("write_tokens")


def _one_page_check(q_lat, latent, indices, scale, max_chunk_elems=_CHUNK_ELEMS):
    if latent.shape[0] == 0:
        return "empty latent"
    if latent.stride(-1) != 1:
        return "needs latent rows with contiguous values"
    return _tensors_check(q_lat, latent)


_tensors_check = compiled_kernels_check(lambda q_lat, latent: (q_lat, latent))


@sparse_latent_attention.register("compiled", _one_page_check)
def _sparse_latent_attention_compiled(q_lat, latent, indices, scale, max_chunk_elems=_CHUNK_ELEMS):
    # The whole sequence as one page of S rows.
    table = torch.zeros(1, 1, dtype=torch.int64)
    starts = torch.tensor([0, q_lat.shape[0]], dtype=torch.int64)
    return kernels.ops().sparse_latent_attention(q_lat, latent.unsqueeze(0), table, starts, indices, scale,
                                                 latent.shape[1])


def _paged_check(q_lat, rows, plan, indices, scale, latent_dim):
    return "needs cache rows with contiguous values" if rows.stride(-1) != 1 else _tensors_check(q_lat, rows)


@sparse_latent_attention_paged.register("compiled", _paged_check)
def _sparse_latent_attention_paged_compiled(q_lat, rows, plan, indices, scale, latent_dim):
    return kernels.ops().sparse_latent_attention(q_lat, rows, plan.block_table, plan.cu_seqlens, indices, scale,
                                                 latent_dim)


@sparse_latent_attention_paged.register("torch")
def sparse_latent_attention_paged_torch(
    q_lat: torch.Tensor,
    rows: torch.Tensor,
    plan: LatentCachePlan,
    indices: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """:func:`sparse_latent_attention` for a whole batch, reading the paged cache.

    q_lat ``[T, H, L]``: the queries of all requests, the plan's request r's at ``cu_seqlens[r]:cu_seqlens[r+1]``;
    rows ``[num_blocks, block_size, R]``: cache pages whose first ``latent_dim`` (= L) values per row are the
    latent, found through the plan's block table; indices ``[T, N]`` positions within each query's request,
    -1 = unused. Returns ``o_lat [T, H, L]`` in q_lat's dtype.

    Plain torch: per request, gather its rows and attend (it reads the plan back to the host: a reference form).
    """
    starts, lens = plan.cu_seqlens.tolist(), plan.seq_lens.tolist()
    out = torch.zeros_like(q_lat)
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        if hi > lo:
            latent = sequence_rows(rows, plan.block_table[r], lens[r])[:, :latent_dim]
            out[lo:hi] = sparse_latent_attention_torch(q_lat[lo:hi], latent, indices[lo:hi], scale)
    return out


@sparse_latent_attention.register("torch")
def sparse_latent_attention_torch(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    max_chunk_elems: int = _CHUNK_ELEMS,
) -> torch.Tensor:
    """Attention of absorbed queries over the selected latent rows of one sequence.

    q_lat: ``[Tq, H, L]`` (see :func:`absorb_q`); latent: ``[S, L]`` the normalised ``c_kv`` of positions
    ``0..S-1`` (rows may be strided, e.g. a column slice of cache rows); indices: ``[Tq, N]`` positions to
    attend (distinct within a row, any order), -1 = unused; scale: softmax scale (``qk_head_dim ** -0.5``).
    Returns ``o_lat [Tq, H, L]`` in ``q_lat.dtype`` (apply :func:`apply_uv` next). Softmax and accumulation in
    float32; a query with no valid index gets zeros.

    Plain torch: two equivalent vectorised forms, chosen per call by cost: gather the N selected rows per query (long
    contexts), or score all S rows and mask (when S is not much larger than N, e.g. dense prefill). Queries are
    processed in chunks so no intermediate exceeds ``max_chunk_elems`` elements.
    """
    Tq, H, L = q_lat.shape
    S = latent.shape[0]
    N = indices.shape[1]
    out = torch.empty(Tq, H, L, dtype=torch.float32, device=q_lat.device)
    lat = latent.to(torch.float32)
    gather = S > 2 * N
    per_query = N * (L + H) if gather else H * S + S
    step = max(1, max_chunk_elems // max(per_query, 1))

    for start in range(0, Tq, step):
        q = q_lat[start : start + step].to(torch.float32)  # [t, H, L]
        idx = indices[start : start + step].to(torch.int64)
        valid = idx >= 0
        t = q.shape[0]
        if gather:
            kv = lat[idx.clamp(min=0)]  # [t, N, L]
            logits = torch.bmm(q, kv.transpose(1, 2)) * scale  # [t, H, N]
            probs = _masked_softmax(logits, valid.unsqueeze(1))
            out[start : start + t] = torch.bmm(probs, kv)
        else:
            keep = torch.zeros(t, S + 1, dtype=torch.bool, device=q.device)
            keep.scatter_(1, torch.where(valid, idx, S), True)
            keep = keep[:, :S]
            logits = torch.matmul(q, lat.t()) * scale  # [t, H, S]
            probs = _masked_softmax(logits, keep.unsqueeze(1))
            out[start : start + t] = torch.matmul(probs, lat)
    return out.to(q_lat.dtype)


_write_check = compiled_kernels_check(lambda pages, slot_mapping, latent, key_gate: (pages.latent, latent, key_gate))


@write_tokens.register("compiled", _write_check)
def _write_tokens_compiled(pages: LatentPages, slot_mapping: torch.Tensor, latent: torch.Tensor,
                           key_gate: torch.Tensor | None) -> None:
    kernels.ops().write_tokens(pages.latent, pages.raw, slot_mapping, latent, key_gate)


write_tokens.register("torch")(write_tokens_torch)
