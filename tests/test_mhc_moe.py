"""mHC and MoE routing against transformers' modules and plain loops, plus whole decoder layers assembled from
the plugin's ops (mHC + KDA + MoE, mHC + sparse MLA + MoE) against transformers' decoder layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.glm5_next import modeling_glm5_next as hf

import hf_ref
from vllm_glm53.backends.cpu.mhc import mhc_coefficients, mhc_collapse, mhc_expand
from vllm_glm53.model.mhc import MHCBlock
from vllm_glm53.model.moe_routing import clamped_swiglu, route

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model():
    return hf_ref.build_model()


@pytest.fixture(scope="module")
def cfg(model):
    return hf_ref.text_config(model)


def _streams(cfg, T, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(T, cfg.hc_mult, cfg.hidden_size, generator=gen)


@pytest.fixture(params=["torch", "dispatch"])
def impl(request):
    """``impl(op)``: the op's plain-torch reference, called explicitly, or the op as the layers call it (the
    compiled kernels where loaded)."""
    if request.param == "torch":
        return lambda op: op.implementation("torch")
    return lambda op: op


def _mhc_block(cfg, hc) -> MHCBlock:
    p = MHCBlock(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
    p.load_state_dict({"fn": hc.fn, "base": hc.base, "scale": hc.scale})
    return p


# ---------------------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------------------


def test_mhc_coefficients_and_collapse_match_hf(model, cfg):
    hc = hf_ref.layer(model, 2).ffn_hc
    X = _streams(cfg, 7, 1)
    with torch.no_grad():
        post_ref, comb_ref, u_ref = hc(X.unsqueeze(0))
    u, post, comb = _mhc_block(cfg, hc).pre(X)
    torch.testing.assert_close(post, post_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(u, u_ref[0], rtol=0, atol=1e-5)
    # the coefficients are far from uniform (the test would not see a swapped pre/post/comb otherwise)
    assert post.std() > 0.1 and comb.std() > 0.05
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(7, cfg.hc_mult), rtol=0, atol=1e-5)


def test_mhc_pre_matches_per_token_loop(model, cfg, impl):
    """pre/post/comb from a per-token scalar re-implementation of architecture.md 3.2 steps 1-6."""
    hc = hf_ref.layer(model, 0).attn_hc
    n, eps = cfg.hc_mult, cfg.hc_eps
    X = _streams(cfg, 3, 2)
    pre, post, comb = impl(mhc_coefficients)(
        X, hc.fn, hc.base, hc.scale, n, eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps
    )
    for t in range(3):
        x = X[t].reshape(-1)
        m = (x / torch.sqrt(x.pow(2).mean() + cfg.rms_norm_eps)) @ hc.fn.detach().t()
        b, s = hc.base.detach(), hc.scale.detach()
        pre_ref = torch.sigmoid(s[0] * m[:n] + b[:n]) + eps
        post_ref = 2 * torch.sigmoid(s[1] * m[n : 2 * n] + b[n : 2 * n])
        C = torch.softmax(s[2] * m[2 * n :].view(n, n) + b[2 * n :].view(n, n), dim=1) + eps
        for it in range(cfg.hc_sinkhorn_iters):
            if it:
                C = C / (C.sum(1, keepdim=True) + eps)
            C = C / (C.sum(0, keepdim=True) + eps)
        torch.testing.assert_close(pre[t], pre_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(post[t], post_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(comb[t], C, rtol=0, atol=1e-6)


def test_mhc_collapse_and_expand_match_loops(cfg, impl):
    gen = torch.Generator().manual_seed(3)
    T, n, D = 2, cfg.hc_mult, 5
    X, y = torch.randn(T, n, D, generator=gen), torch.randn(T, D, generator=gen)
    pre, post = torch.rand(T, n, generator=gen), 2 * torch.rand(T, n, generator=gen)
    comb = torch.rand(T, n, n, generator=gen)
    out = impl(mhc_expand)(X, y, post, comb)
    u = impl(mhc_collapse)(X, pre)
    for t in range(T):
        torch.testing.assert_close(u[t], sum(pre[t, i] * X[t, i] for i in range(n)))
        for j in range(n):
            ref = post[t, j] * y[t] + sum(comb[t, i, j] * X[t, i] for i in range(n))
            torch.testing.assert_close(out[t, j], ref)


def test_mhc_bf16_streams_keep_fp32_coefficients(model, cfg):
    hc = hf_ref.layer(model, 1).attn_hc
    X = _streams(cfg, 4, 4).bfloat16()
    p = _mhc_block(cfg, hc)
    u, post, comb = p.pre(X)
    assert u.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    assert p.fn.dtype == torch.float32
    out = p.post(X, u, post, comb)
    assert out.dtype == torch.bfloat16
    ref = mhc_expand(X.float(), u.float(), post, comb)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------
# routing and SwiGLU
# ---------------------------------------------------------------------------------------------------------


def _check_routing_matches(router, x):
    with torch.no_grad():
        logits, w_ref, ids_ref = router(x)
    c = router
    w, ids = route(
        logits, c.e_score_correction_bias, c.top_k, c.num_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor
    )
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    for t in range(x.shape[0]):
        ours = dict(zip(ids[t].tolist(), w[t].tolist()))
        ref = dict(zip(ids_ref[t].tolist(), w_ref[t].tolist()))
        assert ours.keys() == ref.keys()
        for e in ours:
            assert abs(ours[e] - ref[e]) < 1e-6


def test_route_matches_hf_router(model, cfg):
    router = hf_ref.layer(model, 1).mlp.gate
    _check_routing_matches(router, torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(5)))


def test_route_group_limited_matches_hf(cfg):
    """n_group 4 / topk_group 2 over 16 experts, top-3, without normalisation; the bias changes the choice."""
    c = copy.deepcopy(cfg)
    c.n_routed_experts = c.num_local_experts = 16
    c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob = 4, 2, 3, False
    torch.manual_seed(6)
    router = hf.Glm5NextTextTopkRouter(c)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(24, c.hidden_size)
    _check_routing_matches(router, x)
    # the bias matters for the choice here, and group limiting excludes at least one expert a plain top-3 takes
    logits = F.linear(x, router.weight)
    _, ids_nobias = route(logits, None, 3, 4, 2, False, 1.0)
    _, ids = route(logits, router.e_score_correction_bias, 3, 4, 2, False, 1.0)
    _, ids_flat = route(logits, router.e_score_correction_bias, 3, 1, 1, False, 1.0)
    assert not torch.equal(ids.sort().values, ids_nobias.sort().values)
    assert not torch.equal(ids.sort().values, ids_flat.sort().values)


def test_clamped_swiglu_matches_hf():
    gen = torch.Generator().manual_seed(7)
    gate_up = 15 * torch.randn(6, 2 * 5, generator=gen)  # well beyond the limit on both sides
    out = clamped_swiglu(gate_up, 10.0)
    g, u = gate_up[:, :5], gate_up[:, 5:]
    ref = F.silu(torch.where(g > 10, torch.full_like(g, 10.0), g)) * torch.where(u.abs() > 10, 10 * u.sign(), u)
    torch.testing.assert_close(out, ref)
    experts = hf.Glm5NextTextExperts.__new__(hf.Glm5NextTextExperts)
    experts.swiglu_limit = 10.0
    torch.testing.assert_close(out, hf.Glm5NextTextExperts._apply_gate(experts, gate_up))


def test_moe_block_matches_hf(model, cfg):
    moe = hf_ref.layer(model, 2).mlp
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = moe(x.unsqueeze(0))[0]
    torch.testing.assert_close(hf_ref.moe_forward(moe, x), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# whole decoder layers: mHC + sublayer + mHC + MLP, everything from the plugin's ops
# ---------------------------------------------------------------------------------------------------------


def _decoder_from_ops(cfg, dec, X, sublayer):
    with torch.no_grad():
        attn_hc, ffn_hc = _mhc_block(cfg, dec.attn_hc), _mhc_block(cfg, dec.ffn_hc)
        u, post, comb = attn_hc.pre(X)
        X = attn_hc.post(X, sublayer(dec.input_layernorm(u)), post, comb)
        u, post, comb = ffn_hc.pre(X)
        return ffn_hc.post(X, hf_ref.moe_forward(dec.mlp, dec.post_attention_layernorm(u)), post, comb)


@pytest.mark.parametrize("layer_idx", [1, 3])
def test_decoder_layer_matches_hf(model, cfg, layer_idx):
    dec = hf_ref.layer(model, layer_idx)
    T = 30
    X = _streams(cfg, T, 9)
    with torch.no_grad():
        ref, _ = dec(X.unsqueeze(0), attention_mask=torch.ones(1, T, dtype=torch.bool))
    if layer_idx == 1:
        sublayer = lambda h: hf_ref.kda_layer_prefill(dec.self_attn, h, chunk_size=8)[0]  # noqa: E731
    else:
        sublayer = lambda h: hf_ref.mla_layer_forward(  # noqa: E731
            dec.self_attn, h, hf_ref.indexer_selection(dec.self_attn, h)
        )
    torch.testing.assert_close(_decoder_from_ops(cfg, dec, X, sublayer), ref[0], rtol=0, atol=2e-5)
