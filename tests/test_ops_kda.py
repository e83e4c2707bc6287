"""KDA CPU ops (vllm_glm53.backends.cpu.kda) against transformers' KDA module and against plain loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.glm5_next import modeling_glm5_next as hf

import hf_ref
from vllm_glm53.backends.cpu import kda
from vllm_glm53.backends.plans import StateSlots

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model():
    return hf_ref.build_model()


@pytest.fixture(scope="module")
def attn(model):
    return hf_ref.layer(model, 1).self_attn


def _hf_kda(attn, x):
    """HF KDA layer on one sequence without cache: ``x [T, D] -> [T, D]``."""
    with torch.no_grad():
        return attn(x.unsqueeze(0), cache_params=None, attention_mask=None)[0]


def _random_kda(T, H=3, dk=8, dv=6, seed=0, lower_bound=-5.0, a_scale=1.0, A_log=None):
    gen = torch.Generator().manual_seed(seed)
    q, k = kda.l2norm_qk(torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dk, generator=gen), dk)
    v = torch.randn(T, H, dv, generator=gen)
    A_log = torch.randn(H, generator=gen) if A_log is None else A_log
    g = kda.kda_gate(a_scale * torch.randn(T, H, dk, generator=gen), A_log, lower_bound)
    beta = torch.rand(T, H, generator=gen)
    s0 = torch.randn(H, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------------------------------------------------
# short convolution
# ---------------------------------------------------------------------------------------------------------


def _naive_conv(x, w, history):
    """Per-token loop: y_t = silu(sum_j w[:, j] * z_{t-K+1+j}) over history + x (history oldest first)."""
    K = w.shape[1]
    z = torch.cat([history.t().float(), x.float()], dim=0)
    off = history.shape[1]
    out = []
    for t in range(x.shape[0]):
        win = z[off + t - (K - 1) : off + t + 1]  # [K, C]
        out.append(F.silu((win.t() * w.float()).sum(-1)))
    return torch.stack(out)


def test_conv_matches_hf_and_naive():
    gen = torch.Generator().manual_seed(1)
    T, C, K = 9, 6, 4
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen)
    y, state = kda.causal_conv1d(x, w)
    y_hf = hf.causal_conv1d_fn(x.t().unsqueeze(0), w, activation="silu")[0].t()
    torch.testing.assert_close(y, y_hf, rtol=0, atol=1e-6)
    torch.testing.assert_close(y, _naive_conv(x, w, torch.zeros(C, K - 1)), rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[-(K - 1) :].t())


def _impl(op, which):
    """``which``: ``torch`` calls the reference form explicitly; ``dispatch`` calls the op as the layer does (the
    compiled kernels where they are loaded)."""
    return op.implementation("torch") if which == "torch" else op


def _decode_plan(B):
    """B sequences, one token each, sequence b in pool slot b, all with a state."""
    return StateSlots.single_slot(torch.arange(B + 1), torch.arange(B), torch.ones(B, dtype=torch.bool), B, 1)


@pytest.mark.parametrize("which", ["torch", "dispatch"])
def test_conv_state_continuation_in_small_pieces(which):
    """Prefill pieces shorter than K-1 and single-token batch steps reproduce the one-shot conv exactly."""
    gen = torch.Generator().manual_seed(2)
    T, C, K = 14, 5, 4
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen)
    y_full, state_full = kda.causal_conv1d(x, w)
    state, outs, t = None, [], 0
    for n in (1, 2, 1, 4, 3):
        y, state = kda.causal_conv1d(x[t : t + n], w, state)
        outs.append(y)
        t += n
    batch_state = torch.stack([state, torch.zeros_like(state)])  # second row: an unrelated fresh sequence
    conv = _impl(kda.causal_conv1d_varlen, which)
    for _ in range(T - t):
        y = conv(torch.stack([x[t], x[t]]), w, batch_state, _decode_plan(2))
        outs.append(y[:1])
        t += 1
    torch.testing.assert_close(torch.cat(outs), y_full, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch_state[0], state_full)
    # the fresh row saw only x[t-3..t-1] as its single inputs, so its state holds them too
    torch.testing.assert_close(batch_state[1], x[T - 3 :].t())


def test_conv_bf16_dtypes():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 4, generator=gen).bfloat16()
    w = torch.randn(4, 4, generator=gen)
    y, state = kda.causal_conv1d(x, w)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    ref = _naive_conv(x.float(), w, torch.zeros(4, 3))
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------
# gates and norms
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_gate_matches_hf(attn, lower_bound):
    fg = hf_ref.clone(attn.forget_gate)
    fg.safe_gate_lower_bound = lower_bound
    x = torch.randn(1, 6, fg.f_a_proj.in_features, generator=torch.Generator().manual_seed(4)) * 3
    with torch.no_grad():
        ref = fg(x)[0]
        a = (fg.f_b_proj(fg.f_a_proj(x[0])).float() + fg.dt_bias).view(6, fg.num_heads, fg.head_dim)
    torch.testing.assert_close(kda.kda_gate(a, fg.A_log, lower_bound), ref, rtol=1e-5, atol=1e-6)


def test_l2norm_and_gated_rmsnorm_match_hf(attn):
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 4, 16, generator=gen)
    qn, kn = kda.l2norm_qk(q, k, 16)
    torch.testing.assert_close(qn, hf.l2norm(q) / 4.0)
    torch.testing.assert_close(kn, hf.l2norm(k))
    o, gate = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 4, 16, generator=gen)
    with torch.no_grad():
        ref = attn.o_norm(o, gate)
    torch.testing.assert_close(kda.gated_rmsnorm(o, gate, attn.o_norm.weight, attn.o_norm.variance_epsilon), ref)


# ---------------------------------------------------------------------------------------------------------
# delta rule: chunked vs recurrent vs decode
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 4), (16, 16), (37, 16), (130, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, chunk, with_state):
    q, k, v, g, beta, s0 = _random_kda(T, seed=T)
    s0 = s0 if with_state else None
    o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, s0)
    o, s = kda.kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=2e-6)
    if with_state:
        assert not torch.equal(o, kda.kda_chunked(q, k, v, g, beta, None, chunk_size=chunk)[0])


@pytest.mark.parametrize("lower_bound,a_scale,A_log", [(-5.0, 8.0, None), (None, 4.0, torch.full((3,), 3.0))])
def test_chunked_long_sequence_is_stable(lower_bound, a_scale, A_log):
    """T = 300 with decays saturating the bound (|g| ~ 5 per step, cumulative ~320 per chunk) and with the
    unbounded gate at exp(A_log) = 20 (|g| up to ~100s): no overflow, same result as the recurrence."""
    q, k, v, g, beta, s0 = _random_kda(300, seed=7, lower_bound=lower_bound, a_scale=a_scale, A_log=A_log)
    assert g.sum(0).min() < -200
    o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, s0)
    o, s = kda.kda_chunked(q, k, v, g, beta, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("which", ["torch", "dispatch"])
def test_decode_steps_on_the_pool_match_recurrent(which):
    seqs = [_random_kda(6, seed=s) for s in (11, 12)]
    state = torch.stack([s[5] for s in seqs]).clone()
    outs = []
    for t in range(6):
        step = [torch.stack([s[i][t] for s in seqs]) for i in range(5)]
        outs.append(_impl(kda.kda_varlen, which)(*step, state, _decode_plan(2)))
    for b, (q, k, v, g, beta, s0) in enumerate(seqs):
        o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, s0)
        torch.testing.assert_close(torch.stack([o[b] for o in outs]), o_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(state[b], s_ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# whole KDA layer vs transformers
# ---------------------------------------------------------------------------------------------------------


def _x(attn, T, seed):
    return torch.randn(T, attn.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [64, 16])
def test_layer_matches_hf(attn, chunk):
    x = _x(attn, 40, 21)
    out, _, _ = hf_ref.kda_layer_prefill(attn, x, chunk_size=chunk)
    torch.testing.assert_close(out, _hf_kda(attn, x), rtol=0, atol=1e-5)


def test_layer_unbounded_gate_matches_hf(attn):
    a = hf_ref.clone(attn)
    a.forget_gate.safe_gate_lower_bound = None
    with torch.no_grad():
        a.forget_gate.A_log.copy_(torch.linspace(1.0, 16.0, a.num_heads).log())
    x = _x(a, 33, 22)
    out, _, _ = hf_ref.kda_layer_prefill(a, x, chunk_size=8)
    torch.testing.assert_close(out, _hf_kda(a, x), rtol=0, atol=1e-5)


def test_prefill_continuation_and_batched_decode_match_full_prefill(attn):
    """Chunked-prefill continuation (17 + 11 tokens) then 12 batched decode steps for two sequences equals one
    HF forward over the whole of each sequence."""
    xs = [_x(attn, 40, 31), _x(attn, 40, 32)]
    conv, rec, outs = [], [], []
    for x in xs:
        o1, c, r = hf_ref.kda_layer_prefill(attn, x[:17], chunk_size=8)
        o2, c, r = hf_ref.kda_layer_prefill(attn, x[17:28], c, r, chunk_size=8)
        conv.append(c)
        rec.append(r)
        outs.append([o1, o2])
    conv, rec = torch.stack(conv), torch.stack(rec)
    for t in range(28, 40):
        o = hf_ref.kda_layer_decode(attn, torch.stack([x[t] for x in xs]), conv, rec)
        for b in range(2):
            outs[b].append(o[b : b + 1])
    for x, parts in zip(xs, outs):
        torch.testing.assert_close(torch.cat(parts), _hf_kda(attn, x), rtol=0, atol=1e-5)


def test_layer_recurrent_path_matches_chunked(attn):
    x = _x(attn, 20, 41)
    out_c, conv_c, rec_c = hf_ref.kda_layer_prefill(attn, x, chunk_size=8)
    out_r, conv_r, rec_r = hf_ref.kda_layer_prefill(attn, x, recurrent=True)
    torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(rec_c, rec_r, rtol=0, atol=1e-5)
    assert torch.equal(conv_c, conv_r)
