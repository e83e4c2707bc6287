"""Compiled CPU kernels (csrc/, torch.ops.vllm_glm53) against the plain-torch backends they replace.

Random inputs with odd sizes (head dims that are not multiples of the 16-float vector, column groups with a
tail, pools and blocks that do not line up), strided views like the ones vLLM binds (state pools inside padded
pages, latent columns of cache rows), bfloat16 caches, padded slots and mixed prefill/decode batches. Selection
must be identical, including exact ties.

Every instruction set this CPU runs is checked: this process loads the best one built (or the one
``VLLM_GLM53_CPU_ISA`` forces) and ``test_other_instruction_sets`` runs this module again in a subprocess for each
of the others (all libraries register the same op namespace, so one process holds one). AVX-512 code is
compiled, and run, only where the CPU has it.

Floating-point outputs are compared in units of ``ulp(max|reference|)``, the dtype's epsilon times the
reference's largest magnitude (:func:`_close`): the kernels sum in another order than torch, so their error
scales with the magnitudes summed, not with each output. Each tolerance is about 4x the largest error measured on
the avx2 and the portable path, both noted beside it (``GLM53_MEASURE_ERROR=FILE`` appends every measured error
to FILE, to re-derive them on another machine). The paths' errors differ by less than 2x, so they share each
tolerance; avx512 computes as avx2 does by construction (csrc/vec.h: same exp, reductions and fused
multiply-adds), which this machine (AVX2 only) cannot check.

``make test`` builds the kernels first (scripts/setup-cpu.sh): where a C++ compiler exists a missing or stale
library fails here; only a machine without a compiler skips (it runs the plain-torch backends).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernel_isas import EMULATION_ENV, ISA, bf16_products, ops, other_isas, rerun_on  # noqa: F401
from vllm_glm53.backends.cpu import build, kda, kernels, mhc, moe, norm
from vllm_glm53.backends.cpu import linear as linear_ops
from vllm_glm53.backends.cpu import indexer as ix
from vllm_glm53.backends.cpu import sparse_mla as mla
from vllm_glm53.backends.pages import page_views
from vllm_glm53.backends.plans import LatentCachePlan, StateSlots
from vllm_glm53.config import cache_row_size

torch.set_num_threads(2)
# every test here needs the compiled kernels (those going through a backend entry point would otherwise compare
# the torch path with itself)
pytestmark = pytest.mark.usefixtures("compiled_kernels")


def test_loads_the_best_instruction_set_built_from_current_sources():
    """The set-up built every path this CPU runs from the current csrc/, and the loader took the best one (or
    the forced one)."""
    for isa in build.runnable_isas():
        assert build.up_to_date(isa), f"{build.library_path(isa).name} is missing or older than csrc/"
    assert ISA == (os.environ.get(kernels.ISA_ENV) or build.best_isa())
    assert ops.build_info().startswith(f"{ISA} torch ")


def test_amx_tiles_exactly_where_the_cpu_has_them():
    """The avx512 kernels multiply on AMX tiles (csrc/amx.h) where the CPU has AMX-BF16 and the OS grants the tile
    state (Linux from 5.16), unless ``VLLM_GLM53_CPU_AMX=0``; the loader's log line says so. A process started with
    the variable at 0 keeps them off."""
    has = ISA == "avx512" and "amx_bf16" in build.cpu_flags() and not os.environ.get(EMULATION_ENV)
    assert kernels.amx_tiles() == (has and os.environ.get(kernels.AMX_ENV, "1") != "0")
    assert ("AMX tiles" in kernels.description()) == kernels.amx_tiles()
    # kernel_isas first: in an emulated rerun it points the loader at the emulated library (this CPU has no avx512).
    probe = ("import kernel_isas; from vllm_glm53.backends.cpu import kernels; "
             "print(kernels.amx_tiles(), 'AMX tiles' in kernels.description())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, kernels.AMX_ENV: "0"},
                         cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("isa", other_isas())
def test_other_instruction_sets(isa):
    """This module on another instruction set this CPU runs, in a subprocess (the transformers comparison,
    which checks the torch loop the kernel is compared with, runs once, here)."""
    rerun_on(isa, __file__, "other_instruction_sets or transformers", timeout=1200)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# float64 references are compared in float32 ulps: _close's unit is eps(reference dtype), so scale it
F32_ULPS = torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps


def _close(got, want, ulps):
    """|got - want| <= ulps * eps(dtype) * max|want| everywhere (same shape, dtype and NaN positions)."""
    unit = torch.finfo(want.dtype).eps * want.detach().abs().max().double().item()
    log = os.environ.get("GLM53_MEASURE_ERROR")
    if log:
        err = (got.double() - want.double()).abs().max().item()
        caller = inspect.stack()[1]
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                "line": caller.lineno, "isa": ISA, "ulps": err / unit if unit else err,
                                "allowed": ulps}) + "\n")
    torch.testing.assert_close(got, want, rtol=0, atol=ulps * unit)


# ---------------------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------------------


def _kda_inputs(T, H, dk, dv, seed, lower_bound=-5.0, a_scale=1.0):
    """q, k normalised and scaled as the layer makes them; v a strided view like the layer's split of the conv
    output; the bounded gate, or the unbounded one when ``lower_bound`` is None."""
    gen = _gen(seed)
    q, k = kda.l2norm_qk(torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dk, generator=gen), dk)
    v = torch.randn(T, 2, H, dv, generator=gen)[:, 1]
    g = kda.kda_gate(a_scale * torch.randn(T, H, dk, generator=gen), torch.randn(H, generator=gen), lower_bound)
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


SHAPES = [(1, 16, 16), (2, 24, 40), (3, 7, 70), (4, 128, 128)]  # (H, dk, dv): lane tails, >64-column groups

# A mixed step: a decode, a prefill chunk continuing a cached state, a fresh prompt longer than a chunk, a
# padding row (no tokens) and a fresh one-token prompt; slots of a 7-slot pool.
MIXED_CU = [0, 1, 12, 82, 82, 83]
MIXED_SLOTS = [5, 0, 3, 6, 2]
MIXED_HAS_STATE = [True, True, False, True, False]


def _mixed_plan():
    cu = torch.tensor(MIXED_CU)
    return StateSlots.single_slot(cu, torch.tensor(MIXED_SLOTS), torch.tensor(MIXED_HAS_STATE), MIXED_CU[-1],
                                  int((cu[1:] - cu[:-1]).max()))


def _spec_plan():
    """Two requests verifying drafts (3 and 2 tokens, slots per draft position, resuming from the slot of the last
    accepted token: column 1 and column 0)."""
    slots = torch.tensor([[6, 2, 3], [0, 4, 5]])
    spec = StateSlots.speculative(torch.tensor([0, 3, 5]), slots, torch.tensor([2, 1]), 5, 3)
    return spec


def _padded_pool(N, shape, pad, seed):
    """A pool inside padded pages, as vLLM binds state views (page stride larger than the state)."""
    numel = 1
    for n in shape:
        numel *= n
    pages = torch.randn(N, numel + pad, generator=_gen(seed))
    return pages, pages[:, pad:].view(N, *shape)


def _kda_varlen_matches_torch(plan, H, dk, dv, seed):
    """The compiled batch op against its torch form (per request, the chunked delta rule between store points) on a
    7-slot pool: outputs, every stored state, and nothing else in the pool or its page padding touched."""
    q, k, v, g, beta = _kda_inputs(plan.num_tokens, H, dk, dv, seed=seed)
    pages, pool = _padded_pool(7, (H, dk, dv), 33, seed=1)
    before = pages.clone()
    got = kda.kda_varlen.implementation("compiled")(q, k, v, g, beta, pool, plan)
    ref_pool = before[:, 33:].view(7, H, dk, dv).clone()
    want = kda.kda_varlen.implementation("torch")(q, k, v, g, beta, ref_pool, plan)
    # measured (ulps of max|reference|, avx2): 1.8 (portable not measured)
    _close(got, want, ulps=8)
    # measured (ulps of max|reference|, avx2): 0.81
    _close(pool, ref_pool, ulps=4)
    assert torch.equal(pages[:, :33], before[:, :33])
    stored = set(plan.state_out[plan.state_out_at >= 0].tolist())
    untouched = [s for s in range(7) if s not in stored]
    assert torch.equal(pool[untouched], before[:, 33:].view(7, H, dk, dv)[untouched])


@pytest.mark.parametrize("H,dk,dv", SHAPES)
@pytest.mark.parametrize("which", ["mixed", "speculative"])
def test_kda_varlen_matches_torch(H, dk, dv, which):
    _kda_varlen_matches_torch(_mixed_plan() if which == "mixed" else _spec_plan(), H, dk, dv, seed=dk + dv)


@pytest.mark.parametrize("H,dk,dv", [(2, 24, 40), (4, 128, 128)])
def test_kda_varlen_decodes_in_place_or_into_another_slot(H, dk, dv):
    """A step of one-token requests: two decodes that store back into the slot they read (the compiled op updates
    those in place), a one-token verification resuming from an accepted draft's slot and storing into its first
    column (another slot, whose source, slot 0, must stay as it was), a padding row and a fresh one-token prompt."""
    plan = StateSlots(torch.tensor([0, 1, 2, 3, 3, 4]), torch.tensor([2, 5, 0, -1, -1]),
                      torch.tensor([[2], [5], [3], [-1], [6]]), torch.tensor([[0], [0], [0], [-1], [0]]), 5, 4, 1)
    _kda_varlen_matches_torch(plan, H, dk, dv, seed=dk + 3)


def test_kda_varlen_speculative_stores_the_state_after_each_draft():
    """Against the naive recurrence: request r resumes from the state in its last accepted draft's slot and the
    state after its token i lands in slot column i."""
    H, dk, dv = 2, 24, 40
    plan = _spec_plan()
    q, k, v, g, beta = _kda_inputs(plan.num_tokens, H, dk, dv, seed=7)
    _, pool = _padded_pool(7, (H, dk, dv), 5, seed=8)
    want_pool, want = pool.clone(), torch.empty(plan.num_tokens, H, dv)
    for first, length, slot_in, outs in plan.rows():
        state = want_pool[slot_in].clone()
        for i, (after, slot) in enumerate(outs):
            t = first + i
            want[t : t + 1], state = kda.kda_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                                       beta[t : t + 1], state)
            assert after == i
            want_pool[slot] = state
    got = kda.kda_varlen.implementation("compiled")(q, k, v, g, beta, pool, plan)
    # measured (ulps of max|reference|, avx2): 1.5
    _close(got, want, ulps=6)
    # measured (ulps of max|reference|, avx2): 0.52
    _close(pool, want_pool, ulps=3)


def test_kda_varlen_long_strong_decay_matches_recurrence():
    """Unbounded gate with large rates: decays underflow to 0 without NaN, like the token-by-token oracle."""
    H, dk, dv, T = 2, 16, 16, 300
    q, k, v, g, beta = _kda_inputs(T, H, dk, dv, seed=9, lower_bound=None, a_scale=8.0)
    g = g * 20.0  # per-step log decays down to -hundreds
    plan = StateSlots.single_slot(torch.tensor([0, T]), torch.tensor([0]), torch.tensor([False]), T, T)
    pool = torch.zeros(1, H, dk, dv)
    o = kda.kda_varlen.implementation("compiled")(q, k, v, g, beta, pool, plan)
    want_o, want_state = kda.kda_recurrent(q, k, v, g, beta)
    assert torch.isfinite(o).all()
    # measured (ulps of max|reference|, avx2): 1.2
    _close(o, want_o, ulps=6)
    # measured (ulps of max|reference|, avx2): 0.30
    _close(pool[0], want_state, ulps=2)


@pytest.mark.parametrize("pool_layout", ["taps first", "packed", "strided"])
@pytest.mark.parametrize("layout", ["contiguous", "column slice", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["mixed", "speculative"])
def test_conv_varlen_matches_torch(dtype, which, layout, pool_layout):
    """Pools as vLLM binds them in its two layouts: tap after tap (each slot's ``[K-1, C]`` in a padded page, the
    model's view transposed: each tap of a block of channels one vector) and channel after channel (one run of
    C x (K-1) values, transposed in the kernel); and with a channel stride above K-1 (value by value)."""
    plan = _mixed_plan() if which == "mixed" else _spec_plan()
    C, K = 37, 4
    gen = _gen(12)
    x = torch.randn(plan.num_tokens, C, generator=gen).to(dtype)
    if layout == "column slice":  # rows of a wider projection output (row stride above C)
        x = torch.cat([torch.randn(plan.num_tokens, 5, generator=gen).to(dtype), x], dim=1)[:, 5:]
    elif layout == "transposed":  # channels not contiguous (the kernel copies them)
        x = x.t().contiguous().t()
    w = torch.randn(C, K, generator=gen)
    if pool_layout == "taps first":
        pages = torch.randn(7, C * (K - 1) + 5, generator=gen).to(dtype)
        pool = pages[:, 5:].view(7, K - 1, C).transpose(1, 2)
    elif pool_layout == "packed":
        pages = torch.randn(7, C * (K - 1) + 5, generator=gen).to(dtype)
        pool = pages[:, 5:].view(7, C, K - 1)
    else:
        pool = torch.randn(7, C, K + 1, generator=gen).to(dtype)[:, :, 1:K]
    ref_pool = pool.clone()
    got = kda.causal_conv1d_varlen.implementation("compiled")(x, w, pool, plan)
    want = kda.causal_conv1d_varlen.implementation("torch")(x, w, ref_pool, plan)
    # measured (ulps of max|reference|, avx2): 1.3 (float32, summation order); bfloat16 rounds the same value
    _close(got, want, ulps=6)
    assert torch.equal(pool, ref_pool)  # windows are copies of inputs: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gates_and_norms_match_torch(dtype):
    """The per-head ops around the recurrence on inputs laid out as the layer passes them: q and k strided views
    of the conv output ``[T, 3, H, d]``, the gate input float32, the output gate a column slice of a wider
    projection, the norm weight in the model dtype. d = 40: every row ends in a partial vector."""
    T, H, d = 5, 3, 40
    gen = _gen(21)
    q, k, _ = (2 * torch.randn(T, 3, H, d, generator=gen)).to(dtype).unbind(1)
    got, want = (kda.l2norm_qk.implementation(impl)(q, k, d) for impl in ("compiled", "torch"))
    for g_, w_ in zip(got, want):
        assert g_.dtype == torch.float32 and g_.shape == (T, H, d)
        _close(g_, w_, ulps=2)
    a, A_log = 3 * torch.randn(T, H, d, generator=gen), torch.randn(H, generator=gen)
    got, want = (kda.kda_gate.implementation(impl)(a, A_log, -5.0) for impl in ("compiled", "torch"))
    _close(got, want, ulps=2)
    o = torch.randn(T, H, d, generator=gen)
    gate = torch.randn(T, 2 * H * d, generator=gen).to(dtype)[:, H * d :].view(T, H, d)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    for out_dtype in (None, dtype):
        got, want = (kda.gated_rmsnorm.implementation(impl)(o, gate, w, 1e-5, out_dtype)
                     for impl in ("compiled", "torch"))
        assert got.dtype == want.dtype == (out_dtype or torch.float32)
        _close(got, want, ulps=2)


# ---------------------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kpool_compress_and_scores_match_torch(dtype):
    gen = _gen(20)
    kp, dI, T, nI, Tq = 4, 21, 36, 3, 5
    rows = torch.randn(T, 3 * dI, generator=gen).to(dtype)  # key and gate as column slices of cache rows
    k, gate = rows[:, dI : 2 * dI], rows[:, 2 * dI :]
    ape = torch.randn(kp, dI, generator=gen)
    pooled = ops.kpool_compress(k, gate, ape)
    # measured (ulps of max|reference|, avx2 / portable): 0.95 / 1.4
    _close(pooled, ix.kpool_compress_torch(k, gate, ape), ulps=6)
    q, w = torch.randn(Tq, nI, dI, generator=gen).to(dtype), torch.randn(Tq, nI, generator=gen)
    # measured (ulps of max|reference|, avx2 / portable): 0.82 / 1.2
    _close(ops.index_scores(q, w, pooled), ix.index_scores_torch(q, w, pooled), ulps=6)


@pytest.mark.parametrize("topk,kp,tail", [(8, 4, True), (8, 4, False), (6, 2, True), (3, 1, True), (64, 4, True)])
def test_select_tokens_identical_with_ties(topk, kp, tail):
    gen = _gen(21)
    T = 150
    P = -(-T // kp)
    scores = torch.randint(-1, 3, (T, P), generator=gen).float()  # many exact ties
    positions = torch.arange(T)
    want = ix.select_tokens_torch(scores, positions, topk, kp, tail)
    assert torch.equal(ops.select_tokens(scores, positions, topk, kp, tail), want)
    # decode-style queries and the dense short-context case
    late = positions[-3:]
    assert torch.equal(ops.select_tokens(scores[-3:], late, topk, kp, tail),
                       ix.select_tokens_torch(scores[-3:], late, topk, kp, tail))
    early = torch.arange(min(T, topk // kp * kp + kp - 1))
    assert torch.equal(ops.select_tokens(None, early, topk, kp, tail), ix.select_tokens_torch(None, early, topk, kp, tail))


@pytest.mark.parametrize("P", [40, 300])  # the top 4 of P pools: a partition, a heap (k * 64 <= P)
def test_select_tokens_ties_at_and_above_the_cut(P):
    """The kernel finds a row's top pools in one pass where the set is the same for every top-k and asks at::topk
    where a tie crosses the cut (the k-th largest score equals one left out) or a score is NaN: each kind of row,
    the whole batch against torch.topk's choice."""
    gen = _gen(24)
    topk, kp = 16, 4
    k = topk // kp
    rows = [torch.randn(P, generator=gen) for _ in range(3)]  # distinct scores
    above = torch.rand(P, generator=gen)  # ties above the cut only: 9, 9, 9 and a lone 5 are the top 4
    above[[3, 17, 30]], above[8] = 9.0, 5.0
    rows.append(above)
    for _ in range(12):  # ties across the cut: the 4th largest has equals left out
        row = torch.randint(0, 4, (P,), generator=gen).float()
        row[torch.randperm(P, generator=gen)[:2]] = 7.0
        rows.append(row)
    signed_zero = torch.full((P,), -1.0)  # 0.0 and -0.0 are equal: a tie across the cut
    signed_zero[[2, 5]], signed_zero[[9, 20, 33]] = 1.0, torch.tensor([0.0, -0.0, 0.0])
    rows.append(signed_zero)
    nan = torch.randn(P, generator=gen)  # at::topk ranks NaN first
    nan[11] = float("nan")
    rows.append(nan)
    rows.append(torch.zeros(P))  # all equal
    scores = torch.stack(rows)
    for row in rows[:4]:  # the one-pass rows: the 4th largest stands alone
        assert (row == row.topk(k).values[-1]).sum() == 1
    positions = torch.full((len(rows),), P * kp - 1)  # every pool complete
    want = ix.select_tokens_torch(scores, positions, topk, kp, True)
    assert torch.equal(ops.select_tokens(scores, positions, topk, kp, True), want)
    assert (want[-2] == 11 * kp).any()  # NaN's pool is chosen


def _paged(seq_lens, row, block_size, dtype, seed, fill):
    """A paged cache holding each request's rows ``fill(r, S)`` [S, row] in shuffled blocks, plus its block table."""
    gen = _gen(seed)
    n_blocks = [-(-S // block_size) for S in seq_lens]
    total = sum(n_blocks) + 3  # spare blocks that no request owns
    order = torch.randperm(total, generator=gen)
    pages = torch.randn(total, block_size, row, generator=gen).to(dtype)
    table = torch.full((len(seq_lens), max(n_blocks) + 1), -1, dtype=torch.int32)
    used = 0
    for r, (S, nb) in enumerate(zip(seq_lens, n_blocks)):
        ids = order[used : used + nb]
        used += nb
        table[r, :nb] = ids.to(torch.int32)
        data = torch.zeros(nb * block_size, row, dtype=dtype)
        data[:S] = fill(r, S).to(dtype)
        pages[ids] = data.view(nb, block_size, row)
    return pages, table


# A mixed batch: decodes below, at and above the dense limit (topk 16, kp 4: 16 + 3 tokens), odd lengths, one over
# three of the compiled indexer's work items (83 pools: 32 + 32 + 19 or, on avx2, 36 + 36 + 11), a whole prefill, a
# prefill chunk continuing a sequence, and a request without queries this step.
SEQ_LENS = [3, 19, 20, 23, 61, 333, 45, 77, 9]
Q_LENS = [1, 1, 1, 1, 1, 1, 45, 30, 0]


def _batch_meta(q_lens):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return starts


def _latent_plan(q_lens, seq_lens, table):
    cu = torch.tensor(_batch_meta(q_lens))
    seq = torch.tensor(seq_lens)
    T = int(cu[-1])
    return LatentCachePlan(cu, seq, seq - (cu[1:] - cu[:-1]), table, torch.arange(T), len(q_lens), T,
                           max(q_lens), max(seq_lens))


def _prompt_plan(seq_lens, table, block_size):
    """Every token of the requests new in one step (whole prompts), stored at its block-table slot."""
    cu = torch.tensor(_batch_meta(seq_lens))
    seq = torch.tensor(seq_lens)
    slots = torch.cat([table[r, torch.arange(S) // block_size].long() * block_size + torch.arange(S) % block_size
                       for r, S in enumerate(seq_lens)])
    T = int(cu[-1])
    return LatentCachePlan(cu, seq, torch.zeros_like(seq), table, slots, len(seq_lens), T, max(seq_lens),
                           max(seq_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_pooled_keys_matches_torch(dtype):
    """The mixed batch's new tokens (decodes, prefill chunks, one whose first pool started in the cached context,
    a request without tokens, padded slots): both forms store the same pooled keys and touch nothing else."""
    kp, dI, lead, bs = 4, 21, 10, 8
    gen = _gen(24)
    row = cache_row_size(lead, dI, kp, block_size=bs)
    cache, table = _paged(SEQ_LENS, row, bs, dtype, 25, lambda r, S: torch.randn(S, row, generator=gen))
    starts = _batch_meta(Q_LENS)
    slots = []
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        pos = torch.arange(SEQ_LENS[r] - (hi - lo), SEQ_LENS[r])
        slots.append(table[r, pos // bs].long() * bs + pos % bs)
    slots = torch.cat(slots)
    slots[[3, starts[6] + 7]] = -1  # not stored: a decode, and a chunk token completing a pool
    plan = dataclasses.replace(_latent_plan(Q_LENS, SEQ_LENS, table), slot_mapping=slots)
    ape = torch.randn(kp, dI, generator=gen)
    key_gate = torch.randn(len(slots), 2 * dI, generator=gen).to(dtype)
    want, got = cache.clone(), cache.clone()
    ix.store_pooled_keys.implementation("torch")(page_views(want, lead, dI, kp), plan, key_gate, ape)
    ix.store_pooled_keys.implementation("compiled")(page_views(got, lead, dI, kp), plan, key_gate, ape)
    # Pools completed: the decode at 19; 11 in the 45-token prompt, one not stored; 8 in the 30-token chunk at
    # 47..76, the first (44..47) started in the cached context.
    before = page_views(cache, lead, dI, kp).pooled
    assert (page_views(want, lead, dI, kp).pooled != before).any(-1).sum() == 1 + 10 + 8
    keys = page_views(got, lead, dI, kp).pooled
    changed = (keys != before).any(-1)
    rest = cache.clone()
    page_views(rest, lead, dI, kp).pooled[changed] = keys[changed]
    assert torch.equal(got, rest)  # nothing but the completed pools' keys
    # measured (ulps of max|reference|, avx2 / portable): float32 as kpool_compress; bfloat16 at most one rounding
    # step apart
    _close(keys, page_views(want, lead, dI, kp).pooled, ulps=6 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("with_keys", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_tokens_identical_to_torch(dtype, with_keys):
    """The step's writes, over the same mixed batch (padded slots among them) in blocks of 16 that keep two of
    their four pools' raw inputs (so a prefill chunk writes more pools of a page than it keeps), then a
    speculative step of 1 + 3 tokens a request (its slots as int32): both forms leave identical pages, bit for
    bit. float32 rows go into the cache dtype (a bfloat16 cache rounds them as the reference's ``.to`` does); an
    MLA layer without an indexer passes no key_gate and leaves the raw region alone."""
    kp, dI, lead, bs = 4, 21, 10, 16
    gen = _gen(26)
    row = cache_row_size(lead, dI, kp, block_size=bs)
    cache, table = _paged(SEQ_LENS, row, bs, dtype, 27, lambda r, S: torch.randn(S, row, generator=gen))
    assert page_views(cache, lead, dI, kp).raw.shape[1] == 2  # of a page's four pools
    starts = _batch_meta(Q_LENS)
    slots = []
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        pos = torch.arange(SEQ_LENS[r] - (hi - lo), SEQ_LENS[r])
        slots.append(table[r, pos // bs].long() * bs + pos % bs)
    spec_slots = torch.cat([table[r, p // bs].long() * bs + p % bs  # each request's last 4 rows rewritten
                            for r, p in enumerate(torch.arange(max(S - 4, 0), S) for S in SEQ_LENS[:-1])])
    want, got = cache.clone(), cache.clone()
    for step, slot_mapping in enumerate([torch.cat(slots), spec_slots]):
        if step == 0:
            slot_mapping[[3, starts[6] + 7]] = -1  # padding: a decode and a chunk token
        slot_mapping = slot_mapping.to(torch.int32 if step else torch.int64)
        latent = torch.randn(len(slot_mapping), lead, generator=gen)  # float32 whatever the cache dtype
        key_gate = torch.randn(len(slot_mapping), 2 * dI, generator=gen).to(dtype) if with_keys else None
        mla.write_tokens.implementation("torch")(page_views(want, lead, dI, kp), slot_mapping, latent, key_gate)
        mla.write_tokens.implementation("compiled")(page_views(got, lead, dI, kp), slot_mapping, latent, key_gate)
        assert torch.equal(got, want), f"step {step}"
    assert not torch.equal(want, cache)
    raw = page_views(want, lead, dI, kp).raw
    assert torch.equal(raw, page_views(cache, lead, dI, kp).raw) != with_keys


# Heads: a group of four and two more (score_pools); one vector of heads and two vectors plus a padded third
# (score_pools_heads, from 16 heads on; bfloat16 on AMX tiles: score_pools_tiles, else on bfloat16 dot products
# where the CPU has them, and in the emulated avx512 build: score_pools_pairs). Keys of 16 channels (the tiles
# pad them to 32) and of 64 (two tile rows) in pages of 2 pools, and of 64 in pages of 16 pools, where the tiles
# read 16 pools straight from the page (dI = 16 and 64 keep the scale dI**-0.5 a power of two: the integer-valued
# scores stay exact).
@pytest.mark.parametrize("dI,bs", [(16, 8), (64, 8), (64, 64)])
@pytest.mark.parametrize("nI", [6, 16, 40])
@pytest.mark.parametrize("integer_valued", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_batch_identical_to_torch(integer_valued, dtype, nI, dI, bs, bf16_products):
    """Integer-valued keys, queries and weights with uniform gates make every score exact in both paths (the
    pooled keys are means of small integers), so ties are everywhere and must break identically; random values
    check the general case."""
    topk, kp, lead = 16, 4, 10
    gen = _gen(22)
    row = cache_row_size(lead, dI, kp, block_size=bs)
    cache, table = _paged(SEQ_LENS, row, bs, dtype, 23, lambda r, S: torch.zeros(S, row))
    prompts = _prompt_plan(SEQ_LENS, table, bs)
    if integer_valued:
        key = torch.randint(-2, 3, (prompts.num_tokens, dI), generator=gen).float()
        gate = torch.zeros(prompts.num_tokens, dI)  # uniform pooling: means of small integers, exact
    else:
        key = torch.randn(prompts.num_tokens, dI, generator=gen)
        gate = torch.randn(prompts.num_tokens, dI, generator=gen)
    key_gate = torch.cat([key, gate], 1).to(dtype)
    T = sum(Q_LENS)
    if integer_valued:
        q = torch.randint(-2, 3, (T, nI, dI), generator=gen).float()
        w = torch.randint(-2, 3, (T, nI), generator=gen).float()
        ape = torch.zeros(kp, dI)
    else:
        q, w, ape = torch.randn(T, nI, dI, generator=gen), torch.randn(T, nI, generator=gen), torch.randn(kp, dI)
    q = q.to(dtype)
    starts = _batch_meta(Q_LENS)
    plan = _latent_plan(Q_LENS, SEQ_LENS, table)
    pages = page_views(cache, lead, dI, kp)
    ix.store_pooled_keys.implementation("torch")(pages, prompts, key_gate, ape)
    mla.write_tokens.implementation("torch")(pages, prompts.slot_mapping, torch.zeros(prompts.num_tokens, lead),
                                             key_gate)
    args = (q, w, pages.pooled, plan, topk, kp)
    want = ix.select_batch.implementation("torch")(*args)
    got = ix.select_batch.implementation("compiled")(*args)
    assert torch.equal(got, want)
    # and sparse selection really happened on the long requests
    assert (got[starts[5]] >= 0).sum() < SEQ_LENS[5]
    # the kernel reads the plan's index tensors where they lie: int64 and int32 alike, the block table strided; and
    # queries whose channels are not adjacent
    strided = torch.stack([plan.block_table.long(), torch.full_like(plan.block_table.long(), -7)], 2)[:, :, 0]
    other = dataclasses.replace(plan, block_table=strided, cu_seqlens=plan.cu_seqlens.int(),
                                seq_lens=plan.seq_lens.int())
    q_strided = torch.stack([q, torch.zeros_like(q)], 3)[..., 0]
    assert torch.equal(ix.select_batch.implementation("compiled")(q_strided, w, pages.pooled, other, topk, kp), want)
    # a malformed plan is a clear error (the checks sparse_latent_attention shares: csrc/common.h query_starts)
    descending = plan.cu_seqlens.clone()
    descending[1] = descending[2] + 1
    with pytest.raises(RuntimeError, match="ascend"):
        ix.select_batch.implementation("compiled")(q, w, pages.pooled,
                                                   dataclasses.replace(plan, cu_seqlens=descending), topk, kp)
    with pytest.raises(RuntimeError, match="block-table rows"):
        ix.select_batch.implementation("compiled")(q, w, pages.pooled,
                                                   dataclasses.replace(plan, block_table=plan.block_table[:-1]), topk, kp)


# ---------------------------------------------------------------------------------------------------------
# sparse latent attention
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,L", [(3, 40), (4, 512), (21, 40)])  # 21: on the lanes (score_lanes), odd
def test_sparse_attention_paged_matches_torch(dtype, H, L):
    gen = _gen(30)
    N, row = 19, L + 9
    pages, table = _paged(SEQ_LENS, row, 16, dtype, 31, lambda r, S: torch.randn(S, row, generator=gen))
    T = sum(Q_LENS)
    starts = _batch_meta(Q_LENS)
    q = torch.randn(T, H, L, generator=gen).to(dtype)
    idx = torch.full((T, N), -1, dtype=torch.int64)
    for r, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        S = SEQ_LENS[r]
        for t in range(lo, hi):
            pos = S - (hi - lo) + (t - lo)
            picks = torch.randperm(pos + 1, generator=gen)[:N]  # distinct, any order, some rows short
            idx[t, : len(picks)] = picks
    idx[starts[6] + 3] = -1  # a query with nothing selected gets zeros
    scale = 0.0625
    args = (q, pages, _latent_plan(Q_LENS, SEQ_LENS, table), idx, scale, L)
    got = mla.sparse_latent_attention_paged.implementation("compiled")(*args)
    want = mla.sparse_latent_attention_paged.implementation("torch")(*args)
    assert got.dtype == dtype
    # measured (ulps of max|reference|, avx2 / portable): 4.3 / 4.8; bfloat16 at most 0.5
    _close(got, want, ulps=20)
    assert torch.equal(got[starts[6] + 3], torch.zeros_like(got[0]))
    # the kernel reads the plan's index tensors and the selection where they lie, int32 and int64 alike, strided,
    # and queries whose heads are not adjacent: the same values
    plan, run = args[2], mla.sparse_latent_attention_paged.implementation("compiled")
    table32 = torch.stack([plan.block_table.int(), torch.full_like(plan.block_table.int(), -7)], 2)[:, :, 0]
    other = dataclasses.replace(plan, block_table=table32, cu_seqlens=plan.cu_seqlens.int())
    idx_strided = torch.stack([idx.int(), torch.full_like(idx.int(), 5)], 2)[:, :, 0]
    q_strided = torch.stack([q, torch.full_like(q, 3.0)], 2)[:, :, 0]
    assert torch.equal(run(q_strided, pages, other, idx_strided, scale, L), got)
    with pytest.raises(RuntimeError, match="block-table rows"):
        run(q, pages, dataclasses.replace(plan, block_table=plan.block_table[:-1]), idx, scale, L)
    descending = plan.cu_seqlens.clone()
    descending[1] = descending[2] + 1
    with pytest.raises(RuntimeError, match="ascend"):
        run(q, pages, dataclasses.replace(plan, cu_seqlens=descending), idx, scale, L)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        run(q.double(), pages, plan, idx, scale, L)


# From 16 heads on, bfloat16 queries and cache multiply on AMX tiles (csrc/sparse_mla.cpp attend_tiles) where the
# kernels use them, else on bfloat16 dot products in the tiles' form (attend_pairs) where the CPU has them (and in the
# emulated avx512 build), else on the float32 path, which scores them with the heads on the lanes (score_lanes), as it
# does float32 queries and cache on every build. One vector of 16 heads, two and a half (40: padded to a pair of
# pairs on the products; on the float32 path a score pass of two vectors and one of one with AVX-512, and an update
# pass of fewer heads than the others on every build) and the release's 64; latents of 72 (padded to the tiles' 32s:
# six vectors of 16, the dot products' update in a pass of four and one of two; on the float32 path lane groups and a
# part of one), 64 and 512. The rows' scores rise along the selection for half the heads and fall for the others (a
# component along u grows with the position), so the running maximum moves between the kernels' blocks (256 rows on
# the products, 16 on the float32 path): a request reads 700 rows in order (two whole blocks and a short one of the
# products'), 257 (one more than a block) and 33 shuffled, and one reads nothing (zeros).
MANY_HEADS = [(16, 512), (40, 72), (64, 64)]


@pytest.mark.parametrize("H,L", MANY_HEADS)
def test_sparse_attention_bf16_many_heads_matches_torch(H, L, bf16_products):
    # measured (ulps of max|reference|): AMX tiles 0.51-0.55, dot products 0.30-0.57 (each weight rounded to bfloat16),
    # float32 path <= 0.13
    _check_long_selections(H, L, torch.bfloat16, ulps=1)


@pytest.mark.parametrize("H,L", MANY_HEADS)
def test_sparse_attention_float32_many_heads_matches_torch(H, L):
    # measured: 4.4-33 ulps (the heads on the lanes sum each score in one chain over the latent: 512 terms at H = 16;
    # 33 for the 700 rows alone in eight parts)
    _check_long_selections(H, L, torch.float32, ulps=40)


# Few heads (the kernel-friendly checkpoint's 4) over the same selections: the float32 path's few-heads form, either
# dtype.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_few_heads_long_selections_match_torch(dtype):
    # measured (ulps of max|reference|, every build): float32 4.7-4.9, bfloat16 0
    _check_long_selections(4, 96, dtype, ulps=12 if dtype == torch.float32 else 1)


def _check_long_selections(H, L, dtype, ulps):
    gen = _gen(33 + H)
    seq_lens, q_lens, row = [700, 300, 40], [2, 1, 1], L + 8
    u = torch.randn(L, generator=gen)
    u = torch.cat([u / u.norm(), torch.zeros(8)])
    pages, table = _paged(seq_lens, row, 64, dtype, 34 + H, lambda r, S: 0.5 * torch.randn(
        S, row, generator=gen) + 4 * (torch.arange(S) / S)[:, None] * u)
    sign = torch.tensor([1.0, -1.0]).repeat(H // 2 + 1)[:H, None]
    q = (torch.randn(4, H, L, generator=gen) + 3 * sign * u[:L]).to(dtype)
    idx = torch.full((4, 700), -1, dtype=torch.int64)
    idx[0] = torch.arange(700)
    idx[1, :257] = torch.randperm(700, generator=gen)[:257].sort().values
    idx[2, :33] = torch.randperm(300, generator=gen)[:33]
    args = (q, pages, _latent_plan(q_lens, seq_lens, table), idx, 0.5, L)
    got = mla.sparse_latent_attention_paged.implementation("compiled")(*args)
    want = mla.sparse_latent_attention_paged.implementation("torch")(*args)
    assert got.dtype == dtype
    _close(got, want, ulps=ulps)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # one query alone: its rows are split into parts between the threads, merged after (parts of at least 256 rows
    # on the tiles and dot products, 32 on the float32 path): the 700 rows in two parts on two threads, in eight (two
    # on the products) on eight; 33 rows selected in a row of 700 in eight parts of 5 (the last empty) on the float32
    # path; 33 in a row of 33 whole (the batch's values); nothing selected on eight threads (zeros)
    run, threads = mla.sparse_latent_attention_paged.implementation("compiled"), torch.get_num_threads()

    def alone(t, r, n):  # token t (of request r) alone, its first n selection columns
        return run(q[t : t + 1], pages, _latent_plan([1], seq_lens[r : r + 1], table[r : r + 1]), idx[t : t + 1, :n],
                   0.5, L)

    try:
        for n_threads in (2, 8):
            torch.set_num_threads(n_threads)
            _close(alone(0, 0, 700), want[:1], ulps=ulps)
            _close(alone(2, 1, 700), want[2:3], ulps=ulps)
        assert torch.equal(alone(2, 1, 33), got[2:3])
        assert torch.equal(alone(3, 2, 700), torch.zeros_like(got[3:4]))
    finally:
        torch.set_num_threads(threads)


def test_sparse_attention_one_sequence_matches_torch():
    """The per-sequence entry point (a column slice of cache rows as the latent), dense and gathered."""
    gen = _gen(32)
    S, L, H, Tq = 50, 64, 2, 6
    rows = torch.randn(S, L + 8, generator=gen)
    latent = rows[:, :L]
    q = torch.randn(Tq, H, L, generator=gen)
    for N in (S, 11):
        idx = torch.stack([torch.randperm(S, generator=gen)[:N] for _ in range(Tq)])
        idx[0, N // 2 :] = -1
        # measured (ulps of max|reference|, avx2 / portable): 2.8 / 2.8
        want = mla.sparse_latent_attention_torch(q, latent, idx, 0.1)
        _close(mla.sparse_latent_attention(q, latent, idx, 0.1), want, ulps=12)


# The absorbed MLA's per-head products on AMX tiles (csrc/sparse_mla.cpp head_products): one token (decode), one
# whole group of 16, a partial second group (17) and a third (40); 2 heads of 64 -> 96 and 4 of the kernel-friendly
# checkpoint's 256 -> 512; the tokens strided as the layer's view of q_b_proj's output is.
@pytest.mark.parametrize("T", [1, 16, 17, 40])
@pytest.mark.parametrize("H,dn,L,dv", [(2, 64, 96, 32), (4, 256, 512, 256)])
def test_mla_head_products_on_amx_tiles(T, H, dn, L, dv):
    if not kernels.amx_tiles():
        pytest.skip(f"no AMX tiles in {kernels.description()} (an Intel Xeon from Sapphire Rapids on)")
    gen = _gen(71 + T + H)
    q = torch.randn(T, H * dn + 32, generator=gen).bfloat16()[:, : H * dn].view(T, H, dn)
    o_lat = torch.randn(T, H, L, generator=gen).bfloat16()
    w_uk = (torch.randn(H, dn, L, generator=gen) / dn**0.5).bfloat16()
    w_uv = (torch.randn(H, dv, L, generator=gen) / L**0.5).bfloat16()
    for op, x, w, want in ((mla.absorb_q, q, w_uk, torch.einsum("thk,hkn->thn", q.double(), w_uk.double())),
                           (mla.apply_uv, o_lat, w_uv, torch.einsum("thk,hnk->thn", o_lat.double(), w_uv.double()))):
        assert op.impls[0].check(x, w) is None
        got = op.implementation("compiled")(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # float32 sums of exact products, rounded once: within one bfloat16 rounding of the float64 products, and
        # of the torch form's (bmm) result
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(got, op.implementation("torch")(x, w), rtol=2**-7, atol=1e-6)


def test_mla_head_products_decline_what_the_tiles_cannot_take():
    """float32, and widths off the tiles' 32 inputs / 16 outputs, stay on torch's bmm, saying why (as does every call
    where the kernels have no AMX tiles)."""
    x, w = torch.randn(3, 2, 64), torch.randn(2, 64, 96)
    reasons = [mla.absorb_q.impls[0].check(x, w), mla.absorb_q.impls[0].check(x.bfloat16(), w[:, :48].bfloat16()),
               mla.apply_uv.impls[0].check(x.bfloat16(), w.transpose(1, 2)[:, :40].bfloat16())]
    if not kernels.amx_tiles():
        assert all("AMX" in r for r in reasons)
    else:
        assert "bfloat16" in reasons[0] and "32s" in reasons[1] and "16s" in reasons[2]


# ---------------------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------------------

HC_EPS, NORM_EPS = 1e-6, 1e-5


def _mhc_inputs(T, n, D, dtype, seed, logit_scale=1.0):
    """Streams and block parameters; fn scaled so the mixes ``m`` are about ``logit_scale`` in size (the streams
    are RMS-normalised first)."""
    gen = _gen(seed)
    X = torch.randn(T, n, D, generator=gen).to(dtype)
    fn = torch.randn((2 + n) * n, n * D, generator=gen) * (logit_scale / (n * D) ** 0.5)
    base = torch.randn((2 + n) * n, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    return X, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,D", [(4, 40), (3, 64)])
@pytest.mark.parametrize("T", [5, 16, 23])
def test_mhc_mix_matches_torch(dtype, n, D, T):
    """The coefficient GEMM's input and its product in one call: up to 16 tokens on the kernel's own dot products
    (token groups of 4 or 2 with a partial last one at 5; fn's (2+n)n rows in register tiles of 4 or 2, n = 3's 15
    ending in a partial tile), more on torch's GEMM after the kernel's normalisation."""
    X, fn, *_ = _mhc_inputs(T, n, D, dtype, seed=40 + T)
    want = mhc.mhc_rms_norm_torch(X, NORM_EPS) @ fn.t()
    # measured (ulps of max|reference|, avx2 / portable): 4.6 / 4.3 (avx512 4.6)
    _close(ops.mhc_mix(X, fn, NORM_EPS), want, ulps=8)
    padded = torch.randn(T, n, D + 7, generator=_gen(41)).to(dtype)[..., 3 : 3 + D]  # strided streams
    want = mhc.mhc_rms_norm_torch(padded, NORM_EPS) @ fn.t()
    # measured (ulps of max|reference|, avx2 / portable): 3.7 / 3.7
    _close(ops.mhc_mix(padded, fn, NORM_EPS), want, ulps=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [7, 40, 512])
def test_rms_norm_matches_torch(dtype, D):
    """The layers' RMSNorm: random rows (a batch, a column slice of wider rows, a 3-D tensor like the vision
    tower's per-head norms) agree to the rounding of the statistic; rows of small integers, whose sums of squares
    are exact in any order, give the reference's values bit for bit, the 16-bit roundings of the normalised value
    and of the weighted product included."""
    gen = _gen(45)
    weight = (torch.randn(D, generator=gen) + 1).to(dtype)
    batch = (torch.randn(9, D, generator=gen) * 3).to(dtype)
    wide = torch.randn(9, D + 5, generator=gen).to(dtype)[:, 2 : 2 + D]
    heads = torch.randn(3, 4, D, generator=gen).to(dtype)
    for x in (batch, wide, heads):
        got, want = ops.rms_norm(x, weight, NORM_EPS), norm.rms_norm_torch(x, weight, NORM_EPS)
        assert got.shape == want.shape and got.dtype == want.dtype
        # measured (ulps of max|reference|, avx2 / portable): float32 1.2 / 1.2, 16-bit 0 / 0
        _close(got, want, ulps=4)
    exact = torch.randint(-3, 4, (9, D), generator=gen).to(dtype)
    exact[4] = 0  # a zero row: 1 / sqrt(eps) times zeros
    assert torch.equal(ops.rms_norm(exact, weight, NORM_EPS), norm.rms_norm_torch(exact, weight, NORM_EPS))


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("logit_scale", [1.0, 300.0])
def test_mhc_coefficients_match_torch(T, n, iters, logit_scale):
    """The fused sigmoid / softmax / Sinkhorn steps from the same GEMM output; n = 4 runs the kernel's unrolled
    instantiation, n = 2 its generic one. At ``logit_scale`` 300 the softmax saturates (exp underflows to 0)
    and Sinkhorn works on entries of size hc_eps."""
    X, fn, base, scale = _mhc_inputs(T, n, 24, torch.float32, seed=T * n + iters, logit_scale=logit_scale)
    m = mhc.mhc_rms_norm_torch(X, NORM_EPS) @ fn.t()
    got = ops.mhc_coefficients(m, base, scale, n, HC_EPS, iters)
    want = mhc.mhc_coefficients_from_mix_torch(m, base, scale, n, HC_EPS, iters)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        # measured (ulps of max|reference|, avx2 / portable): 1.9 / 1.9
        _close(g, w, ulps=8)
    if logit_scale > 1:
        logits = m[:, 2 * n :].view(T, n, n) * scale[2] + base[2 * n :].view(n, n)
        assert (torch.softmax(logits, dim=-1) == 0).any()
    else:  # columns sum to 1 (a column of saturated entries only, all of size eps, sums to less)
        # Maths, not rounding: each column sums to s / (s + hc_eps), s its sum before the last normalisation
        # (measured: at most 9.5e-6 below 1 on every path).
        torch.testing.assert_close(got[2].sum(dim=-2), torch.ones(T, n), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 17])
def test_mhc_coefficients_end_to_end_match_torch(dtype, T):
    """The backend entry point: the compiled mix (norm and GEMM) and coefficients, against the torch form."""
    n = 4
    X, fn, base, scale = _mhc_inputs(T, n, 40, dtype, seed=42 + T)
    got = mhc.mhc_coefficients(X, fn, base, scale, n, HC_EPS, 20, NORM_EPS)
    want = mhc.mhc_coefficients_torch(X, fn, base, scale, n, HC_EPS, 20, NORM_EPS)
    for g, w in zip(got, want):
        # measured (ulps of max|reference|, avx2 / portable): 1.6 / 1.6
        _close(g, w, ulps=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,D", [(4, 40), (2, 70)])
def test_mhc_collapse_and_expand_match_torch(dtype, n, D):
    T = 6
    gen = _gen(43)
    X = torch.randn(T, n, D + 5, generator=gen).to(dtype)[..., 2 : 2 + D]  # strided streams, lane tail
    y = torch.randn(T, D, generator=gen).to(dtype)
    pre = torch.rand(T, n, generator=gen) + 1e-6
    post = 2 * torch.rand(T, n, generator=gen)
    comb = torch.softmax(torch.randn(T, n, n, generator=gen), dim=-2)
    u = mhc.mhc_collapse(X, pre)
    assert u.dtype == dtype and u.shape == (T, D)
    # measured (ulps of max|reference|, avx2 / portable): 0 / 0: same order as torch
    _close(u, mhc.mhc_collapse_torch(X, pre), ulps=1)
    out = mhc.mhc_expand(X, y, post, comb)
    assert out.dtype == dtype and out.shape == (T, n, D)
    # measured (ulps of max|reference|, avx2 / portable): 0.39 / 0.37
    _close(out, mhc.mhc_expand_torch(X, y, post, comb), ulps=2)



# ---------------------------------------------------------------------------------------------------------
# routed experts
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("T,E,k", [(37, 8, 2), (5, 21, 3), (19, 288, 8)])  # 21: a partial vector of scores
def test_route_matches_torch(T, E, k, with_bias, normalise):
    """The router: the same experts in the same order as the torch form (the logits' spread keeps any two choice
    scores far apart against the last bits of exp), the weights within ulps."""
    gen = _gen(40)
    logits = 3 * torch.randn(T, E, generator=gen)
    bias = 0.3 * torch.randn(E, generator=gen) if with_bias else None
    (w, ids), (w_ref, ids_ref) = (moe.route.implementation(impl)(logits, bias, k, 1, 1, normalise, 2.5)
                                  for impl in ("compiled", "torch"))
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == ids.shape == (T, k)
    assert torch.equal(ids, ids_ref)
    # measured (ulps of max|reference|, avx2 / portable): 0.80 / 0
    _close(w, w_ref, ulps=4)


def test_route_ties_go_to_the_lower_expert():
    """Equal choice scores (integer logits, no bias) rank the lower expert id first, also across the k-th place;
    torch's topk leaves the order of ties open, so the reference here is a stable sort."""
    logits = torch.randint(-2, 3, (50, 40), generator=_gen(41)).float()
    w, ids = moe.route.implementation("compiled")(logits, None, 6, 1, 1, True, 2.5)
    want = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids, want)
    s = torch.sigmoid(logits).gather(1, want)
    # measured (ulps of max|reference|, avx2 / portable): 1.10 / 1.10
    _close(w, s / (s.sum(-1, keepdim=True) + 1e-20) * 2.5, ulps=4)


def test_route_declines_group_limited_routing():
    logits = torch.randn(4, 16, generator=_gen(42))
    assert moe.route.impls[0].check(logits, None, 3, 4, 2, True, 1.0) is not None
    assert moe.route.impls[0].check(logits, None, 3, 4, 4, True, 1.0) is None  # all groups kept: a plain top-k
    w, ids = moe.route(logits, None, 3, 4, 2, True, 1.0)
    assert torch.equal(ids, moe.route_torch(logits, None, 3, 4, 2, True, 1.0)[1])


MOE_E, MOE_D, MOE_I = 8, 168, 40  # hidden and intermediate sizes with lane tails; 4 x MOE_I <= MOE_D (kernel_h)
MOE_USED, MOE_HOT = [0, 3, 5, 6], 3  # experts 1, 2, 4, 7 get no token; most tokens pick expert 3 first
SWIGLU_LIMIT = 0.5  # small against gate / up values of about 1: both clamps are active


def _moe_inputs(T, k, dtype, seed):
    """x (a strided view), w13 [E, 2I, D], w2 [E, D, I] in ``dtype``; ids over MOE_USED, distinct per token,
    with MOE_HOT chosen first by all tokens but every fourth; float32 routing weights."""
    gen = _gen(seed)
    x = torch.randn(T, MOE_D + 3, generator=gen).to(dtype)[:, 1 : 1 + MOE_D]
    w13 = (torch.randn(MOE_E, 2 * MOE_I, MOE_D, generator=gen) / MOE_D**0.5).to(dtype)
    w2 = (torch.randn(MOE_E, MOE_D, MOE_I, generator=gen) / MOE_I**0.5).to(dtype)
    keys = torch.rand(T, len(MOE_USED), generator=gen)
    keys[torch.arange(T) % 4 != 3, MOE_USED.index(MOE_HOT)] += 1.0
    ids = torch.tensor(MOE_USED)[keys.topk(k, dim=-1).indices]
    weights = torch.rand(T, k, generator=gen)
    return x, w13, w2, ids, weights


def kernel_h(run, ids, weights, inter, num_experts, hidden):
    """h as an experts kernel hands it to the down product, per (token, choice): ``run(w2)`` runs the kernel on
    the test's inputs with a w2 [E, hidden, inter] float32 of its own (the caller converts it). The probe w2 copies
    expert e's h into columns of its own (a single 1 per row), so each output is weight * h, one float32 product
    (the other choices add zeros), and dividing by the weight gives h back to within 2^-23. Returns [T, k, inter]
    float64."""
    used = ids.unique().tolist()
    assert len(used) * inter <= hidden
    probe = torch.zeros(num_experts, hidden, inter)
    for s, e in enumerate(used):
        probe[e, s * inter + torch.arange(inter), torch.arange(inter)] = 1.0
    out = run(probe).double()
    h = torch.empty(*ids.shape, inter, dtype=torch.float64)
    for t, j in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        s = used.index(int(ids[t, j]))
        h[t, j] = out[t, s * inter : (s + 1) * inter] / weights[t, j].double()
    return h


def check_rounded_h(h_kernel, x, w13, ids, limit, dtype):
    """The kernel's h is rounded to ``dtype`` (csrc/moe.cpp as_h): each value is one of dtype's, the nearest to
    the float64 h but for the float32 error of the gate / up sums (2^-18 of their magnitudes) and of silu (1e-6).
    Returns h_kernel as exact ``dtype`` values (float64)."""
    rounded = h_kernel.float().to(dtype).double()
    assert ((h_kernel - rounded).abs() <= 2.0**-22 * rounded.abs()).all(), "h is not rounded to " + str(dtype)
    inter, eps = w13.shape[1] // 2, 2.0**-18
    for t, j in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        e, xt = int(ids[t, j]), x[t].double()
        g, u = (w13[e].double() @ xt).split(inter)
        mg, mu = (w13[e].double().abs() @ xt.abs()).split(inter)
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        h = F.silu(gc) * uc
        err = 1.1 * uc.abs() * eps * mg + F.silu(gc).abs() * eps * mu + 1e-6 * h.abs()
        nearest = [v.float().to(dtype).double() for v in (h - err, h + err)]
        assert ((rounded[t, j] >= nearest[0]) & (rounded[t, j] <= nearest[1])).all(), (t, j)
    return rounded


def experts_down(h, w2, ids, weights):
    """sum_j weights[t, j] * w2[ids[t, j]] @ h[t, j] in float64: the down products and the weighted sum."""
    out = torch.zeros(ids.shape[0], w2.shape[1], dtype=torch.float64)
    for t, j in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        out[t] += weights[t, j].double() * (w2[int(ids[t, j])].double() @ h[t, j])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2])
# The hot expert gets about 3/4 of the tokens: T = 5, 16 (k = 2): 5 tokens on dot products, 8-16 one token group
# across the lanes; 33 two groups; 400 (k = 2: 355 tokens) two passes of token groups.
@pytest.mark.parametrize("T", [1, 5, 16, 33, 400])
def test_moe_experts_match_torch(T, k, dtype):
    """The kernel accumulates in float32 from the stored values, so it is compared with the torch loop on the
    same values in float32; with 16-bit tokens its h is rounded to their dtype (the loop in bfloat16 rounds
    gate_up, h and y to bfloat16 on the way), so against the float64 experts that round h the same way."""
    x, w13, w2, ids, weights = _moe_inputs(T, k, dtype, seed=T * 10 + k)
    if dtype != torch.float32:  # int32 ids, as some routers give them
        ids = ids.int()
    got = ops.moe_experts(x, w13, w2, ids, weights, SWIGLU_LIMIT)
    assert got.dtype == torch.float32 and got.shape == (T, MOE_D)
    if dtype == torch.float32:
        want = moe.routed_experts_torch(x, w13, w2, ids, weights, SWIGLU_LIMIT)
        # measured (ulps of max|reference|, avx2 / portable / avx512): 3.6 / 4.0 / 3.6
        _close(got, want, ulps=12)
    else:  # the down products and the sum against the kernel's own h, which is checked apart
        h = kernel_h(lambda w2_probe: ops.moe_experts(x, w13, w2_probe.to(dtype), ids, weights, SWIGLU_LIMIT), ids,
                     weights, MOE_I, MOE_E, MOE_D)
        h = check_rounded_h(h, x, w13, ids, SWIGLU_LIMIT, dtype)
        # measured (float32 ulps of max|reference|, avx2 / portable / avx512): bfloat16 1.2 / 1.2 / 1.2, float16
        # 2.2 / 2.7 / 2.2
        _close(got.double(), experts_down(h, w2, ids, weights), ulps=F32_ULPS * 12)
    gate_up = torch.nn.functional.linear(x.float(), w13[MOE_HOT].float())
    assert (gate_up[:, :MOE_I] > SWIGLU_LIMIT).any() and (gate_up[:, MOE_I:].abs() > SWIGLU_LIMIT).any()
    if dtype == torch.bfloat16:  # the model's own dtype path, to bfloat16 rounding of the intermediates
        loop = moe.routed_experts_torch(x, w13, w2, ids.long(), weights, SWIGLU_LIMIT)
        # measured (ulps of max|reference|, avx2 / portable / avx512): 0.87 on all, in bfloat16 ulps
        _close(got.bfloat16(), loop.bfloat16(), ulps=4)


# bfloat16 experts and tokens with a hidden and an intermediate size that are multiples of a tile row's 32 columns,
# so that on a CPU with AMX tiles the kernel takes them from 4 pairs per used expert (csrc/moe.cpp): T = 3 (1-2
# pairs: the dot products), 16 (8), 33 (two token groups for the hot expert), 400 (19 groups).
@pytest.mark.parametrize("T", [3, 16, 33, 400])
def test_bf16_experts_on_amx_tiles(T, bf16_products):
    D, inter = 256, 64  # 4 x inter <= D (kernel_h)
    gen = _gen(61 + T)
    x = torch.randn(T, D, generator=gen).bfloat16()
    w13 = (torch.randn(MOE_E, 2 * inter, D, generator=gen) / D**0.5).bfloat16()
    w2 = (torch.randn(MOE_E, D, inter, generator=gen) / inter**0.5).bfloat16()
    keys = torch.rand(T, len(MOE_USED), generator=gen)
    keys[torch.arange(T) % 4 != 3, MOE_USED.index(MOE_HOT)] += 1.0
    ids = torch.tensor(MOE_USED)[keys.topk(2, dim=-1).indices].int()
    weights = torch.rand(T, 2, generator=gen)
    got = ops.moe_experts(x, w13, w2, ids, weights, SWIGLU_LIMIT)
    h = kernel_h(lambda w2_probe: ops.moe_experts(x, w13, w2_probe.bfloat16(), ids, weights, SWIGLU_LIMIT), ids,
                 weights, inter, MOE_E, D)
    h = check_rounded_h(h, x, w13, ids, SWIGLU_LIMIT, torch.bfloat16)
    # measured (float32 ulps of max|float64 reference|, AMX tiles / the other paths, avx512, avx2, portable alike):
    # 0.83 / 1.8; against the bfloat16 loop 0.67 bfloat16 ulps on all
    _close(got.double(), experts_down(h, w2, ids, weights), ulps=F32_ULPS * 12)
    loop = moe.routed_experts_torch(x, w13, w2, ids.long(), weights, SWIGLU_LIMIT)
    _close(got.bfloat16(), loop.bfloat16(), ulps=4)


def test_moe_experts_float32_tokens_with_bf16_weights():
    x, w13, w2, ids, weights = _moe_inputs(7, 2, torch.bfloat16, seed=51)
    x = torch.randn(x.shape, generator=_gen(52))
    got = ops.moe_experts(x, w13, w2, ids, weights, SWIGLU_LIMIT)
    # measured (ulps of max|reference|, avx2 / portable / avx512): 2.1 / 2.0 / 2.1
    _close(got, moe.routed_experts_torch(x, w13.float(), w2.float(), ids, weights, SWIGLU_LIMIT), ulps=10)


@pytest.mark.parametrize("T", [3, 1100])  # 1,100 tokens x 2 choices: above the kernel's float32 batch threshold
def test_routed_experts_match_transformers_experts(T):
    """The backend entry point (the kernel for the small batch, the torch loop for the large one) against
    transformers' Glm5NextTextExperts with the same weights and routing."""
    hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    assert (T * 2 > moe.kernel_max_pairs(torch.float32) * MOE_E) == (T > 3)
    x, w13, w2, ids, weights = _moe_inputs(T, 2, torch.float32, seed=53)
    x = x.contiguous()
    config = hf.Glm5NextTextConfig(hidden_size=MOE_D, moe_intermediate_size=MOE_I, n_routed_experts=MOE_E,
                                   swiglu_limit=SWIGLU_LIMIT)
    experts = hf.Glm5NextTextExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        want = experts(x, ids, weights)
    # measured (ulps of max|reference|, avx2 / portable / avx512): 2.8 / 2.4 / 2.8
    _close(moe.routed_experts(x, w13, w2, ids, weights, SWIGLU_LIMIT), want, ulps=10)


def test_large_16bit_batches_leave_the_kernel_for_per_expert_gemms(monkeypatch):
    """Above a batch threshold per expert, GEMMs beat the kernel: torch's where the CPU multiplies bfloat16 natively
    (above 6 pairs per expert), the loop over ``linear16`` where it does not (from WIDENED_MIN_PAIRS; torch's
    16-bit GEMMs convert inside there and never win). float32 does not depend on it."""
    bf16 = _moe_inputs(1100, 2, torch.bfloat16, seed=54)  # 275 pairs per expert
    f32 = _moe_inputs(1100, 2, torch.float32, seed=54)
    small = _moe_inputs(3, 2, torch.bfloat16, seed=55)
    for native in (False, True):
        monkeypatch.setattr(linear_ops, "native_16bit", lambda dtype: native)
        assert "per-expert GEMMs are faster" in moe._experts_check(*bf16, SWIGLU_LIMIT)
        assert "per-expert GEMMs are faster" in moe._experts_check(*f32, SWIGLU_LIMIT)
        assert moe._experts_check(*small, SWIGLU_LIMIT) is None
        assert (moe._widened_check(*bf16, SWIGLU_LIMIT) is None) == (not native)
        assert moe._widened_check(*f32, SWIGLU_LIMIT) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_experts_match_the_reference(dtype):
    """The per-expert loop on ``linear16`` (16-bit experts, many tokens, no native 16-bit arithmetic) against the
    torch loop in the same dtype: the same roundings to 16 bits of gate_up, h and y on the way."""
    x, w13, w2, ids, weights = _moe_inputs(600, 2, dtype, seed=57)
    got = moe.routed_experts_widened(x, w13, w2, ids, weights, SWIGLU_LIMIT)
    want = moe.routed_experts_torch(x, w13, w2, ids, weights, SWIGLU_LIMIT)
    assert got.dtype == torch.float32
    # measured (ulps of max|reference|, in 16-bit ulps, avx2 / portable): bfloat16 0 / 0, float16 0.26 / 0.26
    _close(got.to(dtype), want.to(dtype), ulps=4)
