"""Lightning indexer with k-pool compression, plain PyTorch — architecture.md section 7.

Serving layout: no padding, pools start at absolute position 0, pool ``p`` = tokens ``[p*kp, (p+1)*kp)``. Only
complete pools are scored; the query's own incomplete pool (its "tail") is appended verbatim.

Index rows produced here are sorted ascending — selected pools in pool order, each expanded to its ``kp``
tokens, then the tail — and padded on the right with -1. transformers emits the same sets in top-k order;
every consumer in this package treats a row as a set.
"""

from __future__ import annotations

import torch

__all__ = [
    "kpool_compress",
    "index_scores",
    "select_tokens",
    "all_candidates_fit",
    "dense_causal_indices",
    "index_width",
]


def kpool_compress(k: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
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


def index_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
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


def select_tokens(
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
