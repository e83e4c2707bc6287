"""The step plans and the layers that read them: the KDA plan built from vLLM's GDN metadata in each batch shape
vLLM produces (plain, all speculative, mixed), and a decode step through the real KDA and sparse-MLA layers
(projections + their registered custom op, compiled ops) that reads nothing back from its tensors and walks no
request list: every ``tolist``/``item``/``int()``/``bool()``/``.cpu()``/``.numpy()`` on a tensor, and the plan's
own per-request walk, raise inside it."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import hf_ref
from vllm_glm53 import testing
from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.kda_state import step_plan
from vllm_glm53.backends.pages import page_views
from vllm_glm53.backends.plans import LatentCachePlan, StateSlots
from vllm_glm53.config import MIN_CACHE_BLOCK, cache_row_size

torch.set_num_threads(2)


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def _common(query_lens):
    cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return SimpleNamespace(num_reqs=len(query_lens), num_actual_tokens=int(cu[-1]), max_query_len=max(query_lens),
                           query_start_loc=cu)


def _assert_plan(plan, cu, state_in, state_out, state_out_at):
    assert plan.cu_seqlens.tolist() == cu
    assert plan.state_in.tolist() == state_in
    assert plan.state_out.tolist() == state_out
    assert plan.state_out_at.tolist() == state_out_at
    assert plan.num_reqs == len(state_in) and plan.num_tokens == cu[-1]


def test_plan_of_decodes_and_prefills():
    """Two decodes, a prefill chunk continuing its request, a fresh prompt: start slot or zeros, one store
    after the last token into the request's own slot."""
    common = _common([1, 1, 6, 3])
    meta = SimpleNamespace(num_spec_decodes=0, has_initial_state=_t([True, True, True, False], torch.bool),
                           non_spec_query_start_loc=common.query_start_loc,
                           non_spec_state_indices_tensor=_t([7, 2, 5, 9], torch.int32))
    _assert_plan(step_plan(meta, common), [0, 1, 2, 8, 11], [7, 2, 5, -1], [[7], [2], [5], [9]],
                 [[0], [0], [5], [2]])
    meta.has_initial_state = None  # a decode-only step: vLLM gives no flags, every request has its state
    common = _common([1, 1])
    meta.non_spec_query_start_loc = common.query_start_loc
    _assert_plan(step_plan(meta, common), [0, 1, 2], [7, 2], [[7], [2]], [[0], [0]])


def test_plan_of_speculative_verification():
    """Every request verifies drafts: start from the slot of the last accepted draft, store after token i into
    draft column i; a request with fewer drafts stores fewer states."""
    common = _common([3, 2])
    meta = SimpleNamespace(num_spec_decodes=2, num_prefills=0, num_decodes=0,
                           spec_query_start_loc=common.query_start_loc,
                           spec_state_indices_tensor=_t([[4, 5, 6], [1, 2, 3]], torch.int32),
                           num_accepted_tokens=_t([3, 1], torch.int32))
    _assert_plan(step_plan(meta, common), [0, 3, 5], [6, 1], [[4, 5, 6], [1, 2, 3]], [[0, 1, 2], [0, 1, -1]])


def test_plan_of_a_mixed_step_puts_rows_back_in_batch_order():
    """vLLM hands drafts and plain requests over separately; the plan has them where the batch has them."""
    common = _common([4, 2, 3])  # a prefill chunk, a draft verification, a fresh prompt
    mask = _t([False, True, False], torch.bool)
    meta = SimpleNamespace(num_spec_decodes=1, num_prefills=2, num_decodes=0, spec_sequence_masks=mask,
                           spec_query_start_loc=_t([0, 2], torch.int32),
                           spec_state_indices_tensor=_t([[4, 5, 6]], torch.int32),
                           num_accepted_tokens=_t([2], torch.int32),
                           non_spec_query_start_loc=_t([0, 4, 7], torch.int32),
                           non_spec_state_indices_tensor=_t([8, 9], torch.int32),
                           has_initial_state=_t([True, False], torch.bool))
    _assert_plan(step_plan(meta, common), [0, 4, 6, 9], [8, 5, -1], [[8, -1, -1], [4, 5, 6], [9, -1, -1]],
                 [[3, -1, -1], [0, 1, -1], [2, -1, -1]])


# --------------------------------------------------------------------------------------------------------------
# A decode step through the real layers reads nothing back
# --------------------------------------------------------------------------------------------------------------


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Every way the forward could read a tensor's value into Python raises, and so does the plan's per-request
    walk (the reference forms' loop)."""
    def refuse(name):
        def method(*args, **kwargs):
            raise HostRead(f"Tensor.{name} in the decode step")
        return method

    names = ["tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"]
    saved = {name: getattr(torch.Tensor, name) for name in names}
    saved_rows = StateSlots.rows
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse(name))
        StateSlots.rows = refuse("StateSlots.rows")
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        StateSlots.rows = saved_rows


@pytest.fixture(scope="module")
def layers():
    """Decoder layers 1 (KDA + MoE), 3 (sparse MLA with its indexer + MoE) and 4 (sparse MLA reusing layer 3's
    selection + MoE) of the tiny config, each with its two mHC blocks, random weights."""
    from transformers import Glm5NextConfig

    from vllm_glm53.config import text_arch
    from vllm_glm53.model.model import Glm5NextDecoderLayer

    if kernels.ops() is None:
        pytest.fail(f"the compiled kernels are the decode path under test and are not loaded: "
                    f"{kernels.description()}")
    arch = text_arch(Glm5NextConfig(**hf_ref.tiny_config_dict()))
    assert arch.is_kda(1) and not arch.is_kda(3) and arch.indexer_types[4] == "shared"
    assert all(arch.is_moe(i) for i in (1, 3, 4))
    gen = torch.Generator().manual_seed(0)
    with testing.standalone_model_parallel():
        decoder = [Glm5NextDecoderLayer(arch, i, torch.float32, prefix=f"model.layers.{i}") for i in (1, 3, 4)]
        for layer in decoder:
            for p in layer.parameters():
                p.data.copy_(0.2 * torch.randn(p.shape, generator=gen))
            testing.finish_loading(layer)
            if not layer.is_kda:
                layer.self_attn.process_weights_after_loading()
        yield arch, decoder


def _decode_pages(arch, seq_lens, block_size, copies, gen):
    """A decode step's latent-cache plan (one new token per request, its pages out of order) and ``copies`` random
    caches of small pages (two raw slots each) holding the requests' earlier tokens."""
    B = len(seq_lens)
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.arange(sum(blocks), dtype=torch.int32).flip(0)  # pages out of order
    block_table = torch.zeros(B, max(blocks), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks):
        block_table[r, :nb] = table[used : used + nb]
        used += nb
    row = cache_row_size(arch.kv_lora_rank, arch.index_head_dim, arch.index_kpool, block_size=block_size)
    caches = [torch.randn(sum(blocks), block_size, row, generator=gen) for _ in range(copies)]
    last = torch.tensor(seq_lens) - 1
    slot_mapping = block_table[torch.arange(B), last // block_size].long() * block_size + last % block_size
    plan = LatentCachePlan(torch.arange(B + 1), torch.tensor(seq_lens), last, block_table, slot_mapping, B, B, 1,
                           max(seq_lens))
    return plan, caches


def test_decode_step_reads_nothing_back(layers):
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    arch, decoder = layers
    kda, mla, shared = (layer.self_attn for layer in decoder)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [5, 40, 90]  # 40 and 90 are far beyond index_topk: the indexer really selects
    B, block_size = len(seq_lens), 16
    latent_plan, caches = _decode_pages(arch, seq_lens, block_size, 2, gen)
    block_table, slot_mapping, cu = latent_plan.block_table, latent_plan.slot_mapping, latent_plan.cu_seqlens
    L, dI, kp = arch.kv_lora_rank, arch.index_head_dim, arch.index_kpool
    last = torch.tensor(seq_lens) - 1
    conv_shape, state_shape = kda.get_state_shape()
    conv_pool = 0.1 * torch.randn(6, *conv_shape, generator=gen)
    state_pool = 0.1 * torch.randn(6, *state_shape, generator=gen)
    slots = torch.tensor([4, 0, 2])
    kda_plan = StateSlots.single_slot(cu, slots, torch.ones(B, dtype=torch.bool), B, 1)
    kda.kv_cache, mla.kv_cache, shared.kv_cache = (conv_pool, state_pool), caches[0], caches[1]
    before = conv_pool.clone(), state_pool.clone(), [c.clone() for c in caches]
    X = torch.randn(B, arch.hc_mult, arch.hidden_size, generator=gen)
    metadata = {kda.prefix: SimpleNamespace(plan=kda_plan), mla.prefix: latent_plan, shared.prefix: latent_plan}
    with set_forward_context(metadata, get_current_vllm_config()), no_host_reads(), torch.no_grad():
        selection = None
        for layer in decoder:
            X, selection = layer(X, selection)
    with pytest.raises(HostRead):  # the guard is live where the step ran
        with no_host_reads():
            torch.ones(1).tolist()
    # The step really ran on the caches: the three requests' states and latest rows changed, nothing else.
    for pool, old in zip((conv_pool, state_pool), before[:2]):
        changed = [s for s in range(pool.shape[0]) if not torch.equal(pool[s], old[s])]
        assert changed == sorted(slots.tolist())
    # In the pages (backends/latent_cache.py): each new token's latent, and in the indexer layer its raw inputs
    # (in its pool's raw slot) or, for a token completing its pool (position 39), the pool's key.
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    for cache, old, has_indexer in zip(caches, before[2], (True, False)):
        new_p, old_p = page_views(cache, L, dI, kp), page_views(old, L, dI, kp)
        mark = torch.zeros_like(cache, dtype=torch.bool)
        touched = page_views(mark, L, dI, kp)
        touched.latent[blk, off] = True
        assert (new_p.latent[blk, off] != old_p.latent[blk, off]).any(-1).all()
        if has_indexer:
            for b, o, pos in zip(blk.tolist(), off.tolist(), last.tolist()):
                if pos % kp < kp - 1:
                    at = (b, o // kp % new_p.raw.shape[1], o % kp)
                    region, new_entry, old_entry = touched.raw, new_p.raw, old_p.raw
                else:
                    at, region, new_entry, old_entry = (b, o // kp), touched.pooled, new_p.pooled, old_p.pooled
                region[at] = True
                assert (new_entry[at] != old_entry[at]).any()
        assert not ((cache != old) & ~mark).any()
    assert torch.isfinite(X).all()
    assert ((selection >= 0).sum(1) < torch.tensor(seq_lens)).tolist() == [False, True, True]


def test_rows_past_the_plan_attend_to_nothing_and_change_nothing(layers):
    """A batch may carry rows past the plan's tokens (padding): the sparse-MLA layer's attention gives them zeros and
    leaves the real rows' outputs, selections and cache writes as they are without them."""
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    arch, decoder = layers
    mla = decoder[1].self_attn
    gen = torch.Generator().manual_seed(2)
    seq_lens, pad = [7, 60], 3
    plan, (cache,) = _decode_pages(arch, seq_lens, 16, 1, gen)
    T = len(seq_lens) + pad
    H, L, nI, dI = mla.heads, arch.kv_lora_rank, arch.index_n_heads, arch.index_head_dim
    inputs = (torch.randn(T, H, L, generator=gen), torch.randn(T, L, generator=gen),
              torch.randn(T, 2 * dI, generator=gen), torch.randn(T, nI, dI, generator=gen),
              torch.randn(T, nI, generator=gen))
    results = []
    for rows in (len(seq_lens), T):
        mla.kv_cache = cache.clone()
        with set_forward_context({mla.prefix: plan}, get_current_vllm_config()), torch.no_grad():
            o_lat, selection = mla.attend(*(t[:rows] for t in inputs), None)
        results.append((o_lat, selection, mla.kv_cache))
    (o_lat, selection, written), (o_pad, selection_pad, written_pad) = results
    assert o_pad.shape == (T, H, L) and o_pad.dtype == o_lat.dtype
    assert torch.equal(o_pad[: len(seq_lens)], o_lat) and not o_pad[len(seq_lens) :].any()
    assert torch.equal(selection_pad, selection) and torch.equal(written_pad, written)
    assert o_lat.abs().sum() > 0 and not torch.equal(written, cache)  # each run wrote the cache it was given


def test_a_block_size_the_pages_cannot_take_is_refused_before_any_cache_exists(layers):
    """Pages hold whole pools and the raw indexer inputs of the pools a step may leave incomplete
    (backends/latent_cache.py): the layer's cache spec, asked at engine start, names a block size that is not a
    multiple of index_kpool, or too small for the speculative tokens asked for, instead of failing (or selecting
    from overwritten inputs) at the first request."""
    arch, decoder = layers
    mla = decoder[1].self_attn
    kp = arch.index_kpool

    def config(block_size, drafts=None):
        spec = None if drafts is None else SimpleNamespace(num_speculative_tokens=drafts)
        return SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
                               speculative_config=spec)

    assert mla.get_kv_cache_spec(config(MIN_CACHE_BLOCK)).block_size == MIN_CACHE_BLOCK
    assert mla.get_kv_cache_spec(config(MIN_CACHE_BLOCK, drafts=kp)).block_size == MIN_CACHE_BLOCK
    assert mla.get_kv_cache_spec(config(2 * MIN_CACHE_BLOCK, drafts=2 * kp)).block_size == 2 * MIN_CACHE_BLOCK
    with pytest.raises(ValueError, match=f"--block-size {kp + 1}:.*index_kpool"):
        mla.get_kv_cache_spec(config(kp + 1))
    with pytest.raises(ValueError, match=f"--block-size {MIN_CACHE_BLOCK}:.*2 pools, 3 needed with {kp + 1} "
                                         f"speculative tokens; use a block size of at least {2 * MIN_CACHE_BLOCK}"):
        mla.get_kv_cache_spec(config(MIN_CACHE_BLOCK, drafts=kp + 1))
    with pytest.raises(ValueError, match=f"--block-size {kp}:.*0 pools, 1 needed with 0 speculative tokens"):
        mla.get_kv_cache_spec(config(kp))
