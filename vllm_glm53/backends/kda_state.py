"""The attention backend vLLM sees for the KDA layers: vLLM's GDN (gated delta net) backend, whose metadata
builder already does what a delta-rule layer needs from the scheduler (one state slot per request, decode-first
order, initial-state flags, speculative slots and accepted counts), with one addition: each step it also builds
the step plan the KDA ops read, :class:`~vllm_glm53.backends.plans.StateSlots`, once for all KDA layers.

vLLM splits a batch with drafts into speculative and plain requests (separate token lists, slot tables and
offsets); the plan puts them back in batch order under one rule (start slot, store points), so the layer makes
one call per op whatever the mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_glm53._vllm import GDNAttentionBackend, GDNAttentionMetadata, GDNAttentionMetadataBuilder
from vllm_glm53.backends.plans import StateSlots


@dataclass
class KDAStepMetadata(GDNAttentionMetadata):
    plan: StateSlots | None = None


class KDAStateMetadataBuilder(GDNAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build: bool = False) -> KDAStepMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                             num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
        fields = {name: getattr(meta, name) for name in GDNAttentionMetadata.__dataclass_fields__}
        return KDAStepMetadata(**fields, plan=step_plan(meta, common_attn_metadata))


def step_plan(meta, common) -> StateSlots:
    """The batch-order :class:`StateSlots` of a step from vLLM's GDN metadata ``meta`` and the common metadata."""
    n = common.num_reqs
    num_tokens, max_query_len = common.num_actual_tokens, common.max_query_len
    if not meta.num_spec_decodes:
        has_init = meta.has_initial_state
        if has_init is None:  # no prefill in the step: every request continues its state
            has_init = torch.ones(n, dtype=torch.bool, device=common.query_start_loc.device)
        return StateSlots.single_slot(meta.non_spec_query_start_loc[: n + 1],
                                      meta.non_spec_state_indices_tensor[:n], has_init[:n], num_tokens,
                                      max_query_len)
    ns = meta.num_spec_decodes
    spec = StateSlots.speculative(meta.spec_query_start_loc[: ns + 1], meta.spec_state_indices_tensor[:ns],
                                  meta.num_accepted_tokens[:ns], num_tokens, max_query_len)
    if not (meta.num_prefills or meta.num_decodes):
        return spec  # vLLM puts padding rows after the speculative ones: the plan ends with them
    # Mixed: vLLM gathered the two kinds apart; put their rows back where the batch has them.
    plain = StateSlots.single_slot(meta.non_spec_query_start_loc, meta.non_spec_state_indices_tensor,
                                   meta.has_initial_state, num_tokens, max_query_len)
    mask = meta.spec_sequence_masks[:n]
    spec_rows, plain_rows = mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1)
    W = spec.state_out.shape[1]
    device = spec.state_out.device
    state_in = torch.full((n,), -1, dtype=torch.int64, device=device)
    state_out = torch.full((n, W), -1, dtype=torch.int64, device=device)
    state_out_at = torch.full((n, W), -1, dtype=torch.int64, device=device)
    for rows, part in ((spec_rows, spec), (plain_rows, plain)):
        state_in[rows] = part.state_in
        state_out[rows, : part.state_out.shape[1]] = part.state_out
        state_out_at[rows, : part.state_out.shape[1]] = part.state_out_at
    cu = common.query_start_loc[: n + 1].to(torch.int64)
    return StateSlots(cu, state_in, state_out, state_out_at, n, num_tokens, max_query_len)


class KDAStateBackend(GDNAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "GLM53_KDA_STATE"

    @staticmethod
    def get_builder_cls():
        return KDAStateMetadataBuilder
