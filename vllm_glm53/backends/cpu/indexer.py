"""Lightning indexer with k-pool compression, plain PyTorch — architecture.md section 7.

Serving layout: no padding, pools start at absolute position 0, pool ``p`` = tokens ``[p*kp, (p+1)*kp)``. Only
complete pools are scored; the query's own incomplete pool (its "tail") is appended verbatim.

Index rows produced here are sorted ascending — selected pools in pool order, each expanded to its ``kp``
tokens, then the tail — and padded on the right with -1. transformers emits the same sets in top-k order;
every consumer in this package treats a row as a set.

Each op is an :class:`~vllm_glm53.backends.dispatch.Op`: a ``compiled`` implementation (csrc/indexer.cpp)
when the kernels are built and take the call, else the ``torch`` one below (kept under a ``*_torch`` name, the
reference the kernels are tested against). Both break exact ties with the same ``torch.topk`` call over the same
row layout. :data:`store_pooled_keys` and :data:`select_batch` are the batch-wide ops the layer calls, over the
paged cache and the step plan (:class:`~vllm_glm53.backends.plans.LatentCachePlan`); the others are their
per-sequence steps.

Pooled keys in the cache (page layout: :mod:`vllm_glm53.backends.latent_cache`). Each page holds the pooled key
``K_p`` of each of its pools, contiguous, and, in a few raw slots (pool p in slot ``p % raw_pools``), the raw
indexer key and gate logits of the first kp - 1 tokens of the pools still being written. When a step writes a
pool's last token, :data:`store_pooled_keys` compresses the pool from its tokens' raw inputs (those written by
this step from the step's values, earlier ones from the page) and stores ``K_p`` (in the cache dtype); then
:data:`~vllm_glm53.backends.cpu.sparse_mla.write_tokens` stores the step's raw inputs of the last pools it
writes in each page. Selection reads one pooled key per complete pool, a block's keys as one stream. No state
outside the pages is needed, and every way a page can be read stays correct:

  * a pool that completes in a later step or prefill chunk than it started in is compressed from the inputs of
    its earlier tokens, kept in the page: the step that started it wrote them into the pool's raw slot, and a
    slot is reused only by a step that writes ``raw_pools`` pools further on in the same page, which completes
    (and compresses, before writing) every earlier pool of that page unless some of its positions are
    speculative drafts; the layer refuses more drafts than the slots cover (``raw_pools_needed``);
  * a speculative draft that completes a pool and is rejected leaves a ``K_p`` that no accepted token reads
    (selection only reads pools complete at the query's position, and the real completion stores the pool
    again), and raw inputs that the step rewriting those positions replaces;
  * prefix caching shares whole blocks, and the block size is a multiple of kp, so every pool of a shared block
    is complete and compressed.
"""

from __future__ import annotations

import torch

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.cpu.paged import sequence_rows
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check
from vllm_glm53.backends.pages import LatentPages
from vllm_glm53.backends.plans import LatentCachePlan

__all__ = [
    "kpool_compress",
    "store_pooled_keys",
    "index_scores",
    "select_tokens",
    "select_batch",
    "all_candidates_fit",
    "dense_causal_indices",
    "index_width",
]


kpool_compress = Op("kpool_compress")
index_scores = Op("index_scores")
select_tokens = Op("select_tokens")
store_pooled_keys = Op("store_pooled_keys")
select_batch = Op("select_batch")


@kpool_compress.register("compiled", compiled_kernels_check(lambda k, gate_logits, ape: (k, gate_logits, ape)))
def _kpool_compress_compiled(k, gate_logits, ape):
    return kernels.ops().kpool_compress(k, gate_logits, ape)


@kpool_compress.register("torch")
def kpool_compress_torch(k: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Compress complete pools: ``K_p[c] = sum_j softmax_j(gate[p*kp+j, c] + ape[j, c]) * k[p*kp+j, c]``.

    k: ``[T, dI]`` post-LayerNorm indexer keys; gate_logits: ``[T, dI]``; ape: ``[kp, dI]``; T a multiple of kp
    (the tokens of complete pools, in order). Returns ``[T // kp, dI]`` float32. The softmax runs over the kp
    slots of a pool, for each channel separately.
    """
    kp, dI = ape.shape
    T = k.shape[0]
    if T % kp:
        raise ValueError(f"kpool_compress needs whole pools: {T} tokens, pool size {kp}")
    logits = gate_logits.to(torch.float32).view(T // kp, kp, dI) + ape.to(torch.float32)
    probs = torch.softmax(logits, dim=1)
    return (probs * k.to(torch.float32).view(T // kp, kp, dI)).sum(dim=1)


@index_scores.register("compiled", compiled_kernels_check(lambda q, weights, pooled: (q, weights, pooled)))
def _index_scores_compiled(q, weights, pooled):
    return kernels.ops().index_scores(q, weights, pooled)


@index_scores.register("torch")
def index_scores_torch(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Pool scores ``I[t, p] = sum_h w[t, h] * ReLU(dI**-0.5 * q[t, h] . K_p)`` in float32.

    q: ``[Tq, nI, dI]``; weights: ``[Tq, nI]`` (already multiplied by ``nI**-0.5``); pooled: ``[P, dI]``.
    Returns ``[Tq, P]``. Causality is not applied here (see :func:`select_tokens`).
    """
    dI = q.shape[-1]
    logits = torch.matmul(q.to(torch.float32), pooled.to(torch.float32).t())  # [Tq, nI, P]
    logits = torch.relu(logits * dI**-0.5)
    return torch.matmul(weights.to(torch.float32).unsqueeze(1), logits).squeeze(1)


def index_width(topk: int, kp: int, always_select_tail: bool = True) -> int:
    """Width of an index row: ``topk`` selected tokens plus up to ``kp - 1`` tail tokens."""
    return topk + (kp - 1 if always_select_tail else 0)


def all_candidates_fit(max_position: int, topk: int, kp: int) -> bool:
    """True when a query at ``max_position`` (and hence every earlier one) selects all its complete pools, i.e.
    the sparse selection is exactly dense causal attention and no scores are needed."""
    return (max_position + 1) // kp <= topk // kp


def dense_causal_indices(
    positions: torch.Tensor, topk: int, kp: int, always_select_tail: bool = True
) -> torch.Tensor:
    """Index rows for the dense case (:func:`all_candidates_fit`): every complete pool, plus the tail if enabled
    (i.e. tokens ``0..t``). ``[Tq, index_width]`` int64, ascending, -1 padded."""
    width = index_width(topk, kp, always_select_tail)
    positions = positions.to(torch.int64)
    col = torch.arange(width, device=positions.device).unsqueeze(0)
    if always_select_tail:
        end = positions + 1
    else:
        end = (positions + 1) // kp * kp
    return torch.where(col < end.unsqueeze(1), col, torch.full_like(col, -1))


def _select_tokens_check(scores, positions, topk, kp, always_select_tail=True):
    if positions.device.type != "cpu":
        return f"needs CPU positions, got {positions.device.type}"
    return _scores_check(scores)


_scores_check = compiled_kernels_check(lambda scores: () if scores is None else (scores,))


@select_tokens.register("compiled", _select_tokens_check)
def _select_tokens_compiled(scores, positions, topk, kp, always_select_tail=True):
    return kernels.ops().select_tokens(scores, positions, topk, kp, always_select_tail)


@select_tokens.register("torch")
def select_tokens_torch(
    scores: torch.Tensor | None,
    positions: torch.Tensor,
    topk: int,
    kp: int,
    always_select_tail: bool = True,
) -> torch.Tensor:
    """Top-k pool selection and expansion to token indices.

    scores: ``[Tq, P]`` from :func:`index_scores` over pools ``0..P-1``; P must cover every complete pool of the
    latest query (``P >= (max(positions) + 1) // kp``); may be None when :func:`all_candidates_fit`.
    positions: ``[Tq]`` absolute positions of the queries.

    Candidates for a query at t are the complete pools ending at or before t (``p < (t + 1) // kp``); the best
    ``min(topk // kp, #candidates)`` of them are kept. Exact ties are broken as transformers breaks them, by
    ``torch.topk`` over the whole row; to reproduce its row layout pass ``ceil(seq_len / kp)`` columns (the
    last, incomplete pool's column is never a candidate, its value does not matter). With ``always_select_tail`` the tokens
    ``(t + 1) // kp * kp .. t`` are appended.

    Returns ``[Tq, index_width(topk, kp, always_select_tail)]`` int64, each row ascending, -1 padded.
    """
    positions = positions.to(torch.int64)
    if all_candidates_fit(int(positions.max()), topk, kp):
        return dense_causal_indices(positions, topk, kp, always_select_tail)
    if scores is None:
        raise ValueError("select_tokens needs scores once a query has more than topk // kp candidate pools")

    device = scores.device
    Tq, P = scores.shape
    K = topk // kp
    n_cand = (positions + 1) // kp  # [Tq]
    if int(n_cand.max()) > P:
        raise ValueError(f"scores cover {P} pools but a query has {int(n_cand.max())} complete pools")

    pool_ids = torch.arange(P, device=device).unsqueeze(0)
    candidate = pool_ids < n_cand.unsqueeze(1)  # [Tq, P]
    # The same call transformers makes on the same row layout, so exact ties (ReLU makes many pool scores
    # exactly 0) are broken the same way: torch.topk over every pool column of the sequence so far, with
    # non-candidates at float32's lowest value. Non-candidates it still returns are dropped afterwards.
    masked = scores.to(torch.float32).masked_fill(~candidate, torch.finfo(torch.float32).min)
    top = masked.topk(min(K, P), dim=1).indices
    chosen = torch.zeros_like(candidate).scatter_(1, top, True) & candidate

    # Compact chosen pool ids to the left, ascending: slot = rank among chosen; unchosen go to a spill column.
    n_chosen = chosen.sum(dim=1)  # = min(K, n_cand)
    slot = torch.where(chosen, chosen.cumsum(dim=1) - 1, torch.full_like(pool_ids, K))
    pools = torch.full((Tq, K + 1), -1, dtype=torch.int64, device=device)
    pools.scatter_(1, slot, pool_ids.expand(Tq, P))
    pools = pools[:, :K]

    width = index_width(topk, kp, always_select_tail)
    tokens = (pools.unsqueeze(-1) * kp + torch.arange(kp, device=device)).reshape(Tq, K * kp)
    tokens = torch.nn.functional.pad(tokens, (0, width - K * kp), value=-1)

    col = torch.arange(width, device=device).unsqueeze(0)
    n_pool_tokens = (n_chosen * kp).unsqueeze(1)
    out = torch.where(col < n_pool_tokens, tokens, torch.full_like(tokens, -1))
    if always_select_tail:
        tail_start = (n_cand * kp).unsqueeze(1)
        tail_len = ((positions + 1) % kp).unsqueeze(1)
        in_tail = (col >= n_pool_tokens) & (col < n_pool_tokens + tail_len)
        out = torch.where(in_tail, tail_start + col - n_pool_tokens, out)
    return out


@store_pooled_keys.register("compiled", compiled_kernels_check(
    lambda pages, plan, key_gate, ape: (pages.pooled, pages.raw, key_gate, ape)))
def _store_pooled_keys_compiled(pages, plan, key_gate, ape):
    kernels.ops().store_pooled_keys(pages.pooled, pages.raw, key_gate, plan.slot_mapping[: plan.num_tokens], ape)


@store_pooled_keys.register("torch")
def store_pooled_keys_torch(pages: LatentPages, plan: LatentCachePlan, key_gate: torch.Tensor,
                            ape: torch.Tensor) -> None:
    """Store the compressed key of every pool this step completes.

    pages: the layer's cache regions (:func:`~vllm_glm53.backends.pages.page_views`), holding the raw inputs
    of earlier steps (this step's are written after this call); key_gate ``[T, 2 dI]``: the step's raw key and
    gate logits per token, in batch order; the plan's ``slot_mapping`` gives each token's cache slot (-1: not
    stored). A stored token whose slot is the last of a pool (``slot % kp == kp - 1``: block sizes are multiples
    of kp, so that is its position's place) completes it: :func:`kpool_compress` of the pool's kp tokens' raw
    inputs, in the cache dtype (the step's own for positions this step writes, the page's raw slot ``pool %
    raw_pools`` for earlier ones), is written to the page's pooled key of that pool. ape ``[kp, dI]``.
    """
    kp, dI = ape.shape
    pools, n_slots = pages.pooled.shape[1], pages.raw.shape[1]
    slot = plan.slot_mapping[: plan.num_tokens].to(torch.int64)
    req, pos = plan.token_positions()
    completes = torch.nonzero((slot >= 0) & (slot % kp == kp - 1)).squeeze(1)
    block, pool = slot[completes] // (pools * kp), slot[completes] % (pools * kp) // kp
    step_values = key_gate[: plan.num_tokens].to(pages.raw.dtype)
    back = torch.arange(kp - 1, -1, -1, device=slot.device)  # distance of each pool token from the last one
    in_step = (pos[completes].unsqueeze(1) - back) >= plan.context_lens[req[completes]].unsqueeze(1)  # [n, kp]
    from_step = step_values[(completes.unsqueeze(1) - back).clamp(min=0)]  # [n, kp, 2 dI]
    from_page = torch.cat([pages.raw[block, pool % n_slots], from_step[:, -1:]], dim=1)
    raw = torch.where(in_step.unsqueeze(-1), from_step, from_page).reshape(-1, 2 * dI)  # [completed * kp, 2 dI]
    pages.pooled[block, pool] = kpool_compress_torch(raw[:, :dI], raw[:, dI:], ape).to(pages.pooled.dtype)


@select_batch.register("compiled", compiled_kernels_check(
    lambda q, weights, pooled, *args, **kwargs: (q, weights, pooled)))
def _select_batch_compiled(q, weights, pooled, plan, topk, kp, always_select_tail=True):
    return kernels.ops().indexer_select(q, weights, pooled, plan.block_table, plan.cu_seqlens, plan.seq_lens, topk,
                                        kp, always_select_tail)


@select_batch.register("torch")
def select_batch_torch(
    q: torch.Tensor,
    weights: torch.Tensor,
    pooled: torch.Tensor,
    plan: LatentCachePlan,
    topk: int,
    kp: int,
    always_select_tail: bool = True,
) -> torch.Tensor:
    """Index rows for every query of a batch, reading the pooled keys from the paged cache.

    q ``[T, nI, dI]`` and weights ``[T, nI]`` as in :func:`index_scores`; the plan's request r has its queries at
    ``cu_seqlens[r]:cu_seqlens[r+1]``, which are its last positions (``seq_lens[r]`` tokens in all, the first
    ``context_lens[r]`` of them already cached); pooled ``[num_blocks, block_size / kp, dI]``: the pages' pooled
    keys (:func:`store_pooled_keys`), pool p of a request in its block ``p // (block_size / kp)`` of the plan's
    block table. Returns ``[T, index_width]`` int64, each row as :func:`select_tokens` gives it for that request
    scored over transformers' row layout (``ceil(seq_len / kp)`` columns).

    Plain torch: :func:`select_per_request` with the torch forms of the per-sequence steps.
    """
    return select_per_request(index_scores_torch, select_tokens_torch, q, weights, pooled, plan, topk, kp,
                              always_select_tail)


def select_per_request(
    score,
    select,
    q: torch.Tensor,
    weights: torch.Tensor,
    pooled: torch.Tensor,
    plan: LatentCachePlan,
    topk: int,
    kp: int,
    always_select_tail: bool = True,
) -> torch.Tensor:
    """:func:`select_batch` one request at a time with a backend's per-sequence ops (``score``, ``select``: the
    signatures of :func:`index_scores`, :func:`select_tokens`): gather the pooled keys of the request's complete
    pools from the pages, score over transformers' row layout, select. Outputs on ``q``'s device. It reads the
    plan back to the host and loops over requests: a reference form, and the GPU backend's until it has a
    batch-wide selection kernel."""
    starts, lens = plan.cu_seqlens.tolist(), plan.seq_lens.tolist()
    out = torch.full((q.shape[0], index_width(topk, kp, always_select_tail)), -1, dtype=torch.int64,
                     device=q.device)
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        if hi == lo:
            continue
        seq_len = lens[r]
        positions = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        scores = None
        if not all_candidates_fit(seq_len - 1, topk, kp):
            scores = score(q[lo:hi], weights[lo:hi], sequence_rows(pooled, plan.block_table[r], seq_len // kp))
            if seq_len % kp:  # transformers' row layout has a column for the incomplete pool (never chosen)
                scores = torch.nn.functional.pad(scores, (0, 1))
        out[lo:hi] = select(scores, positions, topk, kp, always_select_tail)
    return out
