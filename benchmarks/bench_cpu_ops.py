"""CPU ops of GLM-5.3: compiled kernels (csrc/) vs the plain-torch backends vs the memory floor.

    .venv/bin/python benchmarks/bench_cpu_ops.py [--threads N] [--repeat 7] [--batch 8] [--max-context 8192]

Geometry: the real per-head sizes (KDA heads of 128, latent 512, indexer 4 heads of 128, index_topk 64,
pools of 4), float32 as in the parity tests, 4 KDA / MLA heads as in the kernel-friendly tiny checkpoint
(``--heads`` to change). Every op is timed as the best of ``--repeat`` calls after one warm-up (see
:func:`best_time`; run the script a few times and take the median of the runs), each call on a different
region of a working set several times the last-level cache, so state and cache rows come from memory as they
do in a model step (other layers run in between).

Columns:
* ``torch``: the plain-torch backend the way model/ calls it today (KDA: gather the states by slot, step,
  scatter back; MLA: gather the whole sequence from the paged cache, then attend / compress + score + select);
* ``compiled, today's call``: the same call sequence with the compiled ops (what the engine runs now);
* ``compiled, batched``: the slot- and page-addressed batch forms (``kda_decode_step_slots``,
  ``sparse_latent_attention_paged``, ``select_batch``), which touch only the bytes the op needs;
* ``floor``: the bytes the op must move at this machine's measured bandwidth for that kind of traffic: the KDA
  states are read and written back in place (bandwidth of an in-place ``mul_`` over a large buffer, read +
  written bytes per second); selected latent rows and indexer keys + gates are only read (bandwidth of a
  large ``sum``). ``x floor`` = batched time / floor. Selected latent rows are scattered over the cache, one
  2 KiB row per page at random: for them a second floor, ``scattered floor``, uses the rate at which torch's
  own ``index_select`` fetches random 2 KiB rows from a working set of the same size.

The machine may be shared: rerun and compare.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_glm53.backends.cpu import indexer as ix
from vllm_glm53.backends.cpu import kda, kernels
from vllm_glm53.backends.cpu import sparse_mla as mla
from vllm_glm53.backends.cpu.paged import sequence_rows

WORKING_SET = 512 << 20  # bytes per benchmark working set: many times a 32 MiB L3


def best_time(fn, repeat: int) -> float:
    """Fastest of ``repeat`` calls after a warm-up: on a shared machine a slower call measures the neighbours
    (a descheduled OpenMP thread stalls a whole parallel region for a scheduler tick), not the op."""
    fn(-1)  # warm-up (first-touch, lazy init)
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return min(times)


def scattered_row_rate(row_floats: int, repeat: int) -> float:
    """Rows per second that ``index_select`` gathers from random places of a large float32 table."""
    table = torch.ones(WORKING_SET // (4 * row_floats), row_floats)
    n = 4096
    idx = [torch.randint(0, table.shape[0], (n,)) for _ in range(repeat + 1)]
    return n / best_time(lambda i: table.index_select(0, idx[i]), repeat)


def bandwidths(repeat: int) -> tuple[float, float]:
    """(read, in-place read + write) bytes per second over a buffer far larger than the caches."""
    x = torch.ones(WORKING_SET // 4, dtype=torch.float32)
    read = WORKING_SET / best_time(lambda i: x.sum(), repeat)
    update = 2 * WORKING_SET / best_time(lambda i: x.mul_(1.0), repeat)
    return read, update


def fmt_us(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.0f}"


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# --------------------------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------------------------


def bench_kda_decode(H: int, d: int, batches: list[int], bw: float, repeat: int, ops) -> list[str]:
    slot_bytes = H * d * d * 4
    n_slots = max(WORKING_SET // slot_bytes, 2 * max(batches))
    pool = torch.randn(n_slots, H, d, d) * 0.1
    out = [
        f"KDA decode step (H={H}, dk=dv={d}, state float32 {slot_bytes >> 10} KiB/sequence/layer); times in µs",
        "",
        row("batch", "torch", "compiled, today's call", "compiled, batched", "floor", "x floor", "speed-up vs torch"),
        row(*["---"] * 7),
    ]
    for B in batches:
        q, k = kda.l2norm_qk(torch.randn(B, H, d), torch.randn(B, H, d), d)
        v, beta = torch.randn(B, H, d), torch.rand(B, H)
        g = kda.kda_gate(torch.randn(B, H, d), torch.zeros(H), -5.0)
        n_groups = n_slots // B

        def slots(i):
            return torch.arange(B) + (i % n_groups) * B

        def gathered(step):
            def call(i):
                s = slots(i)
                state = pool[s]
                step(q, k, v, g, beta, state)
                pool[s] = state
            return call

        t_torch = best_time(gathered(kda.kda_decode_step_torch), repeat)
        t_today = t_batched = None
        if ops is not None:
            t_today = best_time(gathered(lambda *a: ops.kda_decode_step(*a, None)), repeat)
            t_batched = best_time(lambda i: ops.kda_decode_step(q, k, v, g, beta, pool, slots(i)), repeat)
        floor = (2 * B * slot_bytes + B * H * (3 * d + 2 * d + 1) * 4) / bw  # states in place; q k g v in, o out
        ratio = f"{t_batched / floor:.2f}" if t_batched else "—"
        speed = f"{t_torch / t_batched:.1f}x" if t_batched else "—"
        out.append(row(B, fmt_us(t_torch), fmt_us(t_today), fmt_us(t_batched), fmt_us(floor), ratio, speed))
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
        t_torch = best_time(lambda i: kda.kda_chunked_torch(q, k, v, g, beta), max(3, repeat // 2))
        t_comp = best_time(lambda i: ops.kda_prefill(q, k, v, g, beta, None), repeat) if ops else None
        out.append(row(T, fmt_us(t_torch), fmt_us(t_comp), f"{T / t_comp:,.0f}" if t_comp else "—",
                       f"{t_torch / t_comp:.1f}x" if t_comp else "—"))
    return out


# --------------------------------------------------------------------------------------------------------------
# Sparse MLA and the indexer over a paged cache
# --------------------------------------------------------------------------------------------------------------


class PagedCache:
    """``B`` sequences of ``S`` tokens in shuffled 128-token pages of ``[latent 512 | key 128 | gate 128]`` rows,
    with enough copies of the batch (different pages) to make each call read cold memory."""

    L, dI, nI, topk, kp, block = 512, 128, 4, 64, 4, 128

    def __init__(self, B: int, S: int):
        row = self.L + 2 * self.dI
        nb = -(-S // self.block)
        self.copies = max(1, WORKING_SET // (B * nb * self.block * row * 4))
        total = self.copies * B * nb
        self.pages = torch.randn(total, self.block, row) * 0.5
        self.tables = torch.randperm(total).view(self.copies, B, nb).to(torch.int32)
        self.B, self.S = B, S
        self.starts = list(range(B + 1))
        self.seq_lens = [S] * B
        self.width = self.topk + self.kp - 1

    def table(self, i: int) -> torch.Tensor:
        return self.tables[i % self.copies]

    def indices(self, gen) -> torch.Tensor:
        """Distinct random positions per query, as many as the indexer would select."""
        n = min(self.S, self.width)
        idx = torch.full((self.B, self.width), -1, dtype=torch.int64)
        for b in range(self.B):
            idx[b, :n] = torch.randperm(self.S, generator=gen)[:n]
        return idx


def bench_sparse_mla(H: int, B: int, contexts: list[int], bw: float, repeat: int, ops) -> list[str]:
    L = PagedCache.L
    row_rate = scattered_row_rate(L, repeat)
    scale = 256**-0.5
    out = [
        f"Sparse-MLA decode attention (batch {B}, H={H}, latent {L} float32, index width 67 = topk 64 + tail 3); "
        "times in µs",
        f"(scattered 2 KiB rows: {row_rate / 1e6:.1f} M rows/s = {row_rate * L * 4 / 1e9:.1f} GB/s)",
        "",
        row("context", "selected rows", "torch", "compiled, today's call", "compiled, batched", "floor",
            "scattered floor", "x floor / x scattered floor", "speed-up vs torch"),
        row(*["---"] * 9),
    ]
    gen = torch.Generator().manual_seed(0)
    for S in contexts:
        cache = PagedCache(B, S)
        q = torch.randn(B, H, L)
        idx = cache.indices(gen)

        def per_request(attend):
            def call(i):
                table = cache.table(i)
                for r in range(B):
                    latent = sequence_rows(cache.pages, table[r], S)[:, :L]
                    attend(q[r : r + 1], latent, idx[r : r + 1], scale)
            return call

        t_torch = best_time(per_request(mla.sparse_latent_attention_torch), repeat)
        t_today = t_batched = None
        if ops is not None:
            t_today = best_time(per_request(mla.sparse_latent_attention), repeat)
            t_batched = best_time(
                lambda i: mla.sparse_latent_attention_paged(q, cache.pages, cache.table(i), cache.starts,
                                                            cache.seq_lens, idx, scale, L), repeat)
        n_sel = int((idx[0] >= 0).sum())
        floor = (B * n_sel * L * 4 + 2 * B * H * L * 4) / bw  # rows read; queries in, outputs out
        scattered = B * n_sel / row_rate
        ratio = f"{t_batched / floor:.1f} / {t_batched / scattered:.1f}" if t_batched else "—"
        out.append(row(S, n_sel, fmt_us(t_torch), fmt_us(t_today), fmt_us(t_batched), fmt_us(floor),
                       fmt_us(scattered), ratio, f"{t_torch / t_batched:.1f}x" if t_batched else "—"))
        del cache
    return out


def bench_indexer(B: int, contexts: list[int], bw: float, repeat: int, ops) -> list[str]:
    c = PagedCache
    out = [
        f"Indexer decode: pool compression + scores + top-k (batch {B}, {c.nI} heads of {c.dI}, pools of {c.kp}, "
        f"top {c.topk // c.kp} pools); times in µs",
        "",
        row("context", "torch", "compiled, today's call", "compiled, batched", "floor", "x floor", "speed-up vs torch"),
        row(*["---"] * 7),
    ]
    for S in contexts:
        cache = PagedCache(B, S)
        q, w = torch.randn(B, c.nI, c.dI), torch.randn(B, c.nI)
        ape = torch.randn(c.kp, c.dI)
        positions = torch.tensor([S - 1])
        n_pooled = S // c.kp * c.kp

        def today(i):  # model/mla.py's _select with the per-sequence ops
            table = cache.table(i)
            for r in range(B):
                rows = sequence_rows(cache.pages, table[r], S)[:n_pooled]
                pooled = ix.kpool_compress(rows[:, c.L : c.L + c.dI], rows[:, c.L + c.dI :], ape)
                scores = ix.index_scores(q[r : r + 1], w[r : r + 1], pooled)
                if S % c.kp:
                    scores = torch.nn.functional.pad(scores, (0, 1))
                ix.select_tokens(scores, positions, c.topk, c.kp)

        def batched(select):
            return lambda i: select(q, w, cache.pages, cache.table(i), cache.starts, cache.seq_lens, ape, c.L,
                                    c.topk, c.kp)

        t_torch = best_time(batched(ix.select_batch_torch), repeat)
        t_today = best_time(today, repeat) if ops is not None else None
        t_batched = best_time(batched(ix.select_batch), repeat) if ops is not None else None
        floor = B * n_pooled * 2 * c.dI * 4 / bw
        out.append(row(S, fmt_us(t_torch), fmt_us(t_today), fmt_us(t_batched), fmt_us(floor),
                       f"{t_batched / floor:.2f}" if t_batched else "—",
                       f"{t_torch / t_batched:.1f}x" if t_batched else "—"))
        del cache
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--heads", type=int, default=4, help="KDA and MLA heads (4: the kernel-friendly tiny)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per MLA / indexer decode step")
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--only", choices=["kda", "mla", "indexer"], action="append")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ops = kernels.ops()
    read_bw, update_bw = bandwidths(args.repeat)
    contexts = [c for c in (16, 64, 256, 1024, 4096, 16384, 65536) if c <= args.max_context]
    only = set(args.only or ["kda", "mla", "indexer"])

    print(f"# CPU ops: {kernels.description()}; torch {torch.__version__}, {args.threads} threads; "
          f"bandwidth: read {read_bw / 1e9:.1f} GB/s, in-place update {update_bw / 1e9:.1f} GB/s (read + write)\n")
    def show(lines: list[str]) -> None:
        print("\n".join(lines), end="\n\n", flush=True)

    if "kda" in only:
        show(bench_kda_decode(args.heads, 128, [1, 16, 64], update_bw, args.repeat, ops))
        show(bench_kda_prefill(args.heads, 128, [64, 512, 2048], args.repeat, ops))
    if "mla" in only:
        show(bench_sparse_mla(args.heads, args.batch, contexts, read_bw, args.repeat, ops))
    if "indexer" in only:
        show(bench_indexer(args.batch, [c for c in contexts if c >= 256], read_bw, args.repeat, ops))

if __name__ == "__main__":
    main()
