"""Speculative decoding with drafts that are partly right: 1 <= accepted < N as well as the extremes.

Unit level: the KDA layer (``Glm5NextKDA.forward`` under the metadata the plugin's KDA backend builds: vLLM's
``GDNAttentionMetadata`` plus the step plan made from it, ``vllm_glm53.backends.kda_state``) verifying N drafts must
leave, in the state slot of its i-th token, exactly the conv window and recurrent state that running those tokens
one at a time leaves; and the next step, resuming from the slot of the last accepted token, must continue as if
only the accepted tokens had ever been seen. Checked for every number of accepted drafts 0..N.
"""

from __future__ import annotations

import pytest
import torch

from vllm_glm53 import testing

N_DRAFTS = 3
PROMPT = 7
PREFIX = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def kda_layer():
    """One KDA layer of the tiny config with random weights (and random decay/bias vectors, so that no gate is
    trivially one), built in a standalone TP=1 group."""
    from transformers import Glm5NextConfig

    from vllm_glm53.config import text_arch
    from vllm_glm53.model.kda import Glm5NextKDA
    from vllm_glm53.tiny import default_config

    arch = text_arch(Glm5NextConfig(**default_config()))
    gen = torch.Generator().manual_seed(0)
    with testing.standalone_model_parallel() as ctx:
        layer = Glm5NextKDA(arch, 0, torch.float32, prefix=PREFIX)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                scale = 0.5 if name in ("conv_weight", "A_log", "dt_bias") else p.shape[-1] ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))
                if name == "o_norm.weight":
                    p.add_(1.0)
        testing.finish_loading(layer)
        yield layer, arch, ctx


def _meta(batch_query_start_loc, **fields):
    """vLLM's own GDN metadata (the contract the plugin's builder reads), with the counts filled from the given
    tensors, as the plugin's KDA backend hands it to the layer: the same fields plus the step plan built from
    them for a batch whose requests own ``batch_query_start_loc``."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_glm53.backends.kda_state import KDAStepMetadata, step_plan

    spec_qsl = fields.get("spec_query_start_loc")
    plain_qsl = fields.get("non_spec_query_start_loc")
    num_spec = 0 if spec_qsl is None else len(spec_qsl) - 1
    spec_tokens = 0 if spec_qsl is None else int(spec_qsl[-1])
    plain_tokens = 0 if plain_qsl is None else int(plain_qsl[-1])
    num_decodes = fields.pop("num_decodes", 0)
    num_prefills = fields.pop("num_prefills", 0)
    gdn = GDNAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=plain_tokens - num_decodes, num_decodes=num_decodes,
        num_decode_tokens=num_decodes, num_spec_decodes=num_spec, num_spec_decode_tokens=spec_tokens,
        num_actual_tokens=spec_tokens + plain_tokens, **fields)
    lens = batch_query_start_loc.diff()
    common = SimpleNamespace(num_reqs=len(lens), num_actual_tokens=int(batch_query_start_loc[-1]),
                             max_query_len=int(lens.max()), query_start_loc=batch_query_start_loc)
    return KDAStepMetadata(**{f: getattr(gdn, f) for f in GDNAttentionMetadata.__dataclass_fields__},
                           plan=step_plan(gdn, common))


def _forward(layer, x, meta):
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_forward_context({PREFIX: meta}, get_current_vllm_config()), torch.no_grad():
        return layer(x)


def _prefill(layer, x, slot):
    qsl = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    meta = _meta(qsl, num_prefills=1, non_spec_query_start_loc=qsl,
                 non_spec_state_indices_tensor=torch.tensor([slot], dtype=torch.int32),
                 has_initial_state=torch.tensor([False]))
    return _forward(layer, x, meta)


def _decode(layer, x, slot):
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    meta = _meta(qsl, num_decodes=1, non_spec_query_start_loc=qsl,
                 non_spec_state_indices_tensor=torch.tensor([slot], dtype=torch.int32),
                 has_initial_state=torch.tensor([True]))
    return _forward(layer, x, meta)


def _verify(layer, x_plain, x_spec, plain_slot, spec_slots, accepted):
    """One step of a batch of a plain decode (token 0) and a sequence verifying drafts (the remaining tokens),
    laid out as vLLM's GDN builder lays them out: separate token index lists, slot tables and offsets for spec and
    non-spec requests, and the mask saying which batch row is which."""
    n = x_spec.shape[0]
    meta = _meta(torch.tensor([0, 1, 1 + n], dtype=torch.int32), spec_sequence_masks=torch.tensor([False, True]),
                 num_decodes=1, non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                 non_spec_state_indices_tensor=torch.tensor([plain_slot], dtype=torch.int32),
                 has_initial_state=torch.tensor([True]),
                 spec_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                 spec_state_indices_tensor=torch.tensor([spec_slots], dtype=torch.int32),
                 num_accepted_tokens=torch.tensor([accepted], dtype=torch.int32),
                 non_spec_token_indx=torch.tensor([0]), spec_token_indx=torch.arange(1, n + 1))
    out = _forward(layer, torch.cat([x_plain, x_spec]), meta)
    return out[:1], out[1:]


def _fresh_pools(layer, arch, n_slots, gen):
    """Pools full of random values: reading a slot nobody wrote changes the result instead of reading zeros."""
    from vllm_glm53.model.kda import kda_state_shapes

    conv_shape, state_shape = kda_state_shapes(arch, 1)
    layer.kv_cache = (torch.randn(n_slots, *conv_shape, generator=gen),
                      torch.randn(n_slots, *state_shape, generator=gen))
    return layer.kv_cache


def _sequential(layer, arch, xs, gen):
    """Reference: prefill the prompt, then one plain decode per token; (outputs, [(conv, state) after each])."""
    conv, state = _fresh_pools(layer, arch, 1, gen)
    _prefill(layer, xs[:PROMPT], 0)
    outs, states = [], []
    for t in range(PROMPT, xs.shape[0]):
        outs.append(_decode(layer, xs[t : t + 1], 0))
        states.append((conv[0].clone(), state[0].clone()))
    return torch.cat(outs), states


# Measured: the verifying step and one-at-a-time decodes agree to 0 (same per-token ops on the same values);
# the bound leaves room for a compiled kernel that orders its sums differently (1e-6 of values ~1).
ATOL = 1e-5


@pytest.mark.parametrize("k", range(N_DRAFTS + 1))
def test_kda_state_after_k_accepted_drafts_equals_sequential(kda_layer, k):
    layer, arch, _ = kda_layer
    gen = torch.Generator().manual_seed(10 + k)
    D = arch.hidden_size
    prompt = torch.randn(PROMPT, D, generator=gen)
    step1 = torch.randn(N_DRAFTS + 1, D, generator=gen)  # last sampled token + N drafts
    step2 = torch.randn(N_DRAFTS + 1, D, generator=gen)  # the token after the k accepted drafts + N new drafts
    other = torch.randn(PROMPT + 2, D, generator=gen)  # a plain sequence decoding in the same batches

    # What the sequence must see: the prompt, the first k+1 tokens of step 1, then step 2 (and the other one).
    want1, states1 = _sequential(layer, arch, torch.cat([prompt, step1]), gen)
    want2, states2 = _sequential(layer, arch, torch.cat([prompt, step1[: k + 1], step2]), gen)
    want_other, other_states = _sequential(layer, arch, other, gen)

    spec_slots = [5, 1, 7, 3]  # not in order, so a slot-arithmetic mistake reads a wrong one
    plain_slot = 6
    conv, state = _fresh_pools(layer, arch, 8, gen)
    _prefill(layer, prompt, spec_slots[0])
    _prefill(layer, other[:PROMPT], plain_slot)

    got_other, got1 = _verify(layer, other[PROMPT : PROMPT + 1], step1, plain_slot, spec_slots, accepted=1)
    torch.testing.assert_close(got1, want1, rtol=0, atol=ATOL)
    torch.testing.assert_close(got_other, want_other[:1], rtol=0, atol=ATOL)
    for i in range(N_DRAFTS + 1):  # slot i holds the state after token i of the step
        torch.testing.assert_close(conv[spec_slots[i]], states1[i][0], rtol=0, atol=ATOL, msg=f"conv slot {i}")
        torch.testing.assert_close(state[spec_slots[i]], states1[i][1], rtol=0, atol=ATOL, msg=f"state slot {i}")

    # The sampler accepted k drafts: the next step starts from slot k (num_accepted_tokens = k + 1).
    got_other, got2 = _verify(layer, other[PROMPT + 1 : PROMPT + 2], step2, plain_slot, spec_slots,
                              accepted=k + 1)
    torch.testing.assert_close(got2, want2[k + 1 :], rtol=0, atol=ATOL)
    torch.testing.assert_close(got_other, want_other[1:], rtol=0, atol=ATOL)
    for i in range(N_DRAFTS + 1):
        torch.testing.assert_close(conv[spec_slots[i]], states2[k + 1 + i][0], rtol=0, atol=ATOL)
        torch.testing.assert_close(state[spec_slots[i]], states2[k + 1 + i][1], rtol=0, atol=ATOL)
    torch.testing.assert_close(conv[plain_slot], other_states[1][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(state[plain_slot], other_states[1][1], rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------
# Engine level: an intact target model whose MTP drafts are a known function of the token
# ---------------------------------------------------------------------------------------------------------

# Embeddings scaled up so that the (intact, random) target's next token often, but not always, is the one its
# embedding alone points to: measured on the default tiny checkpoint, 33 of 87 consecutive greedy pairs follow
# it, and the 3-draft rounds of the prompts below accept 0, 1, 2 and 3 drafts. At scale 1 or 4 none do.
EMBED_SCALE = 16.0
SPEC_PROMPTS = [5, 30, 120]
SPEC_TOKENS = 24


def _make_token_function_mtp(path):
    """Edit a nested float32 checkpoint in place: embeddings x ``EMBED_SCALE`` (the target stays a whole model),
    and an MTP layer that drafts ``f(token) = argmax lm_head(final_norm(token's embedding))``: ``eh_proj`` passes
    the normed embedding through and ignores the hidden state, the block's attention and MoE output projections
    are zero, ``shared_head.norm`` is the final norm. Returns ``f`` as a tensor ``[vocab]``."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())["text_config"]
    t = load_file(str(path / "model.safetensors"))
    emb, norm = "model.language_model.embed_tokens.weight", "model.language_model.norm.weight"
    mtp = f"model.language_model.layers.{cfg['num_hidden_layers']}."
    t[emb] = t[emb] * EMBED_SCALE
    for name in t:
        if name.startswith(mtp) and name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    d = cfg["hidden_size"]
    t[mtp + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    t[mtp + "enorm.weight"] = torch.ones(d)
    t[mtp + "shared_head.norm.weight"] = t[norm].clone()
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    # enorm, then shared_head.norm of the unchanged residual: two RMSNorms, the second weighted
    return (rms(rms(t[emb].float())) * t[norm].float() @ t["lm_head.weight"].float().t()).argmax(-1)


def _expected_rounds(f, first, future, n_drafts, max_tokens):
    """vLLM's draft/verify loop on a known greedy continuation: after the prefill's token, each round drafts
    ``f`` applied 1..N times to the last token, accepts the longest prefix matching the continuation, and emits
    the accepted tokens plus one; the request stops at ``max_tokens`` (a last round's extra accepted tokens
    still count). Returns the accepted count of every round."""
    out, rounds = [first], []
    while len(out) < max_tokens:
        drafts, x = [], out[-1]
        for _ in range(n_drafts):
            x = int(f[x])
            drafts.append(x)
        a = 0
        while a < n_drafts and drafts[a] == future[len(out) + a]:
            a += 1
        rounds.append(a)
        out += future[len(out) : len(out) + a + 1]
    return rounds


@pytest.mark.engine
def test_partly_right_drafts_keep_outputs_and_are_accepted_exactly(tiny_ckpt, tmp_path):
    import shutil

    from conftest import hf_greedy, hf_model, prompt_set, run_engine

    path = tmp_path / "token-function-mtp"
    shutil.copytree(tiny_ckpt("default"), path)
    f = _make_token_function_mtp(path)
    prompts = prompt_set(path, SPEC_PROMPTS)
    ref = hf_model(path)
    ref.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    # N tokens past the end: a last round may accept drafts beyond max_tokens, and vLLM counts them.
    want = hf_greedy(ref, prompts, SPEC_TOKENS + N_DRAFTS)
    rounds = [r for w in want for r in _expected_rounds(f, w["token_ids"][0], w["token_ids"], N_DRAFTS,
                                                         SPEC_TOKENS)]
    # the point of this checkpoint: rounds that accept some but not all drafts, and the extremes
    assert set(rounds) == set(range(N_DRAFTS + 1)), rounds

    got, metrics = run_engine(path, prompts, SPEC_TOKENS, ignore_eos=True, metrics=True, engine={
        "enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": N_DRAFTS}})
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == w["token_ids"][:SPEC_TOKENS], f"prompt {i}"
    assert metrics["vllm:spec_decode_num_drafts"] == len(rounds)
    assert metrics["vllm:spec_decode_num_draft_tokens"] == N_DRAFTS * len(rounds)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(rounds)


def test_align_mode_copies_with_drafts_move_whole_draft_slots():
    """The host stand-ins for vLLM's align-mode copy kernels with drafts (``_vllm`` ledger 9), driven as vLLM's
    runner drives them (``MambaSpecDecodeGPUContext``: state base addresses, byte strides, block-table addresses),
    on block 128 and 3 drafts. After sampling: a step whose accepted tokens reach a block edge stores the slot of
    the token at the edge as that block's snapshot (into the running column itself, which then restarts from its
    first slot, or into the block before it). Before a step: a request moving to a new column starts from the slot
    of its last accepted token. Both KDA states alike, whole."""
    from vllm_glm53 import _vllm

    gen = torch.Generator().manual_seed(1)
    states = [torch.randn(40, 6, 3, generator=gen), torch.randn(40, 2, 4, 4, generator=gen)]  # conv, recurrent
    tables = torch.randperm(40, generator=gen).to(torch.int32).view(4, 10)[:3].contiguous()  # 3 requests
    n = len(states)
    meta = dict(
        block_table_ptrs_ptr=torch.tensor([tables.data_ptr()]), block_table_stride_req=tables.stride(0),
        state_base_addrs_ptr=torch.tensor([s.data_ptr() for s in states]),
        state_block_strides_ptr=torch.tensor([s.stride(0) * s.element_size() for s in states]),
        state_elem_sizes_ptr=torch.tensor([s.element_size() for s in states], dtype=torch.int32),
        state_inner_sizes_ptr=torch.tensor([s[0].numel() for s in states]),
        state_conv_widths_ptr=torch.zeros(n, dtype=torch.int32),
        state_group_indices_ptr=torch.zeros(n, dtype=torch.int32),
        state_dim_row_count_ptr=torch.zeros(n, dtype=torch.int32), state_dim_row_stride_ptr=torch.zeros(n))

    def moved(copies):  # the states after copying (request, src column) -> (request, dst column)
        want = [s.clone() for s in states]
        for r, src, dst in copies:
            for w in want:
                w[tables[r, dst]] = w[tables[r, src]]
        return want

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    # request 0: 636 computed + 4 (3 drafts), all accepted: the edge 640 is its 4th token, running column 4 ->
    #   column 4 + 3 into 4, next step from slot 0; request 1: 638 + 4, 2 accepted (edge = 2nd token) while
    #   running in column 5 -> column 6 into 4; request 2: 600 + 4, 3 accepted: no edge reached.
    accepted, out = i32(4, 2, 3), i32(4, 2, 3)
    want = moved([(0, 7, 4), (1, 6, 4)])
    _vllm._host_postprocess_align(accepted, i32(4, 5, 4), i32(4, 4, 4), i32(636, 638, 600), i32(3, 3, 3),
                                  num_accepted_tokens_out_ptr=out, idx_mapping_ptr=None, num_reqs=3,
                                  block_size=128, **meta)
    assert all(torch.equal(s, w) for s, w in zip(states, want))
    assert out.tolist() == [1, 2, 3]
    # before a step: request 0 moves from column 4 to 5 with 3 accepted (slot 4 + 2); request 1 is fresh (-1);
    # request 2 stays in its column
    want = moved([(0, 6, 5)])
    _vllm._host_precopy_align(i32(5, 5, 4), i32(4, -1, 4), i32(2, 0, 1), idx_mapping_ptr=None, num_reqs=3,
                              HAS_IDX_MAPPING=False, **meta)
    assert all(torch.equal(s, w) for s, w in zip(states, want))
