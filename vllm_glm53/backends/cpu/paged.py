"""Reading vLLM's paged cache from plain torch: the reference forms of the batch indexer and sparse-MLA ops gather
a request's rows from the cache pages through its block-table row (the compiled kernels read them in place)."""

from __future__ import annotations

import torch


def sequence_rows(rows: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of positions ``0..length-1`` of one request (a copy), from pages ``rows [num_blocks, block_size,
    R]`` and the request's block-table row."""
    block_size = rows.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return rows[block_ids[:n_blocks].to(torch.int64)].reshape(n_blocks * block_size, rows.shape[2])[:length]
