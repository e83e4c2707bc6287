"""CPU ops of GLM-5.3: compiled kernels (csrc/) vs plain torch vs the memory floor.

    .venv/bin/python benchmarks/bench_cpu_ops.py [--threads N] [--repeat 7] [--batch 8] [--max-context 8192]
                                                 [--index-heads 32] [--as-avx2-cpu]

Geometry: the real per-head sizes (KDA heads of 128, latent 512, indexer heads of 128, index_topk 64, pools of 4),
float32 as in the parity tests, 4 KDA / MLA heads as in the kernel-friendly tiny checkpoint (``--heads`` to change),
the release's 32 indexer heads (``--index-heads``: the indexer's arithmetic grows with them, its reads do not; the
indexer table runs a float32 and a bfloat16 cache, whose keys and queries the avx512 kernels multiply on AMX tiles
where the CPU has them). Cache pages of ``--block`` tokens: 512 by default, the token block vLLM gives the released
model's hybrid cache on a TP8 rank (each block's page must cover a KDA state page, which grows with the KDA heads a
rank holds: 128 tokens would take TP32; TP1 gets several thousand). The page size sets how the indexer's reads are
laid out: a page's pooled keys are contiguous (64 KiB per 512-token page in float32, 16 KiB per 128-token page).
``VLLM_GLM53_CPU_ISA=avx2`` (or ``portable``) times another instruction set's kernels. A second sparse-MLA table
takes the release's geometry (64 heads, index_topk 2048, bfloat16 queries and cache, batch 1 and ``--batch``, from
4K context), where the op is bound by its arithmetic, and times the compiled op's float32 path against its AMX tiles.

Every timed call is cold, as in a model step where other layers ran in between: the last-level cache is flushed
first (a write pass over a buffer twice its size), and each call works on a copy of the data (states, cache
pages, weights) that no earlier call touched: the two columns use disjoint copies, as many as calls (within a
memory budget, beyond which copies repeat but the flush still makes them cold), and every sparse-MLA call
selects freshly drawn rows. A row reports the median of ``--repeat`` calls after one untimed warm-up.

Columns:
* ``torch``: plain torch doing the op's work the way a torch implementation would, called as model/ calls the
  ops: ``kda_varlen`` and ``select_batch`` on their ``torch`` implementation (``VLLM_GLM53_CPU_KERNELS=0``), which
  gather what they need by slot / block table, compute and scatter back; for sparse MLA a gather of exactly the
  selected rows through the block table (:func:`sparse_mla_gather_torch`; the backend's torch path copies whole
  sequences first, which would flatter the kernel) and two batched matmuls;
* ``compiled``: the same calls on the kernels of csrc/, which read and write the state pool and the paged
  cache in place and touch only the bytes the op needs;
* ``floor``: the bytes the op must move at this machine's measured bandwidth for that kind of traffic: the KDA
  states are read and written back in place (bandwidth of an in-place ``mul_`` over a large buffer, read +
  written bytes per second); selected latent rows and the indexer's pooled keys (one key per complete pool,
  contiguous within a page) are only read (bandwidth of a large ``sum``). ``x floor`` = compiled time / floor.
  Selected latent rows are scattered over the cache, one 2 KiB row per page at random: for them a second floor,
  ``scattered floor``, uses the rate at which torch's own ``index_select`` fetches random 2 KiB rows from a
  working set of the same size.

Before timing, each compiled op's output is checked against its torch column (a benchmark of a wrong answer
measures nothing).

mHC rows time one block's three steps (coefficients incl. the torch GEMM, collapse, expand) at the real
geometry (n = 4 streams of 4096, bfloat16 streams, 20 Sinkhorn iterations); the streams were just written by the
previous block, so they are not made cold.

Routed-expert rows time one MoE block's experts (the kernel-friendly tiny's 8 experts of 512 x 256, top-2) as
the torch loop and as the compiled kernel called directly (the backend picks the loop above a batch threshold),
each call on its own cold set of weights.

Linear rows time one layer with a bfloat16 weight (4096 x 4096) as vLLM's CPU linear layers run it where the CPU
has no native bfloat16 (torch's bfloat16 ``F.linear``), as a float32 model would (float32 weight, twice the bytes),
through the compiled ``linear16`` the plugin puts there (backends/cpu/linear.py), and as the plugin's model runs it
on this CPU (``testing.loaded_linear``: vLLM's oneDNN GEMM on a packed weight where the CPU multiplies bfloat16
natively, ``linear16`` where it does not).

``--as-avx2-cpu`` runs everything as an AVX2-only CPU would (benchmarks/avx2_only.py: the plugin's ``avx2``
kernels, torch and oneDNN held to AVX2); ``VLLM_GLM53_CPU_ISA=avx2`` alone swaps only the plugin's kernels.

The machine may be shared: other processes on the same cores stretch single calls (the median absorbs a few).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import avx2_only  # this directory's

# torch reads these when it first picks a kernel / builds a oneDNN primitive, so before the import
if avx2_only.FLAG in sys.argv:
    avx2_only.apply()

import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

import torch  # noqa: E402

import caches  # noqa: E402
from vllm_glm53.backends.cpu import indexer as ix  # noqa: E402
from vllm_glm53.backends.cpu import kda, kernels, mhc, moe  # noqa: E402
from vllm_glm53.backends.cpu import linear as lin16  # noqa: E402
from vllm_glm53.backends.cpu import sparse_mla as mla  # noqa: E402
from vllm_glm53.backends.pages import page_views  # noqa: E402
from vllm_glm53.backends.plans import LatentCachePlan, StateSlots  # noqa: E402
from vllm_glm53.config import cache_row_size  # noqa: E402

WORKING_SET = 512 << 20  # bytes of the bandwidth probes: many times a 32 MiB L3
COPY_BUDGET = 1 << 30  # bytes of data copies per benchmark row
_TOUCH = torch.ones(1)


def flush_caches() -> None:
    """Evict the op's data (and everything else) from the caches, then run one trivial torch op: in a model step
    the interpreter and torch's dispatcher run between every two ops and stay cached, while an op's own data and
    code were last used a layer ago."""
    caches.flush()
    _TOUCH.add_(0.0)


def copies_for(bytes_per_copy: int, repeat: int) -> int:
    """Copies for 1 warm-up + ``repeat`` calls on each of the two sides, within COPY_BUDGET."""
    return max(2, min(2 * (repeat + 1), COPY_BUDGET // max(1, bytes_per_copy)))


def median_time(fn, repeat: int, first: int = 0) -> float:
    """Median of ``repeat`` cold calls ``fn(i)``, i = first + 1 ... first + repeat, after an untimed warm-up
    ``fn(first)`` (first-touch, lazy init). Each call picks its own copy of the data by ``i``; the second side of a
    comparison passes ``first = repeat + 1`` so the two never share a copy."""
    fn(first)
    times = []
    for i in range(first + 1, first + 1 + repeat):
        flush_caches()
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scattered_row_rate(row_floats: int, repeat: int) -> float:
    """Rows per second that ``index_select`` gathers from random places of a large float32 table."""
    table = torch.ones(WORKING_SET // (4 * row_floats), row_floats)
    n = 4096
    idx = [torch.randint(0, table.shape[0], (n,)) for _ in range(repeat + 1)]
    return n / median_time(lambda i: table.index_select(0, idx[i]), repeat)


def bandwidths(repeat: int) -> tuple[float, float]:
    """(read, in-place read + write) bytes per second over a buffer far larger than the caches."""
    x = torch.ones(WORKING_SET // 4, dtype=torch.float32)
    read = WORKING_SET / median_time(lambda i: x.sum(), repeat)
    update = 2 * WORKING_SET / median_time(lambda i: x.mul_(1.0), repeat)
    return read, update


def check(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    """The compiled output agrees with the torch one (float32: the kernels' tests allow a few ulps of scale)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    if not err <= tol * max(scale, 1e-30):
        raise SystemExit(f"{what}: compiled and torch outputs differ (max {err:.3g} at scale {scale:.3g})")


def fmt_us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.0f}"


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# --------------------------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------------------------


def bench_kda_decode(H: int, d: int, batches: list[int], bw: float, repeat: int, ops) -> list[str]:
    slot_bytes = H * d * d * 4
    out = [
        f"KDA decode step (H={H}, dk=dv={d}, state float32 {slot_bytes >> 10} KiB/sequence/layer); times in µs",
        "",
        row("batch", "torch", "compiled", "floor", "x floor", "speed-up vs torch"),
        row(*["---"] * 6),
    ]
    for B in batches:
        n_copies = copies_for(B * slot_bytes, repeat)
        pool = torch.randn(n_copies * B, H, d, d) * 0.1
        q, k = kda.l2norm_qk(torch.randn(B, H, d), torch.randn(B, H, d), d)
        v, beta = torch.randn(B, H, d), torch.rand(B, H)
        g = kda.kda_gate(torch.randn(B, H, d), torch.zeros(H), -5.0)

        # A decode step of B sequences on each copy of the states (built outside the timed calls, as a model step
        # builds its plan once for all layers).
        decoding = torch.ones(B, dtype=torch.bool)
        plans = [StateSlots.single_slot(torch.arange(B + 1), torch.arange(B) + copy * B, decoding, B, 1)
                 for copy in range(n_copies)]

        def plan(i):
            return plans[i % n_copies]

        def step(impl):
            return lambda i: kda.kda_varlen.implementation(impl)(q, k, v, g, beta, pool, plan(i))

        t_comp = None
        if ops is not None:
            ref_pool = pool.clone()
            want = kda.kda_varlen.implementation("torch")(q, k, v, g, beta, ref_pool, plan(0))
            check(step("compiled")(0), want, "KDA decode")
            t_comp = median_time(step("compiled"), repeat)
        t_torch = median_time(step("torch"), repeat, first=repeat + 1)
        floor = (2 * B * slot_bytes + B * H * (3 * d + 2 * d + 1) * 4) / bw  # states in place; q k g v in, o out
        out.append(row(B, fmt_us(t_torch), fmt_us(t_comp), fmt_us(floor),
                       f"{t_comp / floor:.2f}" if t_comp else "—", f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
        del pool
    return out


def bench_kda_conv_decode(H: int, d: int, K: int, batches: list[int], bw: float, repeat: int, ops) -> list[str]:
    """The KDA layer's short conv + SiLU for a decode step, on conv windows bound as vLLM binds them: each slot's
    window at the start of its own state page (window, then the slot's recurrent state), in vLLM's default layout
    (tap after tap, ``[K-1, C]``: the model hands the op a transposed view) and in its NIXL layout (channel after
    channel, ``[C, K-1]``)."""
    C, taps = 3 * H * d, K - 1
    page = C * taps + H * d * d  # floats per slot's page
    out = [
        f"KDA short conv + SiLU, decode step ({C} channels: q, k, v of {H} heads of {d}; kernel {K}; float32 "
        f"windows of {C * taps * 4 >> 10} KiB in pages of {page * 4 >> 10} KiB); times in µs",
        "",
        row("batch", "torch", "compiled, tap after tap (vLLM's default)", "compiled, channel after channel",
            "floor", "x floor (tap after tap)", "speed-up vs torch"),
        row(*["---"] * 7),
    ]
    w = torch.randn(C, K) * 0.5
    for B in batches:
        n_copies = max(3, min(3 * (repeat + 1), COPY_BUDGET // (B * page * 4)))
        pages = torch.empty(n_copies * B, page)
        pages[:, : C * taps] = torch.randn(n_copies * B, C * taps)  # the state parts stay untouched
        windows = pages[:, : C * taps]
        by_tap = windows.view(-1, taps, C).transpose(1, 2)  # [N, C, K-1] views of the two layouts
        by_channel = windows.view(-1, C, taps)
        x = torch.randn(B, C)
        decoding = torch.ones(B, dtype=torch.bool)
        plans = [StateSlots.single_slot(torch.arange(B + 1), torch.arange(B) + copy * B, decoding, B, 1)
                 for copy in range(n_copies)]

        def step(impl, pool):
            return lambda i: kda.causal_conv1d_varlen.implementation(impl)(x, w, pool, plans[i % n_copies])

        t_taps = t_chan = None
        if ops is not None:
            for pool, what in ((by_tap, "tap after tap"), (by_channel, "channel after channel")):
                ref_pool = pool.clone()
                want = kda.causal_conv1d_varlen.implementation("torch")(x, w, ref_pool, plans[0])
                check(step("compiled", pool)(0), want, f"KDA conv ({what})")
                if not torch.equal(pool[:B], ref_pool[:B]):
                    raise SystemExit(f"KDA conv ({what}): compiled and torch windows differ")
            t_taps = median_time(step("compiled", by_tap), repeat)
            t_chan = median_time(step("compiled", by_channel), repeat, first=repeat + 1)
        t_torch = median_time(step("torch", by_tap), repeat, first=2 * (repeat + 1))
        floor = (2 * B * C * taps + 2 * B * C) * 4 / bw  # windows in place; x in, y out
        out.append(row(B, fmt_us(t_torch), fmt_us(t_taps), fmt_us(t_chan), fmt_us(floor),
                       f"{t_taps / floor:.2f}" if t_taps else "—", f"{t_torch / t_taps:.1f}x" if t_taps else "—"))
        del pages, windows, by_tap, by_channel
    return out


def bench_kda_prefill(H: int, d: int, lengths: list[int], repeat: int, ops) -> list[str]:
    out = [
        f"KDA prefill, one sequence (H={H}, dk=dv={d}); torch = chunked form (chunk 64), compiled = csrc recurrence",
        "",
        row("tokens", "torch µs", "compiled µs", "compiled tokens/s", "speed-up"),
        row(*["---"] * 5),
    ]
    for T in lengths:
        q, k = kda.l2norm_qk(torch.randn(T, H, d), torch.randn(T, H, d), d)
        v, beta = torch.randn(T, H, d), torch.rand(T, H)
        g = kda.kda_gate(torch.randn(T, H, d), torch.zeros(H), -5.0)
        fresh = StateSlots.single_slot(torch.tensor([0, T]), torch.tensor([0]), torch.tensor([False]), T, T)
        pool = torch.zeros(1, H, d, d)
        t_torch = median_time(lambda i: kda.kda_chunked(q, k, v, g, beta), max(3, repeat // 2))
        t_comp = None
        if ops:
            compiled = kda.kda_varlen.implementation("compiled")
            t_comp = median_time(lambda i: compiled(q, k, v, g, beta, pool, fresh), repeat)
        out.append(row(T, fmt_us(t_torch), fmt_us(t_comp), f"{T / t_comp:,.0f}" if t_comp else "—",
                       f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
    return out


# --------------------------------------------------------------------------------------------------------------
# Sparse MLA and the indexer over a paged cache
# --------------------------------------------------------------------------------------------------------------


class PagedCache:
    """``B`` sequences of ``S`` tokens in shuffled pages of ``block`` tokens laid out as the plugin's latent cache
    (latent 512, then the block's pooled indexer keys of 128, then raw keys and gates: backends/latent_cache.py),
    ``copies`` times over (each copy's block tables point at its own pages). The values are random: the indexer
    reads the pooled-key region as the stored keys."""

    L, dI, nI, topk, kp = 512, 128, 32, 64, 4  # nI: --index-heads
    block = 512  # --block
    ROW = cache_row_size(L, dI, kp)

    def __init__(self, B: int, S: int, copies: int, dtype: torch.dtype = torch.float32, width: int | None = None):
        nb = -(-S // self.block)
        self.copies = copies
        total = copies * B * nb
        self.pages = page_views((torch.randn(total, self.block, self.ROW) * 0.5).to(dtype), self.L, self.dI, self.kp)
        self.tables = torch.randperm(total).view(copies, B, nb).to(torch.int32)
        self.B, self.S = B, S
        self.starts = list(range(B + 1))
        self.seq_lens = [S] * B
        self.width = self.topk + self.kp - 1 if width is None else width
        self.plans = [self._make_plan(copy) for copy in range(copies)]

    @classmethod
    def bytes_per_copy(cls, B: int, S: int, itemsize: int = 4) -> int:
        return B * -(-S // cls.block) * cls.block * cls.ROW * itemsize

    def table(self, i: int) -> torch.Tensor:
        return self.tables[i % self.copies]

    def plan(self, i: int) -> LatentCachePlan:
        """A decode step of the batch on copy ``i % copies`` of the pages (built once per copy: a model step builds
        its plan once for all layers, outside the ops timed here)."""
        return self.plans[i % self.copies]

    def _make_plan(self, copy: int) -> LatentCachePlan:
        cu, seq = torch.tensor(self.starts), torch.tensor(self.seq_lens)
        return LatentCachePlan(cu, seq, seq - 1, self.tables[copy], torch.zeros(self.B, dtype=torch.int64), self.B,
                               self.B, 1, self.S)

    def indices(self, gen) -> torch.Tensor:
        """Distinct random positions per query, as many as the indexer would select."""
        n = min(self.S, self.width)
        idx = torch.full((self.B, self.width), -1, dtype=torch.int64)
        for b in range(self.B):
            idx[b, :n] = torch.randperm(self.S, generator=gen)[:n]
        return idx


def sparse_mla_gather_torch(q: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, idx: torch.Tensor,
                            scale: float, L: int) -> torch.Tensor:
    """Decode sparse MLA in plain torch, one query per request, reading only the selected rows: q [B, H, L],
    idx [B, N] positions (-1 unused) -> [B, H, L]."""
    valid = idx >= 0
    pos = idx.clamp(min=0)
    block = pages.shape[1]
    blk = table.long().gather(1, pos // block)
    rows = pages[blk, pos % block, :L]  # [B, N, L]: the selected rows only
    logits = torch.bmm(q, rows.transpose(1, 2)) * scale  # [B, H, N]
    probs = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.bmm(probs, rows)


def bench_sparse_mla(H: int, B: int, contexts: list[int], bw: float, repeat: int, ops) -> list[str]:
    L = PagedCache.L
    row_rate = scattered_row_rate(L, repeat)
    scale = 256**-0.5
    out = [
        f"Sparse-MLA decode attention (batch {B}, H={H}, latent {L} float32, index width 67 = topk 64 + tail 3); "
        "times in µs",
        f"(scattered 2 KiB rows: {row_rate / 1e6:.1f} M rows/s = {row_rate * L * 4 / 1e9:.1f} GB/s)",
        "",
        row("context", "selected rows", "torch (gather selected)", "compiled", "floor", "scattered floor",
            "x floor / x scattered floor", "speed-up vs torch"),
        row(*["---"] * 8),
    ]
    gen = torch.Generator().manual_seed(0)
    for S in contexts:
        cache = PagedCache(B, S, copies_for(PagedCache.bytes_per_copy(B, S), repeat))
        q = torch.randn(B, H, L)
        idx = [cache.indices(gen) for _ in range(2 * (repeat + 1))]  # fresh rows for every call

        def torch_call(i):
            return sparse_mla_gather_torch(q, cache.pages.latent, cache.table(i), idx[i], scale, L)

        def compiled_call(i):
            return mla.sparse_latent_attention_paged.implementation("compiled")(q, cache.pages.latent, cache.plan(i),
                                                                                idx[i], scale, L)

        t_comp = None
        if ops is not None:
            check(compiled_call(0), torch_call(0), f"sparse MLA, context {S}")
            t_comp = median_time(compiled_call, repeat)
        t_torch = median_time(torch_call, repeat, first=repeat + 1)
        n_sel = int((idx[0][0] >= 0).sum())
        floor = (B * n_sel * L * 4 + 2 * B * H * L * 4) / bw  # rows read; queries in, outputs out
        scattered = B * n_sel / row_rate
        ratio = f"{t_comp / floor:.1f} / {t_comp / scattered:.1f}" if t_comp else "—"
        out.append(row(S, n_sel, fmt_us(t_torch), fmt_us(t_comp), fmt_us(floor), fmt_us(scattered), ratio,
                       f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
        del cache
    return out


def bench_sparse_mla_release(batches: list[int], contexts: list[int], bw: float, repeat: int, ops) -> list[str]:
    """The release's geometry: 64 heads, index_topk 2048 (+ a tail of 3), bfloat16 queries and cache. There every head
    reads the same 2,048 rows, so the op is bound by its arithmetic, not its reads: the compiled op on AMX tiles
    (where the kernels use them) against its path without them (the tiles turned off for those calls: bfloat16 dot
    products where the CPU has them, else the float32 path) and torch."""
    L, H, width = PagedCache.L, 64, 2048 + PagedCache.kp - 1
    tiles = kernels.amx_tiles()
    out = [
        f"Sparse-MLA decode attention at the release's size (H={H}, latent {L}, index width {width}, bfloat16 queries "
        "and cache); times in µs",
        "",
        row("batch", "context", "torch (gather selected, bfloat16)", "compiled, without tiles", "compiled, AMX tiles",
            "floor", "tiles x floor", "tiles vs without", "tiles vs torch"),
        row(*["---"] * 9),
    ]
    gen = torch.Generator().manual_seed(0)
    op = mla.sparse_latent_attention_paged.implementation("compiled") if ops is not None else None
    for B in batches:
        for S in contexts:
            cache = PagedCache(B, S, copies_for(PagedCache.bytes_per_copy(B, S, 2), repeat), torch.bfloat16, width)
            q = torch.randn(B, H, L).bfloat16()
            idx = [cache.indices(gen) for _ in range(3 * (repeat + 1))]
            scale = 256**-0.5

            def torch_call(i):
                return sparse_mla_gather_torch(q, cache.pages.latent, cache.table(i), idx[i], scale, L)

            def compiled_call(i, on_tiles):
                kernels.set_amx_tiles(on_tiles)
                try:
                    return op(q, cache.pages.latent, cache.plan(i), idx[i], scale, L)
                finally:
                    kernels.set_amx_tiles(tiles)

            t_f32 = t_tiles = None
            if op is not None:
                f32 = compiled_call(0, False)
                check(f32, sparse_mla_gather_torch(q.float(), cache.pages.latent.float(), cache.table(0), idx[0],
                                                   scale, L), f"sparse MLA without tiles, batch {B}, context {S}",
                      tol=2**-7)  # its outputs rounded to bfloat16
                t_f32 = median_time(lambda i: compiled_call(i, False), repeat)
                if tiles:  # each weight and output rounded to bfloat16: within a bfloat16 ulp of the scale
                    check(compiled_call(0, True), f32, f"sparse MLA on tiles, batch {B}, context {S}", tol=2**-7)
                    t_tiles = median_time(lambda i: compiled_call(i, True), repeat, first=2 * (repeat + 1))
            t_torch = median_time(torch_call, repeat, first=repeat + 1)
            n_sel = int((idx[0][0] >= 0).sum())
            floor = (B * n_sel * L * 2 + 2 * B * H * L * 2) / bw
            ratios = (f"{t_tiles / floor:.1f}", f"{t_f32 / t_tiles:.2f}x", f"{t_torch / t_tiles:.1f}x") if t_tiles \
                else ("—",) * 3
            out.append(row(B, S, fmt_us(t_torch), fmt_us(t_f32), fmt_us(t_tiles), fmt_us(floor), *ratios))
            del cache
    return out


def bench_indexer(B: int, contexts: list[int], bw: float, repeat: int, ops) -> list[str]:
    """float32 (the parity tests' cache) and bfloat16 (a bfloat16 model's: its keys and queries, which the avx512
    kernels multiply on AMX tiles where the CPU has them) caches."""
    c = PagedCache
    out = [
        f"Indexer decode: pooled-key reads + scores + top-k (batch {B}, {c.nI} heads of {c.dI}, pools of {c.kp}, "
        f"top {c.topk // c.kp} pools); times in µs",
        "",
        row("cache", "context", "torch", "compiled", "floor", "x floor", "speed-up vs torch"),
        row(*["---"] * 7),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.finfo(dtype).bits // 8
        for S in contexts:
            cache = PagedCache(B, S, copies_for(PagedCache.bytes_per_copy(B, S, size), repeat), dtype)
            q, w = torch.randn(B, c.nI, c.dI).to(dtype), torch.randn(B, c.nI)

            def select(impl):
                fn = ix.select_batch.implementation(impl)
                return lambda i: fn(q, w, cache.pages.pooled, cache.plan(i), c.topk, c.kp)

            t_comp = None
            if ops is not None:
                got, want = select("compiled")(0), select("torch")(0)
                if not torch.equal(got, want):
                    raise SystemExit(f"indexer, {dtype}, context {S}: compiled and torch selections differ")
                t_comp = median_time(select("compiled"), repeat)
            t_torch = median_time(select("torch"), repeat, first=repeat + 1)
            floor = B * (S // c.kp) * c.dI * size / bw  # one stored key per complete pool
            ratio, speed_up = (f"{t_comp / floor:.2f}", f"{t_torch / t_comp:.1f}x") if t_comp else ("—", "—")
            out.append(row(str(dtype).removeprefix("torch."), S, fmt_us(t_torch), fmt_us(t_comp), fmt_us(floor),
                           ratio, speed_up))
            del cache
    return out


# --------------------------------------------------------------------------------------------------------------
# mHC
# --------------------------------------------------------------------------------------------------------------


def bench_mhc(D: int, batches: list[int], repeat: int, ops) -> list[str]:
    n, iters, eps, norm_eps = 4, 20, 1e-6, 1e-5
    out = [
        f"mHC block (n={n} streams of {D}, bfloat16 streams, {iters} Sinkhorn iterations); times in µs",
        "",
        row("batch", "coefficients torch", "coefficients compiled", "collapse + expand torch",
            "collapse + expand compiled", "block speed-up"),
        row(*["---"] * 6),
    ]
    fn = torch.randn((2 + n) * n, n * D) / (n * D) ** 0.5
    base, scale = torch.randn((2 + n) * n), torch.rand(3) + 0.5
    for B in batches:
        X, y = torch.randn(B, n, D).bfloat16(), torch.randn(B, D).bfloat16()
        pre, post, comb = mhc.mhc_coefficients_torch(X, fn, base, scale, n, eps, iters, norm_eps)
        t_coef = median_time(lambda i: mhc.mhc_coefficients_torch(X, fn, base, scale, n, eps, iters, norm_eps),
                             repeat)
        t_mix = median_time(lambda i: (mhc.mhc_collapse_torch(X, pre), mhc.mhc_expand_torch(X, y, post, comb)),
                            repeat)
        c_coef = c_mix = None
        if ops is not None:
            got = mhc.mhc_coefficients(X, fn, base, scale, n, eps, iters, norm_eps)
            for g, w, what in zip(got, (pre, post, comb), ("pre", "post", "comb")):
                check(g, w, f"mHC {what}, batch {B}")
            check(mhc.mhc_collapse(X, pre), mhc.mhc_collapse_torch(X, pre), f"mHC collapse, batch {B}", tol=1e-2)
            check(mhc.mhc_expand(X, y, post, comb), mhc.mhc_expand_torch(X, y, post, comb), f"mHC expand, batch {B}",
                  tol=1e-2)
            c_coef = median_time(lambda i: mhc.mhc_coefficients(X, fn, base, scale, n, eps, iters, norm_eps), repeat)
            c_mix = median_time(lambda i: (mhc.mhc_collapse(X, pre), mhc.mhc_expand(X, y, post, comb)), repeat)
        speed = f"{(t_coef + t_mix) / (c_coef + c_mix):.1f}x" if c_coef else "—"
        out.append(row(B, fmt_us(t_coef), fmt_us(c_coef), fmt_us(t_mix), fmt_us(c_mix), speed))
    return out


# --------------------------------------------------------------------------------------------------------------
# Routed experts
# --------------------------------------------------------------------------------------------------------------


def bench_moe(E: int, D: int, inter: int, k: int, batches: list[int], bw: float, repeat: int, ops) -> list[str]:
    limit = 10.0
    out = [
        f"Routed experts ({E} experts, hidden {D}, intermediate {inter}, top-{k}, float32, cold weights); "
        "times in µs; floor = bytes of the experts used / read bandwidth",
        "",
        row("batch", "experts used", "torch loop", "compiled", "floor", "x floor", "speed-up"),
        row(*["---"] * 7),
    ]
    # One weight set per call (each another layer's experts, cold), within the copy budget.
    n_sets = copies_for(3 * E * inter * D * 4, repeat)
    sets = [(torch.randn(E, 2 * inter, D) / D**0.5, torch.randn(E, D, inter) / inter**0.5) for _ in range(n_sets)]
    for T in batches:
        x = torch.randn(T, D)
        ids = torch.randn(T, E).topk(k, dim=-1).indices
        weights = torch.rand(T, k)
        used = ids.unique().numel()

        def call(fn):
            return lambda i: fn(x, *sets[i % n_sets], ids, weights, limit)

        t_comp = None
        if ops is not None:
            check(call(ops.moe_experts)(0), call(moe.routed_experts_torch)(0), f"routed experts, batch {T}")
            t_comp = median_time(call(ops.moe_experts), repeat)
        t_torch = median_time(call(moe.routed_experts_torch), repeat, first=repeat + 1)
        floor = used * 3 * inter * D * 4 / bw
        out.append(row(T, used, fmt_us(t_torch), fmt_us(t_comp), fmt_us(floor),
                       f"{t_comp / floor:.1f}" if t_comp else "—", f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
    return out


def bench_router(configs: list[tuple[int, int]], batches: list[int], repeat: int, ops) -> list[str]:
    out = [
        "MoE router (float32 logits [batch, experts] -> top-k ids and weights: sigmoid, correction bias, top-k, "
        "normalisation, scaling factor), each call on fresh logits; times in µs",
        "",
        row("experts, top-k", "batch", "torch", "compiled", "speed-up"),
        row(*["---"] * 5),
    ]
    for E, k in configs:
        bias = 0.1 * torch.randn(E)
        for T in batches:
            logits = [3 * torch.randn(T, E) for _ in range(2 * (repeat + 1))]

            def call(fn):
                return lambda i: fn(logits[i], bias, k, 1, 1, True, 2.5)

            t_comp = None
            if ops is not None:
                (w, ids), (w_ref, ids_ref) = call(moe.route.implementation("compiled"))(0), call(moe.route_torch)(0)
                if not torch.equal(ids, ids_ref):
                    raise SystemExit(f"router, {E} experts, batch {T}: compiled and torch choose different experts")
                check(w, w_ref, f"router weights, {E} experts, batch {T}")
                t_comp = median_time(call(moe.route.implementation("compiled")), repeat)
            t_torch = median_time(call(moe.route_torch), repeat, first=repeat + 1)
            out.append(row(f"{E}, {k}", T, fmt_us(t_torch), fmt_us(t_comp),
                           f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
    return out


# --------------------------------------------------------------------------------------------------------------
# Linear layers with 16-bit weights
# --------------------------------------------------------------------------------------------------------------


def bench_linear16(N: int, K: int, batches: list[int], bw: float, repeat: int, ops) -> list[str]:
    from vllm_glm53 import testing

    # Disjoint weight copies for the four columns, each a float32 copy beside its bfloat16 one (what a float32
    # model would hold); the model's layers take the first copies' own clones (vLLM's dispatch may repack them).
    n = copies_for(8 * N * K, repeat)
    weights = [torch.randn(N, K).div_(K**0.5).bfloat16() for _ in range(n)]
    weights32 = [w.float() for w in weights]
    with testing.standalone_model_parallel():
        layers = [testing.loaded_linear(w.clone()) for w in weights]
    out = [
        f"Linear layer with a bfloat16 weight [{N}, {K}] and bfloat16 activations, cold weights; times in µs; "
        "floor = the bfloat16 weight's bytes / read bandwidth; the model's layer runs "
        f"{testing.linear_gemm_name(layers[0])} on this CPU",
        "",
        row("batch", "torch bf16 F.linear (vLLM's fallback)", "torch, float32 weight", "the model's layer",
            "compiled linear16", "floor", "linear16 x floor", "linear16 vs F.linear", "vs float32",
            "vs the model's layer"),
        row(*["---"] * 10),
    ]
    F = torch.nn.functional
    for T in batches:
        x = torch.randn(T, K).bfloat16()
        x32 = x.float()
        check(layers[0](x)[0].float(), F.linear(x32, weights32[0]), f"the model's layer, batch {T}", tol=2e-2)
        t_comp = None
        if ops is not None:
            # float32 tokens, so both outputs are the unrounded float32 sums
            check(ops.linear16(x32, weights[0]), lin16.linear16_torch(x32, weights[0]), f"linear16, batch {T}")
            t_comp = median_time(lambda i: ops.linear16(x, weights[i % n]), repeat)
        t_bf16 = median_time(lambda i: F.linear(x, weights[i % n]), repeat, first=repeat + 1)
        t_f32 = median_time(lambda i: F.linear(x32, weights32[i % n]), repeat, first=2 * (repeat + 1))
        t_model = median_time(lambda i: layers[i % n](x), repeat, first=3 * (repeat + 1))
        floor = N * K * 2 / bw

        def vs(t):
            return f"{t / t_comp:.1f}x" if t_comp else "—"

        out.append(row(T, fmt_us(t_bf16), fmt_us(t_f32), fmt_us(t_model), fmt_us(t_comp), fmt_us(floor),
                       f"{t_comp / floor:.1f}" if t_comp else "—", vs(t_bf16), vs(t_f32), vs(t_model)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per cell (their median is reported)")
    parser.add_argument("--heads", type=int, default=4, help="KDA and MLA heads (4: the kernel-friendly tiny)")
    parser.add_argument("--index-heads", type=int, default=32, help="indexer heads (32: the release's)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per MLA / indexer decode step")
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--block", type=int, default=512, help="tokens per cache page (see above)")
    parser.add_argument("--only", choices=["kda", "mla", "indexer", "mhc", "moe", "linear16"], action="append")
    parser.add_argument(avx2_only.FLAG, action="store_true", help=avx2_only.HELP)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    PagedCache.block = args.block
    PagedCache.nI = args.index_heads
    ops = kernels.ops()
    read_bw, update_bw = bandwidths(args.repeat)
    contexts = [c for c in (16, 64, 256, 1024, 4096, 16384, 65536) if c <= args.max_context]
    only = set(args.only or ["kda", "mla", "indexer", "mhc", "moe", "linear16"])

    as_avx2 = avx2_only.describe() if args.as_avx2_cpu else ""
    print(f"# CPU ops{as_avx2}: {kernels.description()}; torch {torch.__version__}, {args.threads} threads, {allocator.describe()}; "
          f"bandwidth: read {read_bw / 1e9:.1f} GB/s, in-place update {update_bw / 1e9:.1f} GB/s (read + write); "
          f"cache pages of {args.block} tokens\n")
    def show(lines: list[str]) -> None:
        print("\n".join(lines), end="\n\n", flush=True)

    if "kda" in only:
        show(bench_kda_decode(args.heads, 128, [1, 16, 64], update_bw, args.repeat, ops))
        show(bench_kda_conv_decode(args.heads, 128, 4, [1, 16, 64], update_bw, args.repeat, ops))
        show(bench_kda_prefill(args.heads, 128, [64, 512, 2048], args.repeat, ops))
    if "mla" in only:
        show(bench_sparse_mla(args.heads, args.batch, contexts, read_bw, args.repeat, ops))
        show(bench_sparse_mla_release([1, args.batch], [c for c in contexts if c >= 4096], read_bw, args.repeat, ops))
    if "indexer" in only:
        show(bench_indexer(args.batch, [c for c in contexts if c >= 256], read_bw, args.repeat, ops))
    if "mhc" in only:
        show(bench_mhc(4096, [1, 16, 64], args.repeat, ops))
    if "moe" in only:
        show(bench_moe(8, 512, 256, 2, [1, 16, 64, 512], read_bw, args.repeat, ops))
        show(bench_router([(8, 2), (288, 8)], [1, 16, 512], args.repeat, ops))
    if "linear16" in only:
        show(bench_linear16(4096, 4096, [1, 4, 16, 64, 512], read_bw, args.repeat, ops))

if __name__ == "__main__":
    main()
