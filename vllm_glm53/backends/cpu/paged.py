"""Reading vLLM's paged cache from plain torch: the batch forms of the indexer and sparse-MLA ops take the
cache pages, a block table and per-request lengths, the layout the compiled kernels read in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sequence_rows(rows: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of positions ``0..length-1`` of one request (a copy), from pages ``rows [num_blocks, block_size,
    R]`` and the request's block-table row."""
    block_size = rows.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return rows[block_ids[:n_blocks].to(torch.int64)].reshape(n_blocks * block_size, rows.shape[2])[:length]


def as_index(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Offsets or lengths (a list from the attention metadata, or a tensor) as an int64 CPU tensor."""
    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int64)
    return torch.tensor(list(values), dtype=torch.int64)
