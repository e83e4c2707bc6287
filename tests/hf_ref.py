"""Test helpers: the tiny transformers reference model, and "reference assemblies" that rebuild one HF layer's
forward from the plugin's CPU ops (``vllm_glm53.backends.cpu``, ``vllm_glm53.model.{mhc,moe_routing}``) on the
very same weights, so each op is checked against transformers' own module.

Everything is float32 and tiny (the package's default tiny config: D 64, KDA 4x16, MLA 4 heads, indexer 4x16,
topk 8, kp 4, 8 experts top-2, mHC n = 4).
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources

import torch
import torch.nn.functional as F

from vllm_glm53.backends.cpu import indexer as ix
from vllm_glm53.backends.cpu import kda
from vllm_glm53.backends.cpu import sparse_mla as mla
from vllm_glm53.backends.plans import StateSlots
from vllm_glm53.model.moe_routing import clamped_swiglu, route


def tiny_config_dict() -> dict:
    """The package's tiny nested config with in-vocab pad/EOS ids and no ``dtype`` keys (fp32 build)."""
    cfg = json.loads(resources.files("vllm_glm53.data").joinpath("tiny_config.json").read_text())
    cfg.pop("dtype", None)
    cfg["text_config"].pop("dtype", None)
    cfg["text_config"].update(pad_token_id=0, eos_token_id=[1, 2, 3])
    return cfg


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Replace constant initialisations with noise so that a swapped or ignored tensor changes results:
    k-pool gate/ape (uniform pooling otherwise), A_log (zero => equal decay rates per head), dt_bias, mHC
    base/scale, norm weights and the router correction bias."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("index_kpool_compress_gate", "index_kpool_compress_ape")):
                p.copy_(0.5 * noise)
            elif name.endswith("A_log"):
                p.copy_(0.5 * noise)
            elif name.endswith(("dt_bias", "_hc.base")) or (name.endswith(".bias") and p.ndim == 1):
                p.add_(0.3 * noise)
            elif name.endswith("_hc.scale"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("_hc.fn"):
                p.mul_(5.0)  # larger mixing logits => clearly non-uniform pre/post/comb
            elif p.ndim == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


@functools.lru_cache(maxsize=4)
def _build(seed: int, overrides_json: str):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    cfg = tiny_config_dict()
    cfg["text_config"].update(json.loads(overrides_json))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(**cfg)).eval()
    _perturb(model, seed)
    return model


def build_model(seed: int = 0, **text_overrides):
    """``Glm5NextForConditionalGeneration`` in fp32 from the tiny config (+ text-config overrides), cached per
    process. Treat it as read-only; ``copy.deepcopy`` a module before changing it."""
    return _build(seed, json.dumps(text_overrides, sort_keys=True))


def text_config(model):
    return model.config.text_config


def layer(model, i: int):
    return model.model.language_model.layers[i]


def clone(module):
    return copy.deepcopy(module)


# ----------------------------------------------------------------------------------------------------------
# KDA layer assembled from the ops
# ----------------------------------------------------------------------------------------------------------


def kda_inputs(attn, x: torch.Tensor):
    """Per-token KDA quantities of one sequence ``x [T, D]`` for the HF module ``attn``: pre-conv qkv
    ``[T, 3*H*dk]``, conv weight ``[C, K]``, gate input ``a [T, H, dk]``, beta ``[T, H]``, output gate
    ``[T, H, dk]``."""
    H, dk = attn.num_heads, attn.head_dim
    z = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    fg = attn.forget_gate
    a = (fg.f_b_proj(fg.f_a_proj(x)).float() + fg.dt_bias.float()).view(-1, H, dk)
    beta = torch.sigmoid(attn.b_proj(x)).float()
    gate = attn.g_b_proj(attn.g_a_proj(x)).view(-1, H, dk)
    return z, attn.conv1d.weight.squeeze(1), a, beta, gate


def _kda_heads(attn, zc: torch.Tensor, a: torch.Tensor):
    H, dk = attn.num_heads, attn.head_dim
    q, k, v = zc.split(H * dk, dim=-1)
    q, k = kda.l2norm_qk(q.view(-1, H, dk), k.view(-1, H, dk), dk)
    g = kda.kda_gate(a, attn.forget_gate.A_log, attn.forget_gate.safe_gate_lower_bound)
    return q, k, v.reshape(-1, H, dk), g


def _kda_out(attn, o: torch.Tensor, gate: torch.Tensor, dtype) -> torch.Tensor:
    w = attn.o_norm.weight
    o = kda.gated_rmsnorm(o, gate, w, attn.o_norm.variance_epsilon, out_dtype=dtype)
    return attn.o_proj(o.reshape(o.shape[0], -1))


def kda_layer_prefill(attn, x, conv_state=None, rec_state=None, chunk_size=64, recurrent=False):
    """KDA layer on one sequence ``x [T, D]`` from optional states; returns ``(out, conv_state, rec_state)``."""
    with torch.no_grad():
        z, w, a, beta, gate = kda_inputs(attn, x)
        zc, conv_state = kda.causal_conv1d(z, w, conv_state)
        q, k, v, g = _kda_heads(attn, zc, a)
        if recurrent:
            o, rec_state = kda.kda_recurrent(q, k, v, g, beta, rec_state)
        else:
            o, rec_state = kda.kda_chunked(q, k, v, g, beta, rec_state, chunk_size=chunk_size)
        return _kda_out(attn, o, gate, x.dtype), conv_state, rec_state


def kda_layer_decode(attn, x, conv_state, rec_state):
    """One decode token for each of B sequences, ``x [B, D]``, through the batch-wide ops: states
    ``[B, C, K-1]`` / ``[B, H, dk, dv]`` are the pools (slot b = sequence b), updated in place. Returns
    ``[B, D]``."""
    B = x.shape[0]
    plan = StateSlots.single_slot(torch.arange(B + 1), torch.arange(B), torch.ones(B, dtype=torch.bool), B, 1)
    with torch.no_grad():
        z, w, a, beta, gate = kda_inputs(attn, x)
        zc = kda.causal_conv1d_varlen(z, w, conv_state, plan)
        q, k, v, g = _kda_heads(attn, zc, a)
        o = kda.kda_varlen(q, k, v, g, beta, rec_state, plan)
        return _kda_out(attn, o, gate, x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Sparse MLA + indexer assembled from the ops
# ----------------------------------------------------------------------------------------------------------


def indexer_selection(attn, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Index rows from the ops for one whole sequence ``x [T, D]`` (queries = ``positions``, default all)."""
    cfg = attn.config
    ind = attn.indexer
    kp, nI, dI = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    with torch.no_grad():
        T = x.shape[0]
        positions = torch.arange(T) if positions is None else positions
        c_q = attn.q_a_layernorm(attn.q_a_proj(x))
        q = ind.wq_b(c_q).view(T, nI, dI)[positions]
        k = ind.k_norm(ind.wk(x))
        gate = F.linear(x, ind.index_kpool_compress_gate)
        w = ind.weights_proj(x).float()[positions] * nI**-0.5
        n_full = T // kp * kp
        pooled = ix.kpool_compress(k[:n_full], gate[:n_full], ind.index_kpool_compress_ape)
        scores = ix.index_scores(q, w, pooled)
        return ix.select_tokens(scores, positions, cfg.index_topk, kp, cfg.index_kpool_always_select_tail)


def mla_layer_forward(attn, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Absorbed sparse MLA for one sequence ``x [T, D]`` (all T tokens are queries) with given index rows."""
    cfg = attn.config
    H, dn, dv = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    with torch.no_grad():
        T = x.shape[0]
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(T, H, dn)
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, : cfg.kv_lora_rank])
        w_uk, w_uv = mla.split_kv_b(attn.kv_b_proj.weight, H, dn, dv)
        o_lat = mla.sparse_latent_attention(mla.absorb_q_torch(q, w_uk), latent, indices, attn.scaling)
        return attn.o_proj(mla.apply_uv_torch(o_lat, w_uv).reshape(T, H * dv))


# ----------------------------------------------------------------------------------------------------------
# MoE block assembled from the ops
# ----------------------------------------------------------------------------------------------------------


def moe_forward(moe, x: torch.Tensor) -> torch.Tensor:
    """``Glm5NextTextMoE`` from :func:`route` and :func:`clamped_swiglu`, naive loop over tokens and experts."""
    cfg = moe.config
    with torch.no_grad():
        logits = F.linear(x.float(), moe.gate.weight.float())
        weights, ids = route(
            logits,
            moe.gate.e_score_correction_bias,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], ids[t]):
                h = clamped_swiglu(F.linear(x[t], moe.experts.gate_up_proj[e]), cfg.swiglu_limit)
                out[t] += w * F.linear(h, moe.experts.down_proj[e])
        sh = moe.shared_experts
        shared = F.linear(
            clamped_swiglu(torch.cat([sh.gate_proj(x), sh.up_proj(x)], dim=-1), cfg.swiglu_limit), sh.down_proj.weight
        )
        return out + shared
