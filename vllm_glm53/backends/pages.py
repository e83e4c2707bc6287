"""The sparse-MLA cache page layout (described in :mod:`vllm_glm53.backends.latent_cache`) as tensor views, and the
writes of a step. Only torch: the op backends and their tests use it without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LatentPages", "cache_rows", "page_views", "fresh_pages", "write_tokens"]


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The bound cache as ``[num_blocks, block_size, row]`` whatever singleton head axis vLLM gave it."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(1) if kv_cache.shape[1] == 1 else kv_cache.squeeze(2)
    return kv_cache


@dataclass(frozen=True)
class LatentPages:
    """Views of one sparse-MLA layer's cache pages (layout: backends/latent_cache.py): ``latent [num_blocks, bs, L]``,
    ``pooled [num_blocks, bs / kp, dI]``, ``raw [num_blocks, bs / kp, kp - 1, 2 dI]``."""

    latent: torch.Tensor
    pooled: torch.Tensor
    raw: torch.Tensor

    @property
    def kp(self) -> int:
        return self.raw.shape[2] + 1


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
    if bs * L + pools * dI * (2 * kp - 1) > bs * R:
        raise ValueError(f"cache rows of {R} values do not hold latent {L} and indexer key {dI} in pools of {kp}")
    page, at = rows.stride(0), rows.storage_offset()
    return LatentPages(
        latent=rows.as_strided((nb, bs, L), (page, L, 1), at),
        pooled=rows.as_strided((nb, pools, dI), (page, dI, 1), at + bs * L),
        raw=rows.as_strided((nb, pools, kp - 1, 2 * dI), (page, (kp - 1) * 2 * dI, 2 * dI, 1),
                            at + bs * L + pools * dI),
    )


def fresh_pages(num_tokens: int, row_size: int, latent_dim: int, index_dim: int, kp: int, dtype: torch.dtype,
                device: torch.device | str) -> LatentPages:
    """One zeroed page for ``num_tokens`` tokens (rounded up to whole pools): vLLM's profiling and dummy runs,
    whose plan (:meth:`LatentCachePlan.fresh`) puts every token in block 0."""
    bs = -(-max(num_tokens, 1) // kp) * kp
    return page_views(torch.zeros(1, bs, row_size, dtype=dtype, device=device), latent_dim, index_dim, kp)


def write_tokens(pages: LatentPages, slot_mapping: torch.Tensor, latent: torch.Tensor,
                 key_gate: torch.Tensor | None) -> None:
    """Store the step's tokens at cache slots ``slot_mapping [T]`` (slot = block * block_size + offset; -1:
    padding, not stored): ``latent [T, L]`` in the latent region and, for an indexer layer, ``key_gate [T, 2 dI]``
    (raw key, then gate logits) in the raw region for every token that does not complete its pool (offset % kp <
    kp - 1: block sizes are multiples of kp, so that is the position's place in its pool)."""
    bs, kp = pages.latent.shape[1], pages.kp
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    blocks, offsets = slots // bs, slots % bs
    pages.latent[blocks, offsets] = latent[valid].to(pages.latent.dtype)
    if key_gate is not None:
        j = offsets % kp
        keep = j < kp - 1
        pages.raw[blocks[keep], offsets[keep] // kp, j[keep]] = key_gate[valid][keep].to(pages.raw.dtype)
