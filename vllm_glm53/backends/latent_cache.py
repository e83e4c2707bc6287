"""The attention backend vLLM sees for the sparse-MLA layers: it owns the per-token cache row layout and
turns vLLM's per-batch metadata into the step plan every sparse-MLA layer reads,
:class:`~vllm_glm53.backends.plans.LatentCachePlan` (request token ranges, total and cached lengths, block
table, cache slots), once per step.

One cache row per token and layer holds ``[c_kv (kv_lora_rank) | indexer key (dI) | pooling gate (dI)]``:
the normalised latent that attention reads, and the indexer inputs. A token that completes a pool (position
``≡ kp - 1 (mod kp)``) has its pool's compressed key ``K_p`` in the key slot instead of its own raw key (its gate
slot is then unused), stored by the layer when it writes the row; every other token keeps its raw key and gate,
from which its pool is compressed when the pool's last token arrives (possibly in a later step or prefill
chunk). The indexer then reads one row per complete pool. Why this needs no per-sequence state, with speculative
drafts, chunked prefill and prefix caching: :mod:`vllm_glm53.backends.cpu.indexer`. Keeping the indexer inputs
in the same row (rather than in a third cache kind with its own page size) keeps vLLM's hybrid page-size
unification to two kinds, state pages and token pages.

The layer gets this backend from ``get_attn_backend()`` directly, never through the platform selector
(vLLM's CPU selector refuses sparse MLA outright).
"""

from __future__ import annotations

import torch

from vllm_glm53._vllm import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadataBuilder,
    MLAAttentionSpec,
)
from vllm_glm53.backends.plans import LatentCachePlan


class LatentCacheMetadataBuilder(AttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # any batch order works: the ops find each request by query_start_loc

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            # Each pipeline stage orders its batch by its own backends' thresholds, and the rows that cross a stage
            # boundary must be in the same order on both sides: a stage with sparse-MLA layers only asks for the
            # order the KDA layers' (GDN) builder asks for on the other stages, decodes (and speculative
            # verifications) first.
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=vllm_config.speculative_config is not None)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> LatentCachePlan:
        m = common_attn_metadata
        n = m.num_reqs
        # int64 once here rather than a conversion per layer in the ops; all on the model's device.
        cu = m.query_start_loc[: n + 1].to(torch.int64)
        seq_lens = m.seq_lens[:n].to(torch.int64)
        return LatentCachePlan(
            cu_seqlens=cu,
            seq_lens=seq_lens,
            context_lens=seq_lens - (cu[1:] - cu[:-1]),
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            num_reqs=n,
            num_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
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

    @classmethod
    def customize_spec(cls, spec):
        """vLLM sizes a hybrid model's token page (to cover one KDA state page) from a generic full-attention
        spec built from the model config (K and V rows per head); this cache holds one row per token."""
        if isinstance(spec, MLAAttentionSpec):
            return spec
        return MLAAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=spec.head_size,
                                dtype=spec.dtype, cache_dtype_str=getattr(spec, "cache_dtype_str", None) or "auto")


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
