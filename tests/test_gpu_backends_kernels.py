"""The GPU backends (``vllm_glm53.backends.cuda``: fla-core's KDA, the plugin's Triton indexer and sparse MLA)
against the CPU backend (the oracle), op by op and through the batch flows the layers run, at tiny shapes.

Runs where Triton kernels can run: on a GPU, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)
in the separate environment ``.venv-triton`` (``make setup-triton``), which is how the main suite runs it
(tests/test_gpu_backends_interpreter.py). Anywhere else the module skips.

Test names start with the family they check (``test_kda_``, ``test_indexer_``, ``test_mla_``); the main suite
reports the families separately from those prefixes.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
if not (INTERPRET or ON_GPU):
    pytest.skip(
        "needs a GPU, or TRITON_INTERPRET=1 in .venv-triton (the main suite runs it there through "
        "test_gpu_backends_interpreter.py)",
        allow_module_level=True,
    )
pytest.importorskip("triton")
pytest.importorskip("fla", reason="fla-core is not installed (make setup-triton)")
# The oracle is the CPU backend's plain-torch form (its documented reference), not the compiled CPU kernels.
os.environ.setdefault("VLLM_GLM53_CPU_KERNELS", "0")


def one_autotune_config() -> None:
    """Autotuning benchmarks every config of a kernel; keep only the first. The interpreter needs this (it has
    no GPU driver to benchmark with); on a GPU it is optional (``GLM53_ONE_AUTOTUNE_CONFIG=1``, which
    scripts/gpu_check.py sets) and saves compiling every candidate. Any config computes the same result."""
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]


def tensor_loop_counters() -> None:
    """In the interpreter, counters of ``range`` loops are Python ints, but tensors in compiled kernels, and
    fla-core calls tensor methods on them (``i_t.to(tl.int64)``); rewrite the loops so they are tensors there
    too."""
    import ast

    from triton.runtime import interpreter

    class TensorLoopCounters(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            call = node.iter
            name = None
            if isinstance(call, ast.Call):
                name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            if name == "range" and isinstance(node.target, ast.Name):
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                          attr="to_tensor", ctx=ast.Load())
                convert = ast.Assign(
                    targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                    value=ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                         ast.Constant(value=False)], keywords=[]),
                )
                node.body.insert(0, ast.copy_location(convert, node))
            return node

    interpreter.FunctionRewriter.ast_transformer = TensorLoopCounters()


if INTERPRET:
    one_autotune_config()
    tensor_loop_counters()
elif os.environ.get("GLM53_ONE_AUTOTUNE_CONFIG") == "1":
    one_autotune_config()

from vllm_glm53.backends.cpu import indexer as ix_cpu  # noqa: E402
from vllm_glm53.backends.cpu import kda as kda_cpu  # noqa: E402
from vllm_glm53.backends.cpu import sparse_mla as mla_cpu  # noqa: E402
from vllm_glm53.backends.cuda import indexer as ix_gpu  # noqa: E402
from vllm_glm53.backends.cuda import kda as kda_gpu  # noqa: E402
from vllm_glm53.backends.cuda import sparse_mla as mla_gpu  # noqa: E402
from vllm_glm53.backends.pages import page_views, write_tokens_torch  # noqa: E402
from vllm_glm53.backends.plans import LatentCachePlan, StateSlots  # noqa: E402
from vllm_glm53.config import cache_row_size  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter computes in float32 (numpy): measured largest error 1.5e-6 of the reference's magnitude (the
# chunked KDA output), so 1e-5. On a GPU fla's float32 GEMMs may use TF32 (10-bit mantissa): 1e-2 is that
# format's precision over these reductions, not yet a measured value; GLM53_REPORT_TOL=1 prints every check's
# relative error so a GPU run can measure it.
REL_TOL = 1e-2 if ON_GPU else 1e-5


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Max-abs error relative to the reference's own largest magnitude (no floor: a tensor of small values is
    held to the same relative precision as one of large values; an all-zero reference must be matched exactly)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    if os.environ.get("GLM53_REPORT_TOL"):
        print(f"TOL {what}: {err / scale if scale else err:.3g}")
    assert err <= REL_TOL * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def on(*tensors):
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors)


def check_same_api(cpu_mod, gpu_mod) -> None:
    """Every public function of the CPU module exists in the GPU module, taking the same leading parameters
    (names, order, defaults): a layer written against one runs on the other."""
    for name in cpu_mod.__all__:
        assert name in gpu_mod.__all__, f"{gpu_mod.__name__} lacks {name}"
        want = list(inspect.signature(getattr(cpu_mod, name)).parameters.values())
        have = list(inspect.signature(getattr(gpu_mod, name)).parameters.values())[: len(want)]
        assert [(p.name, p.default) for p in have] == [(p.name, p.default) for p in want], name


# ==============================================================================================================
# KDA
# ==============================================================================================================

H, D, KW = 2, 16, 4  # KDA heads, head dim, conv kernel
C = 3 * H * D  # conv channels (q | k | v)


def test_kda_signatures():
    check_same_api(kda_cpu, kda_gpu)


@pytest.mark.parametrize("case", ["fresh", "with_state", "short_chunk"])
def test_kda_conv_prefill(case):
    g = gen(1)
    T = 2 if case == "short_chunk" else 37  # a chunk shorter than K-1 keeps older history in the state
    x, w = randn(T, C, g=g), randn(C, KW, g=g, scale=0.5)
    state = None if case == "fresh" else randn(C, KW - 1, g=g)
    y_ref, s_ref = kda_cpu.causal_conv1d(x, w, state)
    y, s = kda_gpu.causal_conv1d(*on(x, w, state))
    close(y, y_ref, "conv output")
    close(s, s_ref, "conv state")


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "unbounded"])
def test_kda_gate(lower_bound):
    g = gen(3)
    a, A_log = randn(11, H, D, g=g, scale=3.0), randn(H, g=g)
    close(kda_gpu.kda_gate(*on(a, A_log), lower_bound), kda_cpu.kda_gate(a, A_log, lower_bound), "gate")


def test_kda_gated_rmsnorm():
    g = gen(4)
    o, gate, w = randn(9, H, D, g=g), randn(9, H, D, g=g), 1 + randn(D, g=g, scale=0.2)
    want = kda_cpu.gated_rmsnorm(o, gate, w, 1e-5)
    close(kda_gpu.gated_rmsnorm(*on(o, gate, w), 1e-5), want, "gated rmsnorm")


def delta_inputs(T: int, seed: int):
    """Normalised q, k (scale folded in), v, bounded gates at the real lower bound (strong decay), beta."""
    g = gen(seed)
    q, k = kda_cpu.l2norm_qk(randn(T, H, D, g=g), randn(T, H, D, g=g), D)
    v = randn(T, H, D, g=g)
    decay = kda_cpu.kda_gate(randn(T, H, D, g=g, scale=3.0), randn(H, g=g), -5.0)
    beta = torch.rand(T, H, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("init", [False, True], ids=["fresh", "initial_state"])
def test_kda_chunked_prefill(init):
    q, k, v, decay, beta = delta_inputs(70, seed=5)  # two chunks of 64, the second partial
    s0 = randn(H, D, D, g=gen(6)) if init else None
    o_ref, s_ref = kda_cpu.kda_chunked(q, k, v, decay, beta, s0)
    o_rec, s_rec = kda_cpu.kda_recurrent(q, k, v, decay, beta, s0)
    close(o_ref, o_rec, "oracle chunked vs recurrent")  # the two oracle forms agree, so either may be used
    o, s = kda_gpu.kda_chunked(*on(q, k, v, decay, beta, s0))
    close(o, o_ref, "chunked output")
    close(s, s_ref, "chunked final state")
    if s0 is not None:
        s0_dev = s0.to(DEVICE)
        kda_gpu.kda_chunked(*on(q, k, v, decay, beta), s0_dev)
        close(s0_dev, s0, "initial state left untouched")


def test_kda_recurrent():
    q, k, v, decay, beta = delta_inputs(23, seed=7)
    s0 = randn(H, D, D, g=gen(8))
    o_ref, s_ref = kda_cpu.kda_recurrent(q, k, v, decay, beta, s0)
    o, s = kda_gpu.kda_recurrent(*on(q, k, v, decay, beta, s0))
    close(o, o_ref, "recurrent output")
    close(s, s_ref, "recurrent final state")


def step_plan(kind: str) -> StateSlots:
    """``decode``: four single tokens, one a fresh one-token prompt, then a padding row; ``speculative``: two
    requests verifying two drafts each, resuming from draft column 1 and 0; ``mixed``: a decode, a prefill chunk
    continuing a state, a fresh prompt longer than a chunk, a short fresh prompt."""
    if kind == "decode":
        return StateSlots.single_slot(torch.tensor([0, 1, 2, 3, 4, 4]), torch.tensor([4, 1, 5, 0, 2]),
                                      torch.tensor([True, True, False, True, True]), 4, 1)
    if kind == "speculative":
        return StateSlots.speculative(torch.tensor([0, 3, 6]), torch.tensor([[6, 2, 3], [0, 4, 5]]),
                                      torch.tensor([2, 1]), 6, 3)
    return StateSlots.single_slot(torch.tensor([0, 1, 11, 81, 84]), torch.tensor([3, 0, 5, 1]),
                                  torch.tensor([True, True, False, False]), 84, 70)


# The implementation each kind of step should take on the GPU (the others decline it).
FAST_KDA = {"decode": "fla_recurrent", "speculative": "fla_speculative", "mixed": "fla"}
FAST_CONV = {"decode": "triton", "speculative": "fla", "mixed": "fla"}


@pytest.mark.parametrize("kind", ["decode", "speculative", "mixed"])
def test_kda_conv_varlen_in_strided_pool(kind):
    """The batch conv on a pool view with padded strides: outputs and every slot agree with the CPU reference;
    the step takes the implementation meant for it."""
    plan = step_plan(kind)
    g = gen(16)
    x, w = randn(plan.num_tokens, C, g=g), randn(C, KW, g=g, scale=0.5)
    buffer = randn(7, C + 5, KW, g=g)

    def pool(buf):  # [7, C, K-1] inside a larger buffer
        return buf[:, 2 : 2 + C, 1:]

    want = pool(buffer.clone())
    y_ref = kda_cpu.causal_conv1d_varlen.implementation("torch")(x, w, want, plan)
    got = pool(buffer.clone().to(DEVICE))
    y = kda_gpu.causal_conv1d_varlen.implementation(FAST_CONV[kind])(*on(x, w), got, plan.to(DEVICE))
    close(y, y_ref, "conv output")
    close(got, want, "conv pool")
    got = pool(buffer.clone().to(DEVICE))
    close(kda_gpu.causal_conv1d_varlen(*on(x, w), got, plan.to(DEVICE)), y_ref, "conv output (dispatched)")


@pytest.mark.parametrize("kind", ["decode", "speculative", "mixed"])
@pytest.mark.parametrize("layout", ["padded_slots", "head_strided"])
def test_kda_varlen_on_pool(kind, layout):
    """The batch delta rule on a state pool: outputs and every slot agree with the CPU reference, untouched
    slots stay as they were. ``padded_slots``: slot stride larger than a state (as vLLM's hybrid pages make
    it), run by the implementation meant for the step; ``head_strided``: states not contiguous inside a slot,
    which fla's in-place modes decline (the per-request form takes it)."""
    plan = step_plan(kind)
    q, k, v, decay, beta = delta_inputs(plan.num_tokens, seed=11)
    if layout == "padded_slots":
        buffer = randn(7, H + 1, D, D, g=gen(12))

        def pool(buf):
            return buf[:, :H]
    else:
        buffer = randn(7, D, H, D, g=gen(12))

        def pool(buf):
            return buf.transpose(1, 2)

    want = pool(buffer.clone())
    o_ref = kda_cpu.kda_varlen.implementation("torch")(q, k, v, decay, beta, want, plan)
    got = pool(buffer.clone().to(DEVICE))
    op = kda_gpu.kda_varlen.implementation(FAST_KDA[kind]) if layout == "padded_slots" else kda_gpu.kda_varlen
    o = op(*on(q, k, v, decay, beta), got, plan.to(DEVICE))
    close(o, o_ref, "output")
    close(got, want, "state pool")


# ==============================================================================================================
# Lightning indexer
# ==============================================================================================================

KP, TOPK, NI = 4, 8, 4  # pool size, index_topk, indexer heads (the tiny config's)


def test_indexer_signatures():
    check_same_api(ix_cpu, ix_gpu)


def cache_rows(S: int, L: int, dI: int, seed: int) -> torch.Tensor:
    """Cache rows ``[c_kv (L) | indexer key (dI) | pooling gate (dI)]`` as the latent cache stores them."""
    g = gen(seed)
    return torch.cat([randn(S, L, g=g), randn(S, dI, g=g), randn(S, dI, g=g, scale=2.0)], dim=1)


@pytest.mark.parametrize("dI", [16, 24])
def test_indexer_kpool_compress_from_cache_rows(dI):
    L, S = 32, 44
    rows = cache_rows(S, L, dI, seed=20)
    ape = randn(KP, dI, g=gen(21))
    want = ix_cpu.kpool_compress(rows[:, L : L + dI], rows[:, L + dI :], ape)
    rows_dev, ape_dev = on(rows, ape)
    got = ix_gpu.kpool_compress(rows_dev[:, L : L + dI], rows_dev[:, L + dI :], ape_dev)  # strided views
    close(got, want, "pooled keys")


@pytest.mark.parametrize("dI", [16, 24])
def test_indexer_scores(dI):
    g = gen(22)
    q, w, pooled = randn(19, NI, dI, g=g), randn(19, NI, g=g), randn(70, dI, g=g)
    close(ix_gpu.index_scores(*on(q, w, pooled)), ix_cpu.index_scores(q, w, pooled), "scores")


def selection(ix, rows, ape, q, w, positions, topk, L, dI, tail=True):
    """The layer's ``_select`` for one request with op-family functions: pool the complete pools of the context,
    score, select; scores get transformers' column for an incomplete last pool."""
    if ix.all_candidates_fit(int(positions.max()), topk, KP):
        return ix.select_tokens(None, positions, topk, KP, tail), None
    seq_len = int(positions.max()) + 1
    n_pools = seq_len // KP
    pooled = ix.kpool_compress(rows[: n_pools * KP, L : L + dI], rows[: n_pools * KP, L + dI :], ape)
    scores = ix.index_scores(q, w, pooled)
    if seq_len % KP:
        scores = torch.nn.functional.pad(scores, (0, 1))
    return ix.select_tokens(scores, positions, topk, KP, tail), scores


def assert_same_selection(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor | None) -> None:
    """Rows compared as sets. Where they differ, every swapped-in pool must tie (within tolerance) with the
    swapped-out one: the two sides computed the scores in different orders, and a near-tie may go either way."""
    assert got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    for r in range(got.shape[0]):
        g_set = set(got[r][got[r] >= 0].tolist())
        w_set = set(want[r][want[r] >= 0].tolist())
        assert len(g_set) == (got[r] >= 0).sum(), f"row {r}: duplicate indices"
        assert sorted(g_set) == got[r][got[r] >= 0].tolist(), f"row {r}: not ascending"
        if g_set == w_set:
            continue
        assert scores is not None, f"row {r}: dense selection differs: {sorted(g_set ^ w_set)}"
        only_got = sorted({t // KP for t in g_set - w_set})
        only_want = sorted({t // KP for t in w_set - g_set})
        assert len(only_got) == len(only_want), f"row {r}: selection sizes differ"
        s = scores[r].cpu()
        tol = 1e-4 * max(1.0, s.abs().max().item())
        band = s[only_got + only_want]
        assert (band.max() - band.min()).item() <= tol, f"row {r}: pools {only_got} vs {only_want} are no tie"


@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no_tail"])
def test_indexer_prefill_longer_than_topk(tail):
    """Every position of a 61-token prompt (15 complete pools for 2 slots): sparse selection drops pools."""
    L, dI, S = 32, 16, 61
    rows = cache_rows(S, L, dI, seed=23)
    g = gen(24)
    ape, q, w = randn(KP, dI, g=g), randn(S, NI, dI, g=g), randn(S, NI, g=g)
    positions = torch.arange(S)
    want, scores = selection(ix_cpu, rows, ape, q, w, positions, TOPK, L, dI, tail)
    got, _ = selection(ix_gpu, *on(rows, ape, q, w, positions), TOPK, L, dI, tail)
    assert (want[-1] >= 0).sum() < S // 2  # the check means something: most of the context is dropped
    assert_same_selection(got, want, scores)


def test_indexer_mixed_batch():
    """A batch as the layer sees it: a prefill chunk continuing a cached context, decodes at several context
    lengths (below, at and far above index_topk), each request with its own cache rows."""
    L, dI, topk = 32, 16, 16
    requests = [torch.arange(30, 46), torch.tensor([12]), torch.tensor([16]), torch.tensor([17]),
                torch.tensor([203])]
    for r, positions in enumerate(requests):
        S = int(positions.max()) + 1
        rows = cache_rows(S, L, dI, seed=30 + r)
        g = gen(40 + r)
        ape, q, w = randn(KP, dI, g=g), randn(len(positions), NI, dI, g=g), randn(len(positions), NI, g=g)
        want, scores = selection(ix_cpu, rows, ape, q, w, positions, topk, L, dI)
        got, _ = selection(ix_gpu, *on(rows, ape, q, w, positions), topk, L, dI)
        assert_same_selection(got, want, scores)


def paged_cache(lengths: list[int], row_width: int, block_size: int, seed: int):
    """Pages ``[num_blocks, block_size, row_width]`` holding each request's rows in shuffled blocks, the block
    table, and each request's rows in order (for the per-sequence reference)."""
    g = gen(seed)
    n_blocks = [-(-n // block_size) for n in lengths]
    pages = randn(sum(n_blocks) + 2, block_size, row_width, g=g)
    order = torch.randperm(pages.shape[0], generator=g)
    table = torch.full((len(lengths), max(n_blocks)), 0, dtype=torch.int64)
    seqs, used = [], 0
    for r, (n, nb) in enumerate(zip(lengths, n_blocks)):
        table[r, :nb] = order[used : used + nb]
        used += nb
        seqs.append(pages[table[r, :nb]].reshape(nb * block_size, row_width)[:n])
    return pages, table, seqs


def latent_plan(q_lens, lengths, table) -> LatentCachePlan:
    cu = torch.tensor([0] + q_lens).cumsum(0)
    seq = torch.tensor(lengths)
    T = int(cu[-1])
    return LatentCachePlan(cu, seq, seq - (cu[1:] - cu[:-1]), table, torch.arange(T), len(q_lens), T,
                           max(q_lens), max(lengths))


def on_plan(plan: LatentCachePlan) -> LatentCachePlan:
    fields = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    return LatentCachePlan(**{f: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for f, v in fields.items()})


def paged_plan(lengths, q_lens, table, block_size, unstored=()) -> LatentCachePlan:
    """Each request's last ``q_lens[r]`` positions new in this step, stored at their block-table slots; batch
    tokens in ``unstored`` carry slot -1."""
    plan = latent_plan(q_lens, lengths, table)
    slots = torch.cat([table[r, pos // block_size] * block_size + pos % block_size
                       for r, pos in enumerate(torch.arange(S - n, S) for S, n in zip(lengths, q_lens))])
    slots[list(unstored)] = -1
    fields = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    return LatentCachePlan(**{**fields, "slot_mapping": slots})


def test_indexer_store_pooled_keys():
    """The pooled keys a step stores: a prompt, a prefill chunk whose first pool started in the cached context
    (its earlier raw inputs read from the page, the chunk's from the step), decodes completing a pool or not, a
    request without tokens, a pool-completing token that is not stored."""
    L, dI, bs = 32, 16, 8
    lengths, q_lens = [46, 13, 20, 90, 7], [46, 1, 1, 31, 0]
    cache, table, _ = paged_cache(lengths, cache_row_size(L, dI, KP, block_size=bs) + 1, bs, seed=62)
    plan = paged_plan(lengths, q_lens, table, bs, unstored=[7])
    g = gen(63)
    ape = randn(KP, dI, g=g)
    key_gate = torch.cat([randn(plan.num_tokens, dI, g=g), randn(plan.num_tokens, dI, g=g, scale=2.0)], dim=1)
    want = cache.clone()
    ix_cpu.store_pooled_keys(page_views(want, L, dI, KP), plan, key_gate, ape)
    before = page_views(cache, L, dI, KP).pooled
    changed = (page_views(want, L, dI, KP).pooled != before).any(-1)
    assert changed.sum() == 11 - 1 + 1 + 8  # prompt pools (one not stored), decode at 19, chunk
    got = cache.to(DEVICE)
    ix_gpu.store_pooled_keys(page_views(got, L, dI, KP), on_plan(plan), key_gate.to(DEVICE), ape.to(DEVICE))
    got = got.cpu()
    close(page_views(got, L, dI, KP).pooled, page_views(want, L, dI, KP).pooled, "pooled keys")
    rest = cache.clone()
    page_views(rest, L, dI, KP).pooled[changed] = page_views(got, L, dI, KP).pooled[changed]
    assert torch.equal(got, rest)  # nothing but the completed pools' keys changes


def test_indexer_select_batch_paged():
    """The batch form over the paged cache: a prefill chunk, and decodes below and far above index_topk."""
    L, dI, topk, bs = 32, 16, 16, 8
    lengths, q_lens = [46, 13, 204, 90], [16, 1, 1, 1]
    cache, table, _ = paged_cache(lengths, cache_row_size(L, dI, KP, block_size=bs), bs, seed=60)
    seqs = [cache_rows(S, L, dI, seed=64 + r) for r, S in enumerate(lengths)]  # each request's [latent|key|gate]
    prompts = paged_plan(lengths, lengths, table, bs)
    pages = page_views(cache, L, dI, KP)
    rows = torch.cat(seqs)
    g = gen(61)
    T = sum(q_lens)
    ape, q, w = randn(KP, dI, g=g), randn(T, NI, dI, g=g), randn(T, NI, g=g)
    ix_cpu.store_pooled_keys(pages, prompts, rows[:, L:], ape)  # the prompts were stored
    write_tokens_torch(pages, prompts.slot_mapping, rows[:, :L], rows[:, L:])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    plan = latent_plan(q_lens, lengths, table)
    want = ix_cpu.select_batch(q, w, pages.pooled, plan, topk, KP)
    got = ix_gpu.select_batch(*on(q, w), page_views(cache.to(DEVICE), L, dI, KP).pooled, on_plan(plan), topk, KP)
    for r, (lo, hi) in enumerate(zip(qsl[:-1], qsl[1:])):
        positions = torch.arange(lengths[r] - (hi - lo), lengths[r])
        _, scores = selection(ix_cpu, seqs[r], ape, q[lo:hi], w[lo:hi], positions, topk, L, dI)
        assert_same_selection(got[lo:hi], want[lo:hi], scores)


def test_indexer_exact_ties_broken_like_cpu():
    """Scores with exact ties (ReLU zeros): given the same scores, the GPU selection is the oracle's exactly —
    on the CPU (interpreter) bit for bit, on a GPU as sets of tied pools."""
    scores = torch.zeros(6, 26)
    scores[:, 3] = 1.0
    scores[2:, 10] = 0.5
    positions = torch.tensor([40, 55, 80, 99, 100, 103])
    want = ix_cpu.select_tokens(scores, positions, TOPK, KP)
    got = ix_gpu.select_tokens(*on(scores, positions), TOPK, KP)
    if ON_GPU:
        assert_same_selection(got, want, scores)
    else:
        assert torch.equal(got.cpu(), want)


# ==============================================================================================================
# Sparse MLA
# ==============================================================================================================

HM, LAT = 3, 32  # MLA heads on this rank (fewer than a head block: exercises masking), latent width


def test_mla_signatures():
    check_same_api(mla_cpu, mla_gpu)


def mla_case(S: int, Tq: int, topk: int, seed: int):
    """Queries at the last Tq positions of an S-token context, indices from the CPU indexer (causal, sparse),
    and the latent as the strided leading columns of cache rows."""
    L, dI = LAT, 16
    rows = cache_rows(S, L, dI, seed=seed)
    g = gen(seed + 1)
    positions = torch.arange(S - Tq, S)
    ape, qi, wi = randn(KP, dI, g=g), randn(Tq, NI, dI, g=g), randn(Tq, NI, g=g)
    indices, _ = selection(ix_cpu, rows, ape, qi, wi, positions, topk, L, dI)
    q_lat = randn(Tq, HM, L, g=g)
    return q_lat, rows, indices


@pytest.mark.parametrize("splits", [None, 1, 3], ids=["auto", "one_split", "three_splits"])
def test_mla_prefill_sparse(splits):
    q_lat, rows, indices = mla_case(S=61, Tq=61, topk=TOPK, seed=50)
    want = mla_cpu.sparse_latent_attention(q_lat, rows[:, :LAT], indices, 0.25)
    q_dev, rows_dev, idx_dev = on(q_lat, rows, indices)
    got = mla_gpu.sparse_latent_attention(q_dev, rows_dev[:, :LAT], idx_dev, 0.25, num_splits=splits)
    close(got, want, "prefill output")


def test_mla_decode_long_context_split():
    """Decode over a context far longer than the selection: a wide index row is split across programs (the
    default for few queries) and the partial softmaxes merged."""
    q_lat, rows, indices = mla_case(S=900, Tq=2, topk=256, seed=51)
    assert indices.shape[1] > 4 * 32  # wide enough for the automatic split
    want = mla_cpu.sparse_latent_attention(q_lat, rows[:, :LAT], indices, 0.25)
    q_dev, rows_dev, idx_dev = on(q_lat, rows, indices)
    got = mla_gpu.sparse_latent_attention(q_dev, rows_dev[:, :LAT], idx_dev, 0.25)
    close(got, want, "decode output")


@pytest.mark.parametrize("splits", [1, 2])
def test_mla_rows_without_indices(splits):
    """Unordered indices, partly padded rows, and a row with nothing selected (zeros, like the oracle)."""
    g = gen(52)
    q_lat, latent = randn(4, HM, LAT, g=g), randn(50, LAT, g=g)
    indices = torch.stack([torch.randperm(50, generator=g)[:40] for _ in range(4)])
    indices[1, 7:] = -1
    indices[2] = -1
    want = mla_cpu.sparse_latent_attention(q_lat, latent, indices, 0.3)
    got = mla_gpu.sparse_latent_attention(*on(q_lat, latent, indices), 0.3, num_splits=splits)
    close(got, want, "output")
    assert got[2].abs().max().item() == 0.0


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 kernels are checked on a GPU only")
def test_mla_bfloat16_on_gpu():
    q_lat, rows, indices = mla_case(S=300, Tq=8, topk=64, seed=53)
    want = mla_cpu.sparse_latent_attention(q_lat, rows[:, :LAT], indices, 0.25)
    got = mla_gpu.sparse_latent_attention(q_lat.to(DEVICE, torch.bfloat16), rows[:, :LAT].to(DEVICE, torch.bfloat16),
                                          indices.to(DEVICE), 0.25)
    err = (got.float().cpu() - want).abs().max().item()
    assert err < 3e-2 * max(1.0, want.abs().max().item())


def test_mla_paged_batch():
    """The batch form over the paged cache: one launch for a prefill chunk and decodes of different requests,
    reading the selected rows in place through the block table."""
    L, dI, bs = LAT, 16, 8
    lengths, q_lens = [61, 9, 300], [12, 1, 2]
    pages, table, seqs = paged_cache(lengths, L + 2 * dI, bs, seed=70)
    g = gen(71)
    qsl, blocks = [0], []
    for r, n in enumerate(q_lens):
        qsl.append(qsl[-1] + n)
        positions = torch.arange(lengths[r] - n, lengths[r])
        ape, qi, wi = randn(KP, dI, g=g), randn(n, NI, dI, g=g), randn(n, NI, g=g)
        blocks.append(selection(ix_cpu, seqs[r], ape, qi, wi, positions, 64, L, dI)[0])
    indices = torch.cat(blocks)
    q_lat = randn(qsl[-1], HM, L, g=g)
    plan = latent_plan(q_lens, lengths, table)
    want = mla_cpu.sparse_latent_attention_paged(q_lat, pages, plan, indices, 0.25, L)
    got = mla_gpu.sparse_latent_attention_paged(*on(q_lat, pages), on_plan(plan), indices.to(DEVICE), 0.25, L)
    close(got, want, "paged output")
