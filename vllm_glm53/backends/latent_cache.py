"""The attention backend vLLM sees for the sparse-MLA layers: it owns the cache page layout and turns vLLM's
per-batch metadata into the step plan every sparse-MLA layer reads,
:class:`~vllm_glm53.backends.plans.LatentCachePlan` (request token ranges, total and cached lengths, block
table, cache slots), once per step.

vLLM gives each sparse-MLA layer pages of ``block_size`` tokens x ``cache_row_size`` values (config.py); the
plugin lays a page out in three regions (:func:`~vllm_glm53.backends.pages.page_views`), for a block of ``bs``
tokens with pools of ``kp``:

  * ``latent [bs, L]``: the normalised latent ``c_kv`` of each token, what attention reads;
  * ``pooled [bs / kp, dI]``: the compressed indexer key ``K_p`` of each of the block's pools, contiguous, so the
    indexer reads a block's keys as one stream (stored when the pool's last token is written);
  * ``raw [raw_pools, kp - 1, 2 dI]``: the raw indexer key and pooling-gate logits of the first kp - 1 tokens of
    the pools still being written, pool p in slot ``p % raw_pools``, from which a pool is compressed when its last
    token arrives (possibly in a later step or prefill chunk). Only a sequence's last pool, and the pools its
    speculative drafts reach, are incomplete between steps, so a page keeps a few pools' inputs rather than every
    token's; the last token's own are never needed later: its pool is compressed in the step that writes it.

So a token costs ``L + dI / kp`` values plus its share of the raw region, which ``cache_row_size`` sizes for
``RAW_POOLS_PER_PAGE`` pools in the smallest page the backend accepts (``MIN_CACHE_BLOCK`` tokens; larger pages keep
more pools): 556 values for L 512, dI 128, kp 4, where latent and pooled keys alone are 544 (and a row holding the
raw inputs of every token 768). Block sizes are multiples of kp, so a pool never straddles two pages and prefix
caching, which shares whole blocks, shares only complete, compressed pools. Why this needs no per-sequence state
with speculative drafts and chunked prefill: :mod:`vllm_glm53.backends.cpu.indexer`; the layer refuses a block size
whose pages keep fewer pools than its speculative steps may leave incomplete. Keeping the indexer data in the same
pages (rather than in a third cache kind with its own page size) keeps vLLM's hybrid page-size unification to two
kinds, state pages and token pages.

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
    MultipleOf,
)
from vllm_glm53.backends.plans import LatentCachePlan
from vllm_glm53.config import MIN_CACHE_BLOCK


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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        # A smaller page would keep the raw indexer inputs of fewer pools than cache_row_size is sized for; vLLM
        # rounds a hybrid model's block (sized to cover a KDA state page) to a multiple of this.
        return [MultipleOf(MIN_CACHE_BLOCK)]

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
