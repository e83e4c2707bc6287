"""The attention backend vLLM sees for the sparse-MLA layers: it owns the per-token cache row layout and
turns vLLM's per-batch metadata into what the layer needs (per-request token ranges, absolute positions,
cache slots).

One cache row per token and layer holds ``[c_kv (kv_lora_rank) | indexer key (dI) | pooling gate (dI)]``:
the normalised latent that attention reads, and the raw indexer inputs from which complete pools are
compressed. Keeping the indexer inputs in the same row (rather than in a third cache kind with its own page
size) keeps vLLM's hybrid page-size unification to two kinds, state pages and token pages.

The layer gets this backend from ``get_attn_backend()`` directly, never through the platform selector
(vLLM's CPU selector refuses sparse MLA outright).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_glm53._vllm import AttentionBackend, AttentionCGSupport, AttentionImplBase, AttentionMetadataBuilder


@dataclass
class LatentCacheMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64 on the CPU: token offsets of each request in the batch
    seq_lens: torch.Tensor  # [num_reqs] int64 on the CPU: tokens of each request including this step's
    block_table: torch.Tensor  # [num_reqs, max_blocks] cache block ids (kernel-block granularity)
    slot_mapping: torch.Tensor  # [num_actual_tokens] cache slot of each new token


class LatentCacheMetadataBuilder(AttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # any batch order works: the ops find each request by query_start_loc

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> LatentCacheMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return LatentCacheMetadata(
            num_reqs=n,
            num_actual_tokens=m.num_actual_tokens,
            # Host copies: the ops walk requests on the CPU (the CPU kernels) or build launch grids from them.
            query_start_loc=m.query_start_loc_cpu[: n + 1].to(torch.int64),
            seq_lens=m.seq_lens[:n].to("cpu", torch.int64),
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


class LatentCacheImpl(AttentionImplBase):
    """vLLM asks every backend for an impl class; the computation itself lives in the layer and the
    platform ops, so this only records what the runner inspects."""

    def __init__(self, num_heads: int = 1, head_size: int = 0, scale: float = 1.0, *args, **kwargs):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale


class LatentCacheBackend(AttentionBackend):
    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "GLM53_LATENT_CACHE"

    @staticmethod
    def get_impl_cls():
        return LatentCacheImpl

    @staticmethod
    def get_builder_cls():
        return LatentCacheMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, block_size, head_size)

    @classmethod
    def is_mla(cls) -> bool:
        return True


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The bound cache as ``[num_blocks, block_size, row]`` whatever singleton head axis vLLM gave it."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(1) if kv_cache.shape[1] == 1 else kv_cache.squeeze(2)
    return kv_cache


def write_rows(rows: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values [T, row]`` at cache slots ``slot_mapping [T]`` (slot = block * block_size + offset)."""
    block_size = rows.shape[1]
    valid = slot_mapping >= 0  # padded tokens carry slot -1
    slots = slot_mapping[valid].to(torch.int64)
    rows[slots // block_size, slots % block_size] = values[valid].to(rows.dtype)
