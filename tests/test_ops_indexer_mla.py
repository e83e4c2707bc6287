"""Indexer and sparse-MLA CPU ops against transformers' attention/indexer modules and against plain loops."""

from __future__ import annotations

import pytest
import torch

import hf_ref
from vllm_glm53.backends.cpu import indexer as ix
from vllm_glm53.backends.cpu import sparse_mla as mla
from vllm_glm53.backends.pages import page_views, raw_pools, raw_pools_needed
from vllm_glm53.backends.plans import LatentCachePlan
from vllm_glm53.config import cache_row_size

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model():
    return hf_ref.build_model()


@pytest.fixture(scope="module")
def attn(model):
    """Layer 3: MLA with a full indexer, followed by the shared layer 4."""
    return hf_ref.layer(model, 3).self_attn


@pytest.fixture(params=["torch", "dispatch"])
def impl(request):
    """``impl(op)``: the op's plain-torch reference, called explicitly, or the op as the layers call it (the
    compiled kernels where loaded), so the reference forms stay tested whatever this machine has built."""
    if request.param == "torch":
        return lambda op: op.implementation("torch")
    return lambda op: op


def _x(attn, T, seed):
    return torch.randn(T, attn.hidden_size, generator=torch.Generator().manual_seed(seed))


def _hf_indices(attn, x):
    with torch.no_grad():
        c_q = attn.q_a_layernorm(attn.q_a_proj(x))
        mask = torch.ones(1, x.shape[0], dtype=torch.bool)
        return attn.indexer(x.unsqueeze(0), c_q.unsqueeze(0), mask, None)[0]


def _as_sets(rows):
    return [set(r[r >= 0].tolist()) for r in rows]


# ---------------------------------------------------------------------------------------------------------
# indexer pieces vs plain loops
# ---------------------------------------------------------------------------------------------------------


def test_kpool_compress_matches_loop(impl):
    gen = torch.Generator().manual_seed(1)
    kp, dI, T = 4, 5, 12
    k, gate, ape = (torch.randn(*s, generator=gen) for s in ((T, dI), (T, dI), (kp, dI)))
    pooled = impl(ix.kpool_compress)(k, gate, ape)
    for p in range(T // kp):
        for c in range(dI):
            w = torch.softmax(gate[p * kp : (p + 1) * kp, c] + ape[:, c], dim=0)
            assert torch.allclose(pooled[p, c], (w * k[p * kp : (p + 1) * kp, c]).sum(), atol=1e-6)
    with pytest.raises(ValueError):
        impl(ix.kpool_compress)(k[:10], gate[:10], ape)


def test_index_scores_match_loop(impl):
    gen = torch.Generator().manual_seed(2)
    Tq, nI, dI, P = 3, 4, 8, 5
    q = torch.randn(Tq, nI, dI, generator=gen)
    w, pooled = torch.randn(Tq, nI, generator=gen), torch.randn(P, dI, generator=gen)
    scores = impl(ix.index_scores)(q, w, pooled)
    for t in range(Tq):
        for p in range(P):
            ref = sum(w[t, h] * torch.relu(q[t, h] @ pooled[p] / dI**0.5) for h in range(nI))
            assert torch.allclose(scores[t, p], ref, atol=1e-6)


def _naive_select(scores, positions, topk, kp, tail):
    rows = []
    for s, t in zip(scores.tolist(), positions.tolist()):
        n_cand = (t + 1) // kp
        # transformers' rule: torch.topk over the whole row, non-candidates at float32's lowest value
        row_scores = torch.tensor([v if p < n_cand else torch.finfo(torch.float32).min for p, v in enumerate(s)])
        top = row_scores.topk(min(topk // kp, len(s))).indices.tolist()
        best = [p for p in top if p < n_cand]
        row = [p * kp + j for p in sorted(best) for j in range(kp)]
        if tail:
            row += list(range(n_cand * kp, t + 1))
        rows.append(row + [-1] * (ix.index_width(topk, kp, tail) - len(row)))
    return torch.tensor(rows)


@pytest.mark.parametrize("topk,kp,tail", [(8, 4, True), (8, 4, False), (6, 2, True), (3, 1, True)])
def test_select_tokens_matches_loop_with_ties(topk, kp, tail, impl):
    gen = torch.Generator().manual_seed(3)
    T = 37
    scores = torch.randint(0, 3, (T, T // kp), generator=gen).float()  # many exact ties
    positions = torch.arange(T)
    out = impl(ix.select_tokens)(scores, positions, topk, kp, tail)
    assert out.dtype == torch.int64
    assert torch.equal(out, _naive_select(scores, positions, topk, kp, tail))


def test_select_tokens_dense_fast_path_and_errors(impl):
    positions = torch.tensor([0, 3, 5, 10])
    out = impl(ix.select_tokens)(None, positions, 8, 4)  # (10 + 1) // 4 = 2 pools <= 8 // 4: dense
    for row, t in zip(out.tolist(), positions.tolist()):
        assert row == list(range(t + 1)) + [-1] * (11 - t - 1)
    assert ix.all_candidates_fit(10, 8, 4) and not ix.all_candidates_fit(11, 8, 4)
    with pytest.raises(ValueError):
        impl(ix.select_tokens)(None, torch.tensor([11]), 8, 4)
    with pytest.raises(ValueError):
        impl(ix.select_tokens)(torch.zeros(1, 2), torch.tensor([11]), 8, 4)  # pool 2 is complete but not scored


# ---------------------------------------------------------------------------------------------------------
# pooled keys in the paged cache: stored when a pool completes, read one row per pool
# ---------------------------------------------------------------------------------------------------------

KP, DI, LEAD = 4, 6, 3
BLOCK = 16  # four pools a page
ROW = cache_row_size(LEAD, DI, KP, block_size=BLOCK)  # raw inputs of two pools a page, as the smallest real page


class PagedSequences:
    """Requests' tokens in shuffled blocks of a paged cache, written step by step as the layer writes them
    (the store op, then the write op), and a plain mirror of what the pages must then show: every stored
    token's latent, and for every stored pool-completing token its pool's key, :func:`kpool_compress_torch` of the
    raw inputs the pool's positions last had, read position by position (the completing token's from the step).
    Where the pages keep the raw inputs is theirs to decide; that they kept the right ones shows in the keys of
    pools completed in later steps."""

    def __init__(self, n_requests, max_len, block_size, seed, row=ROW):
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        per = -(-max_len // block_size)
        total = n_requests * per + 2  # two blocks no request owns
        self.table = torch.randperm(total, generator=self.gen)[: n_requests * per].view(n_requests, per).int()
        self.cache = torch.randn(total, block_size, row, generator=self.gen)
        self.expected = self.cache.clone()
        self.pages = page_views(self.cache, LEAD, DI, KP)
        self.mirror = page_views(self.expected, LEAD, DI, KP)
        self.raw = [dict() for _ in range(n_requests)]  # position -> the raw [key | gate] it was last given
        self.ape = torch.randn(KP, DI, generator=self.gen)

    def slot(self, r, pos):
        return int(self.table[r, pos // self.block_size]) * self.block_size + pos % self.block_size

    def step(self, spans, unstored=()):
        """One step's inputs: ``spans [(request, first position, n tokens)]`` (the batch holds the requests in index
        order, those without a span with no tokens); tokens at ``(request, position)`` in ``unstored`` carry slot -1.
        Updates the mirror and returns ``(plan, latent, key_gate)``."""
        cu, seq_lens, ctx, slots = [0], [], [], []
        n_req = self.table.shape[0]
        span_of = {r: (start, n) for r, start, n in spans}
        for r in range(n_req):
            start, n = span_of.get(r, (0, 0))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            ctx.append(start)
            slots += [-1 if (r, pos) in unstored else self.slot(r, pos) for pos in range(start, start + n)]
        T = cu[-1]
        plan = LatentCachePlan(torch.tensor(cu), torch.tensor(seq_lens), torch.tensor(ctx), self.table,
                               torch.tensor(slots), n_req, T, max(n for _, _, n in spans), max(seq_lens))
        latent, key_gate = torch.randn(T, LEAD, generator=self.gen), torch.randn(T, 2 * DI, generator=self.gen)
        bs = self.block_size
        t = 0
        done = []
        for r in range(n_req):
            start, n = span_of.get(r, (0, 0))
            for pos in range(start, start + n):
                if slots[t] >= 0:
                    self.raw[r][pos] = key_gate[t]
                    blk, off = divmod(slots[t], bs)
                    self.mirror.latent[blk, off] = latent[t]
                    if pos % KP == KP - 1:
                        done.append((r, pos, blk, off // KP))
                t += 1
        for r, pos, blk, pool in done:
            inputs = torch.stack([self.raw[r][s] for s in range(pos - KP + 1, pos + 1)])
            self.mirror.pooled[blk, pool] = ix.kpool_compress_torch(inputs[:, :DI], inputs[:, DI:], self.ape)[0]
        return plan, latent, key_gate

    def layer_step(self, impl, spans, unstored=()):
        """One step as the layer takes it (model/mla.py): the store op, then the writes, each as ``impl`` gives
        it."""
        plan, latent, key_gate = self.step(spans, unstored)
        impl(ix.store_pooled_keys)(self.pages, plan, key_gate, self.ape)
        impl(mla.write_tokens)(self.pages, plan.slot_mapping, latent, key_gate)
        return plan, key_gate

    def assert_pages_match(self):
        torch.testing.assert_close(self.pages.latent, self.mirror.latent, rtol=0, atol=0)
        torch.testing.assert_close(self.pages.pooled, self.mirror.pooled, rtol=0, atol=1e-6)
        unowned = sorted(set(range(self.cache.shape[0])) - set(self.table.flatten().tolist()))
        assert torch.equal(self.cache[unowned], self.expected[unowned])


def test_pages_keep_two_pools_of_raw_inputs(impl):
    """The smallest page the backend accepts keeps the raw inputs of the pools a 3- or 4-draft step may leave
    incomplete; the row vLLM is told covers that at every larger block size too."""
    L, dI, kp = 512, 128, 4
    assert cache_row_size(L, dI, kp) == 512 + 32 + 12  # 544 the latent and pooled keys alone
    assert [raw_pools(bs, cache_row_size(L, dI, kp), L, dI, kp) for bs in (128, 256, 384)] == [2, 4, 6]
    assert [raw_pools_needed(n, kp) for n in (0, 1, 3, 4, 5, 8)] == [1, 2, 2, 2, 3, 3]
    assert page_views(torch.zeros(1, BLOCK, ROW), LEAD, DI, KP).raw.shape == (1, 2, KP - 1, 2 * DI)
    with pytest.raises(ValueError, match="do not hold"):
        page_views(torch.zeros(1, 8, LEAD + 2), LEAD, DI, KP)
    # a chunk filling a page keeps the raw inputs of its last two pools, pool p in slot p % 2 (each token's inputs
    # here are its position)
    pages = page_views(torch.zeros(1, BLOCK, ROW), LEAD, DI, KP)
    inputs = torch.arange(float(BLOCK)).unsqueeze(1).expand(-1, 2 * DI)
    impl(mla.write_tokens)(pages, torch.arange(BLOCK), torch.zeros(BLOCK, LEAD), inputs)
    assert pages.raw[0, :, :, 0].tolist() == [[8, 9, 10], [12, 13, 14]]


def test_store_pooled_keys_where_pools_complete(impl):
    """Pools completing in a prefill chunk, across chunk edges, in decodes and in speculative steps (a draft
    that completed a pool, rejected and rewritten), a pool-completing token that is not stored (slot -1), a
    request with no tokens in a step, and a chunk that finishes a pool begun in the previous one and then writes
    more pools of the same page than it keeps raw inputs for: after every step each page shows the plain
    mirror's latents and pooled keys."""
    seqs = PagedSequences(n_requests=4, max_len=40, block_size=BLOCK, seed=11)
    steps = [
        ([(0, 0, 10), (1, 0, 3)], ()),                   # prefill chunk: pools 0, 1 complete, pool 2 straddles
        ([(0, 10, 4), (1, 3, 1), (3, 0, 4)], {(3, 3)}),  # the chunk completes pool 2; a decode completes pool 0
        ([(0, 14, 4), (1, 4, 1), (3, 3, 1)], ()),        # drafts 14..17 (15 completes pool 3); slot -1 stored now
        ([(0, 15, 4), (1, 5, 1)], ()),                   # 15..17 rejected: rewritten from 15, pool 3 again
        ([(0, 19, 1), (2, 0, 6), (1, 6, 2)], ()),        # pool 4 from three rows of the previous step
        ([(2, 6, 14), (0, 20, 2)], ()),                  # pool 1 from the last chunk; pools 2, 3, 4 of this one
        ([(0, 22, 2), (2, 20, 3)], ()),                  # pool 5 of request 0: raw inputs of two earlier steps
        ([(2, 23, 4), (0, 24, 1)], ()),                  # request 2's pool 5 from the previous step's three rows
    ]
    for spans, unstored in steps:
        seqs.layer_step(impl, spans, unstored)
        seqs.assert_pages_match()


def test_speculative_steps_keep_the_inputs_of_rejected_pools(impl):
    """Verification steps of 1 + 3 and 1 + 4 drafts (the most a page of two raw slots takes) crossing pool edges,
    rejected in every way, over many steps and pages: each pool's key is the one its accepted tokens give."""
    seqs = PagedSequences(n_requests=2, max_len=64, block_size=BLOCK, seed=14)
    gen = torch.Generator().manual_seed(15)
    seqs.layer_step(impl, [(0, 0, 3), (1, 0, 6)])
    accepted = [3, 6]
    assert raw_pools_needed(KP, KP) == seqs.pages.raw.shape[1]
    while max(accepted) < 56:
        n = 4 + int(torch.randint(0, 2, (1,), generator=gen))
        seqs.layer_step(impl, [(r, c, n) for r, c in enumerate(accepted)])
        seqs.assert_pages_match()
        accepted = [c + int(torch.randint(1, n + 1, (1,), generator=gen)) for c in accepted]


def test_selection_reads_the_pooled_keys(impl):
    """Selection over the stored pooled keys equals the definition: every complete pool compressed from the raw
    keys and gates, scored, selected (decodes below and above the dense limit, a prefill chunk, odd lengths)."""
    topk, nI = 8, 5  # a group of four heads and one more in the compiled scoring
    lengths, q_lens = [45, 11, 38, 27], [1, 1, 9, 27]
    seqs = PagedSequences(n_requests=len(lengths), max_len=max(lengths), block_size=BLOCK, seed=12)
    seqs.layer_step(impl, [(r, 0, n) for r, n in enumerate(lengths)])  # the whole prompts
    gen = torch.Generator().manual_seed(13)
    T = sum(q_lens)
    q, w = torch.randn(T, nI, DI, generator=gen), torch.randn(T, nI, generator=gen)
    cu = torch.tensor([0] + q_lens).cumsum(0)
    seq_lens = torch.tensor(lengths)
    query_plan = LatentCachePlan(cu, seq_lens, seq_lens - torch.tensor(q_lens), seqs.table, torch.full((T,), -1),
                                 len(lengths), T, max(q_lens), max(lengths))
    got = impl(ix.select_batch)(q, w, seqs.pages.pooled, query_plan, topk, KP)
    for r, S in enumerate(lengths):
        lo, hi = int(cu[r]), int(cu[r + 1])
        raw = torch.stack([seqs.raw[r][s] for s in range(S)])
        pooled = ix.kpool_compress_torch(raw[: S // KP * KP, :DI], raw[: S // KP * KP, DI:], seqs.ape)
        scores = ix.index_scores_torch(q[lo:hi], w[lo:hi], pooled)
        scores = torch.nn.functional.pad(scores, (0, 1 if S % KP else 0))  # transformers' incomplete-pool column
        want = ix.select_tokens_torch(scores, torch.arange(S - (hi - lo), S), topk, KP)
        assert torch.equal(got[lo:hi], want), f"request {r}"
    assert (got[0] >= 0).sum() < lengths[0] // 2  # the long decode really selected sparsely


# ---------------------------------------------------------------------------------------------------------
# indexer vs transformers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [40, 61])
def test_selection_matches_hf_sets(attn, T):
    x = _x(attn, T, 10 + T)
    ours = hf_ref.indexer_selection(attn, x)
    ref = _hf_indices(attn, x)
    assert ours.shape == ref.shape == (T, attn.config.index_topk + attn.config.index_kpool - 1)
    assert _as_sets(ours) == _as_sets(ref)
    # sparse selection really drops tokens, and rows are ascending then -1
    assert max(len(s) for s in _as_sets(ours)) < T // 2
    for row in ours.tolist():
        valid = [i for i in row if i >= 0]
        assert valid == sorted(valid) and row == valid + [-1] * (len(row) - len(valid))


def test_selection_for_decode_queries_matches_hf(attn):
    """Queries at the last positions only (decode), scored against every complete pool of the context."""
    x = _x(attn, 47, 5)
    positions = torch.tensor([43, 44, 45, 46])
    ours = hf_ref.indexer_selection(attn, x, positions)
    assert _as_sets(ours) == _as_sets(_hf_indices(attn, x)[positions])


def test_selection_short_context_is_dense(attn):
    x = _x(attn, 11, 6)
    ours = hf_ref.indexer_selection(attn, x)
    assert _as_sets(ours) == [set(range(t + 1)) for t in range(11)] == _as_sets(_hf_indices(attn, x))


# ---------------------------------------------------------------------------------------------------------
# sparse latent attention
# ---------------------------------------------------------------------------------------------------------


def _expanded_reference(q_nope, latent, kv_b, indices, H, dn, dv, scale):
    """Plain MHA per query and head over explicitly expanded keys/values of the selected tokens."""
    kv = (latent @ kv_b.t()).view(-1, H, dn + dv)
    k, v = kv[..., :dn], kv[..., dn:]
    out = torch.zeros(q_nope.shape[0], H, dv)
    for t, row in enumerate(indices.tolist()):
        sel = [i for i in row if i >= 0]
        for h in range(H):
            p = torch.softmax(k[sel, h] @ q_nope[t, h] * scale, dim=0)
            out[t, h] = p @ v[sel, h]
    return out


@pytest.mark.parametrize("pad_to", [None, 64])
def test_sparse_latent_attention_equals_expanded_mha(pad_to, impl):
    """Gather path (S > 2N) and masked path (indices padded with -1 until N >= S/2) vs expanded MHA."""
    gen = torch.Generator().manual_seed(7)
    S, H, dn, dv, L = 30, 3, 8, 6, 10
    latent = torch.randn(S, L, generator=gen)
    kv_b = torch.randn(H * (dn + dv), L, generator=gen) * 0.3
    q_nope = torch.randn(S, H, dn, generator=gen)
    scores = torch.randn(S, S // 4, generator=gen)
    indices = ix.select_tokens(scores, torch.arange(S), 8, 4)
    if pad_to:
        indices = torch.nn.functional.pad(indices, (0, pad_to - indices.shape[1]), value=-1)
    w_uk, w_uv = mla.split_kv_b(kv_b, H, dn, dv)
    o_lat = impl(mla.sparse_latent_attention)(mla.absorb_q(q_nope, w_uk), latent, indices, 0.25)
    out = mla.apply_uv(o_lat, w_uv)
    ref = _expanded_reference(q_nope, latent, kv_b, indices, H, dn, dv, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # tiny chunks give the same result (the torch form's memory bound; the kernel has no chunks)
    o_small = impl(mla.sparse_latent_attention)(mla.absorb_q(q_nope, w_uk), latent, indices, 0.25, max_chunk_elems=1)
    torch.testing.assert_close(o_small, o_lat, rtol=0, atol=1e-6)


@pytest.mark.parametrize("native", [False, True])
def test_absorption_weights_widen_where_the_cpu_has_no_bfloat16(native, monkeypatch):
    """On a CPU without native bfloat16 W_UK / W_UV are kept in float32 and the two products run in float32 (torch's
    bfloat16 batched GEMMs convert inside there); the results come back in the activation dtype, within one
    bfloat16 rounding of the float64 products."""
    from vllm_glm53.backends.cpu import linear

    monkeypatch.setattr(linear, "native_16bit", lambda dtype: native)
    gen = torch.Generator().manual_seed(9)
    H, dn, dv, L, T = 3, 8, 6, 32, 5
    kv_b = (torch.randn(H * (dn + dv), L, generator=gen) * 0.3).bfloat16()
    w_uk, w_uv = mla.split_kv_b(kv_b, H, dn, dv)
    assert w_uk.dtype == w_uv.dtype == (torch.bfloat16 if native else torch.float32)
    heads = kv_b.double().view(H, dn + dv, L)
    assert torch.equal(w_uk.double(), heads[:, :dn]) and torch.equal(w_uv.double(), heads[:, dn:])
    q_nope = torch.randn(T, H, dn, generator=gen).bfloat16()
    q_lat = mla.absorb_q(q_nope, w_uk)
    want = torch.einsum("thd,hdl->thl", q_nope.double(), heads[:, :dn])
    assert q_lat.dtype == torch.bfloat16
    torch.testing.assert_close(q_lat.double(), want, rtol=2**-7, atol=1e-6)
    out = mla.apply_uv(q_lat, w_uv)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), torch.einsum("thl,hvl->thv", q_lat.double(), heads[:, dn:]),
                               rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_sparse_latent_attention_empty_row_and_bf16(impl):
    gen = torch.Generator().manual_seed(8)
    q, latent = torch.randn(2, 2, 4, generator=gen).bfloat16(), torch.randn(5, 4, generator=gen).bfloat16()
    indices = torch.tensor([[-1, -1, -1], [4, 0, -1]])
    out = impl(mla.sparse_latent_attention)(q, latent, indices, 0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0].float(), torch.zeros(2, 4))
    p = torch.softmax(q[1].float() @ latent[[4, 0]].float().t() * 0.5, dim=-1)
    torch.testing.assert_close(out[1].float(), p @ latent[[4, 0]].float(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------
# whole MLA layer vs transformers (full indexer layer 3 and shared layer 4)
# ---------------------------------------------------------------------------------------------------------


def test_mla_layer_with_indexer_matches_hf(model, attn):
    x = _x(attn, 40, 9)
    mask = torch.ones(1, 40, dtype=torch.bool)
    with torch.no_grad():
        ref, _, hf_indices = attn(x.unsqueeze(0), attention_mask=mask)
    indices = hf_ref.indexer_selection(attn, x)
    torch.testing.assert_close(hf_ref.mla_layer_forward(attn, x, indices), ref[0], rtol=0, atol=1e-5)

    shared = hf_ref.layer(model, 4).self_attn
    assert shared.indexer is None
    with torch.no_grad():
        ref4, _, _ = shared(x.unsqueeze(0), attention_mask=mask, prev_topk_indices=hf_indices)
    torch.testing.assert_close(hf_ref.mla_layer_forward(shared, x, indices), ref4[0], rtol=0, atol=1e-5)
