"""Sparse MLA with the k-pool lightning indexer: GLM-5.3's attention block (architecture.md §6, §7).

NoPE latent attention in its absorbed form: the cache holds one normalised latent ``c_kv`` per token, queries
are mapped into latent space by ``W_UK``, attention runs over the latents of the positions the indexer
selected, and ``W_UV`` maps the result back. Heads are split over tensor-parallel ranks; the latent and the
indexer (one key head, a few query heads) are replicated.

The layer is its projections plus one registered custom op, ``torch.ops.vllm_glm53_layers.sparse_mla``, that
stores the step's cache rows and runs the indexer selection and the sparse attention for the whole batch over the
paged cache, as the step plan says (:class:`~vllm_glm53.backends.plans.LatentCachePlan`, built once per step by
:mod:`vllm_glm53.backends.latent_cache`).

``shared`` layers own no indexer and reuse the selection of the most recent ``full`` layer (transformers
only allows that layer to sit immediately before; reusing the latest full selection is the same there).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import (
    AttentionLayerBase,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_tensor_model_parallel_world_size,
)
from vllm_glm53.backends import indexer_ops, mla_ops
from vllm_glm53.backends.cpu.indexer import index_width
from vllm_glm53.backends.latent_cache import LatentCacheBackend
from vllm_glm53.backends.pages import LatentPages, fresh_pages, page_views, raw_pools, raw_pools_needed
from vllm_glm53.backends.plans import LatentCachePlan
from vllm_glm53.config import MIN_CACHE_BLOCK, TextArch
from vllm_glm53.model.layer_ops import forward_layer, register_layer_op
from vllm_glm53.model.norm import RMSNorm
from vllm_glm53.quant.plan import layer_quant


class Glm5NextIndexer(nn.Module):
    """Projections of the lightning indexer. Replicated on every TP rank (it is small and its output, the
    selection, must be identical everywhere).

    The three projections of the hidden state (``wk``, the pool gate ``index_kpool_compress_gate``, and
    ``weights_proj``) are one GEMM, ``wk_gate_weights_proj`` (as vLLM fuses ``wk`` and ``weights_proj`` for
    DeepSeek-V3.2): a decode step pays one linear call where it paid three. Unquantized, as vLLM serves them: an
    FP8 ``wk`` is dequantized while loading (a [128, hidden] matrix)."""

    def __init__(self, arch: TextArch, prefix: str) -> None:
        super().__init__()
        nI, dI, D = arch.index_n_heads, arch.index_head_dim, arch.hidden_size
        self.wq_b = ReplicatedLinear(arch.q_lora_rank, nI * dI, bias=False, quant_config=layer_quant(),
                                     prefix=f"{prefix}.wq_b")
        self.wk_gate_weights_proj = MergedColumnParallelLinear(D, [dI, dI, nI], bias=False, quant_config=None,
                                                               disable_tp=True,
                                                               prefix=f"{prefix}.wk_gate_weights_proj")
        self.k_norm = nn.LayerNorm(dI, eps=1e-6)
        # Checkpoint name has no ".weight" suffix.
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(arch.index_kpool, dI, dtype=torch.float32),
                                                     requires_grad=False)
        self.n_heads, self.head_dim = nI, dI

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token raw indexer inputs ``[key (dI) | gate logits (dI)]`` in the activation dtype, and float32
        head weights ``[T, nI]`` (already scaled by nI^-1/2)."""
        dI = self.head_dim
        out, _ = self.wk_gate_weights_proj(x)
        k, gate, w = out.split([dI, dI, self.n_heads], dim=-1)
        return torch.cat([self.k_norm(k), gate], dim=-1), w.float() * self.n_heads**-0.5

    def queries(self, c_q: torch.Tensor) -> torch.Tensor:
        """Query heads ``[T, nI, dI]``."""
        q, _ = self.wq_b(c_q)
        return q.view(-1, self.n_heads, self.head_dim)


class Glm5NextSparseMLA(nn.Module, AttentionLayerBase):
    def __init__(self, arch: TextArch, layer_idx: int, has_indexer: bool, model_dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if arch.num_heads % tp:
            raise ValueError(f"num_attention_heads {arch.num_heads} is not divisible by TP {tp}")
        self.arch = arch
        self.prefix = prefix
        self.model_dtype = model_dtype
        self.heads = arch.num_heads // tp
        H, D, L = arch.num_heads, arch.hidden_size, arch.kv_lora_rank
        dn, dv = arch.qk_nope_head_dim, arch.v_head_dim
        qc = layer_quant()  # kv_b_proj never takes it: its weight is read directly (split into W_UK / W_UV)
        # q_a_proj and kv_a_proj_with_mqa read the same hidden state: one GEMM (vLLM fuses them so for DeepSeek);
        # the checkpoint must store both in one form (quant.plan refuses a half-quantized pair).
        self.fused_qkv_a_proj = MergedColumnParallelLinear(D, [arch.q_lora_rank, L], bias=False, quant_config=qc,
                                                           disable_tp=True, prefix=f"{prefix}.fused_qkv_a_proj")
        self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(arch.q_lora_rank, H * dn, bias=False, quant_config=qc,
                                             prefix=f"{prefix}.q_b_proj")
        self.kv_a_layernorm = RMSNorm(L, arch.rms_norm_eps)
        # Rows per head are [k_nope (dn); v (dv)], so a column split at head boundaries keeps whole heads.
        self.kv_b_proj = ColumnParallelLinear(L, H * (dn + dv), bias=False, prefix=f"{prefix}.kv_b_proj")
        _vllm.cpu_skip_gemm_dispatch(self.kv_b_proj)  # its weight is split into W_UK / W_UV after loading
        self.o_proj = RowParallelLinear(H * dv, D, bias=False, quant_config=qc, prefix=f"{prefix}.o_proj")
        self.indexer = Glm5NextIndexer(arch, f"{prefix}.indexer") if has_indexer else None
        self.scale = dn**-0.5
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

        vllm_config = _vllm.get_current_vllm_config()
        self.cache_config = vllm_config.cache_config
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache = torch.tensor([])
        self._pages: tuple[torch.Tensor, LatentPages] | None = None  # (the cache tensor, its cache_pages)

    # --- vLLM attention-layer interface -------------------------------------------------------------------

    def get_attn_backend(self):
        return LatentCacheBackend

    def get_kv_cache_spec(self, vllm_config):
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--kv-cache-dtype {cache_dtype} is not supported by the GLM-5.3 latent cache")
        dtype = self.model_dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)
        a, block_size = self.arch, vllm_config.cache_config.block_size
        kp = a.index_kpool
        # Refused here, before any cache exists: a page holds whole indexer pools, and enough raw slots for the
        # pools a speculative step may leave incomplete (backends/latent_cache.py).
        if block_size % kp:
            raise ValueError(f"--block-size {block_size}: GLM-5.3's sparse-MLA cache needs a block size that is a "
                             f"multiple of index_kpool ({kp})")
        spec = vllm_config.speculative_config
        drafts = (spec.num_speculative_tokens or 0) if spec is not None else 0
        kept = functools.partial(raw_pools, row_size=a.cache_row_size, latent_dim=a.kv_lora_rank,
                                 index_dim=a.index_head_dim, kp=kp)  # pools a page of that many tokens keeps
        need, have = raw_pools_needed(drafts, kp), kept(block_size)
        if have < need:
            smallest = next(b for b in itertools.count(MIN_CACHE_BLOCK, MIN_CACHE_BLOCK) if kept(b) >= need)
            raise ValueError(f"--block-size {block_size}: GLM-5.3's sparse-MLA cache pages keep the raw indexer "
                             f"inputs of {have} pools, {need} needed with {drafts} speculative tokens; use a block "
                             f"size of at least {smallest}")
        return _vllm.MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=self.arch.cache_row_size,
            dtype=dtype,
            cache_dtype_str=cache_dtype,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype | None = None) -> None:
        a = self.arch
        self.w_uk, self.w_uv = mla_ops.split_kv_b(self.kv_b_proj.weight.data, self.heads, a.qk_nope_head_dim,
                                                  a.v_head_dim)

    # --- forward ---------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, shared_selection: torch.Tensor | None = None):
        """Returns ``(output [T, D], selection)``: ``selection [tokens, index_width]`` holds each token's chosen
        positions within its request (-1 unused), what a following ``shared`` layer reuses; a shared layer
        passes the one it was given through."""
        a = self.arch
        T = x.shape[0]
        if self.w_uk is None:
            self.process_weights_after_loading()
        qkv_a, _ = self.fused_qkv_a_proj(x)
        q_a, kv_a = qkv_a.split([a.q_lora_rank, a.kv_lora_rank], dim=-1)
        c_q = self.q_a_layernorm(q_a)
        q, _ = self.q_b_proj(c_q)
        q_lat = mla_ops.absorb_q(q.view(T, self.heads, a.qk_nope_head_dim), self.w_uk)
        latent = self.kv_a_layernorm(kv_a)
        if self.indexer is not None:
            key_gate, w_idx = self.indexer.project(x)
            q_idx = self.indexer.queries(c_q)
        else:
            if shared_selection is None:
                raise RuntimeError(f"{self.prefix}: shared indexer layer got no selection to reuse")
            key_gate = q_idx = w_idx = None
        o_lat, selection = _sparse_mla(q_lat, latent, key_gate, q_idx, w_idx, shared_selection, self.prefix)
        o = mla_ops.apply_uv(o_lat, self.w_uv)
        out, _ = self.o_proj(o.reshape(T, -1))
        return out, selection

    def attend(self, q_lat: torch.Tensor, latent: torch.Tensor, key_gate: torch.Tensor | None,
               q_idx: torch.Tensor | None, w_idx: torch.Tensor | None, shared_selection: torch.Tensor | None):
        """Store the step's latents and raw indexer inputs (and the pooled key of every pool they complete),
        select (or reuse the shared selection) and attend, for the whole batch as the step plan says. Both ops read
        the paged cache in place: the indexer one pooled key per complete pool of each request, the attention only
        the selected latents (so its cost stops growing once the context exceeds index_topk). Profiling and dummy
        runs carry no plan: the batch is one fresh sequence in one zeroed page."""
        a = self.arch
        meta = _vllm.layer_attn_metadata(self.prefix)
        L, dI, kp = a.kv_lora_rank, a.index_head_dim, a.index_kpool
        if meta is None:
            plan = LatentCachePlan.fresh(q_lat.shape[0], q_lat.device)
            pages = fresh_pages(q_lat.shape[0], a.cache_row_size, L, dI, kp, latent.dtype, latent.device)
        else:
            plan = meta
            pages = self.cache_pages()
        n = plan.num_tokens
        if self.indexer is not None:  # before the writes, which may reuse the raw slots of the pools it completes
            indexer_ops.store_pooled_keys(pages, plan, key_gate[:n], self.indexer.index_kpool_compress_ape)
        mla_ops.write_tokens(pages, plan.slot_mapping, latent[:n], None if key_gate is None else key_gate[:n])
        if self.indexer is not None:
            selection = indexer_ops.select_batch(q_idx[:n], w_idx[:n], pages.pooled, plan, a.index_topk, kp)
        else:
            selection = shared_selection[:n]  # a previous pipeline stage's selection may carry pad rows
        o_lat = mla_ops.sparse_latent_attention_paged(q_lat[:n], pages.latent, plan, selection, self.scale, L)
        if n < q_lat.shape[0]:  # rows past the plan's tokens (padding) attend to nothing
            o_lat = torch.cat([o_lat, q_lat.new_zeros(q_lat.shape[0] - n, *q_lat.shape[1:])])
        return o_lat, selection

    def cache_pages(self) -> LatentPages:
        """The regions of the pages vLLM bound as ``kv_cache`` (:func:`page_views`), made once per cache tensor:
        they are the same views every step. Made on every call (checks, three ``as_strided``), with ``o_lat``
        zero-filled and copied, ``attend`` took 48-64 us a call on the tiny model; without both, 31-34 (Zen 5,
        alternating runs), a few per cent of its decode step."""
        if self._pages is None or self._pages[0] is not self.kv_cache:
            a = self.arch
            self._pages = (self.kv_cache, page_views(self.kv_cache, a.kv_lora_rank, a.index_head_dim, a.index_kpool))
        return self._pages[1]


def _sparse_mla_impl(q_lat: torch.Tensor, latent: torch.Tensor, key_gate: torch.Tensor | None,
                     q_idx: torch.Tensor | None, w_idx: torch.Tensor | None, shared_selection: torch.Tensor | None,
                     layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    o_lat, selection = forward_layer(layer_name).attend(q_lat, latent, key_gate, q_idx, w_idx, shared_selection)
    # A custom op may not return one of its inputs (or a view of one): a shared layer passes a copy on.
    return o_lat, selection.clone() if shared_selection is not None else selection


def _sparse_mla_fake(q_lat: torch.Tensor, latent: torch.Tensor, key_gate: torch.Tensor | None,
                     q_idx: torch.Tensor | None, w_idx: torch.Tensor | None, shared_selection: torch.Tensor | None,
                     layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    arch = forward_layer(layer_name).arch
    width = index_width(arch.index_topk, arch.index_kpool)
    return torch.empty_like(q_lat), torch.empty(q_lat.shape[0], width, dtype=torch.int64, device=q_lat.device)


_sparse_mla = register_layer_op("sparse_mla", _sparse_mla_impl, _sparse_mla_fake)
