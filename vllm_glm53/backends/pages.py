"""The sparse-MLA cache page layout (described in :mod:`vllm_glm53.backends.latent_cache`) as tensor views, and the
writes of a step. Only torch: the op backends and their tests use it without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_glm53.config import MIN_CACHE_BLOCK

__all__ = ["LatentPages", "cache_rows", "raw_pools", "raw_pools_needed", "page_views", "fresh_pages",
           "write_tokens_torch"]


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The bound cache as ``[num_blocks, block_size, row]`` whatever singleton head axis vLLM gave it."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(1) if kv_cache.shape[1] == 1 else kv_cache.squeeze(2)
    return kv_cache


@dataclass(frozen=True)
class LatentPages:
    """Views of one sparse-MLA layer's cache pages (layout: backends/latent_cache.py): ``latent [num_blocks, bs, L]``,
    ``pooled [num_blocks, bs / kp, dI]``, ``raw [num_blocks, raw_pools, kp - 1, 2 dI]`` (pool p of a page keeps its
    raw inputs in raw slot ``p % raw_pools``)."""

    latent: torch.Tensor
    pooled: torch.Tensor
    raw: torch.Tensor

    @property
    def kp(self) -> int:
        return self.raw.shape[2] + 1


def raw_pools(block_size: int, row_size: int, latent_dim: int, index_dim: int, kp: int) -> int:
    """How many pools' raw inputs a page of ``block_size`` rows of ``row_size`` values keeps: what the latent and
    the pooled keys leave, in whole pools."""
    left = block_size * (row_size - latent_dim) - block_size // kp * index_dim
    return max(left, 0) // ((kp - 1) * 2 * index_dim)


def raw_pools_needed(num_speculative_tokens: int, kp: int) -> int:
    """Raw slots a page needs so that no step overwrites inputs a later step still reads: a request's step writes
    positions ``c .. c + num_speculative_tokens`` of which all but the first may be rejected and rewritten, so the
    inputs of every pool those positions touch (at most this many) stay needed until the next step."""
    return (kp - 1 + num_speculative_tokens) // kp + 1


def page_views(kv_cache: torch.Tensor, latent_dim: int, index_dim: int, kp: int) -> LatentPages:
    """The three regions of the pages ``kv_cache`` (``[num_blocks, block_size, cache_row_size]``, any singleton
    head axis), as views sharing its memory."""
    rows = cache_rows(kv_cache)
    nb, bs, R = rows.shape
    if bs % kp:
        raise ValueError(f"the sparse-MLA cache needs a block size that is a multiple of index_kpool ({kp}), "
                         f"got {bs}")
    if rows.stride(2) != 1 or rows.stride(1) != R or rows.stride(0) < bs * R:
        raise ValueError(f"sparse-MLA cache pages must be contiguous within a page, got strides {rows.stride()}")
    L, dI, pools = latent_dim, index_dim, bs // kp
    slots = raw_pools(bs, R, L, dI, kp)
    if slots < 1:
        raise ValueError(f"pages of {bs} rows of {R} values do not hold latent {L}, the pooled keys and one pool's "
                         f"raw indexer inputs (keys of {dI}, pools of {kp})")
    page, at = rows.stride(0), rows.storage_offset()
    return LatentPages(
        latent=rows.as_strided((nb, bs, L), (page, L, 1), at),
        pooled=rows.as_strided((nb, pools, dI), (page, dI, 1), at + bs * L),
        raw=rows.as_strided((nb, slots, kp - 1, 2 * dI), (page, (kp - 1) * 2 * dI, 2 * dI, 1),
                            at + bs * L + pools * dI),
    )


def fresh_pages(num_tokens: int, row_size: int, latent_dim: int, index_dim: int, kp: int, dtype: torch.dtype,
                device: torch.device | str) -> LatentPages:
    """One zeroed page for ``num_tokens`` tokens (rounded up to whole pools, at least the smallest block):
    vLLM's profiling and dummy runs, whose plan (:meth:`LatentCachePlan.fresh`) puts every token in block 0."""
    bs = max(-(-max(num_tokens, 1) // kp) * kp, MIN_CACHE_BLOCK)
    return page_views(torch.zeros(1, bs, row_size, dtype=dtype, device=device), latent_dim, index_dim, kp)


def write_tokens_torch(pages: LatentPages, slot_mapping: torch.Tensor, latent: torch.Tensor,
                       key_gate: torch.Tensor | None) -> None:
    """Store the step's tokens at cache slots ``slot_mapping [T]`` (slot = block * block_size + offset; -1:
    padding, not stored): ``latent [T, L]`` in the latent region and, for an indexer layer, ``key_gate [T, 2 dI]``
    (raw key, then gate logits) in the raw region for the tokens that do not complete their pool (offset % kp <
    kp - 1: block sizes are multiples of kp, so that is the position's place in its pool) and lie in one of the
    last ``raw_pools`` pools the step writes in their page (the only ones a later step can read: every earlier pool
    of the page is completed, and compressed, by this step). Call it after the step's
    :func:`~vllm_glm53.backends.cpu.indexer.store_pooled_keys`, which reads the earlier steps' inputs that these
    writes may replace."""
    bs, kp = pages.latent.shape[1], pages.kp
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    blocks, offsets = slots // bs, slots % bs
    pages.latent[blocks, offsets] = latent[valid].to(pages.latent.dtype)
    if key_gate is None or slots.numel() == 0:
        return
    n_slots = pages.raw.shape[1]
    pool = offsets // kp
    # A page being written belongs to one request, whose tokens are consecutive and ascending in the batch: the last
    # pool the step writes in a token's page is that of the last token of its run (found without a host read).
    run_end = torch.ones_like(blocks, dtype=torch.bool)
    run_end[:-1] = blocks[1:] != blocks[:-1]
    index = torch.arange(blocks.numel(), device=blocks.device)
    last = torch.where(run_end, index, blocks.numel()).flip(0).cummin(0).values.flip(0)
    j = offsets % kp
    keep = (j < kp - 1) & (pool > pool[last] - n_slots)
    pages.raw[blocks[keep], pool[keep] % n_slots, j[keep]] = key_gate[valid][keep].to(pages.raw.dtype)
