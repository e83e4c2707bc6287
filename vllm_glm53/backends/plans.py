"""The step plans: one typed description of a step's batch that every op of a layer family reads.

vLLM hands each attention backend its own metadata once per step; the plugin's two vLLM-facing backends turn it
into one of these, once per step (not once per layer), as tensors on the model's device plus the few Python ints
known when the step is scheduled. Ops take the plan instead of rebuilding index bookkeeping per layer, so the
forward pass of a step has no Python loop over requests and reads nothing back from the device.

  * :class:`StateSlots` (KDA, built by :mod:`vllm_glm53.backends.kda_state` over vLLM's GDN/mamba metadata):
    which state slot each request starts from and where the states after chosen tokens go. This one rule covers a
    decode, a fresh prefill, a prefill chunk continuing from a cached state (chunked prefill), speculative
    verification (a state after every token, one slot per draft position) and prefix caching: in vLLM's "align"
    mode the scheduler ends prefill chunks at block edges and names the slot of the chunk's last block, so the
    state stored after the chunk is that block's snapshot, and a request whose prefix hits the cache starts from
    the slot of its last cached block (vLLM copies it forward with the model's copy functions). With drafts the
    same copies move whole draft slots: a verification step that reaches a block edge leaves the state after the
    edge token in that token's draft slot, which vLLM copies into the block's snapshot; a request moving on to a
    new block starts from a copy of its last accepted token's slot.
  * :class:`LatentCachePlan` (sparse MLA + indexer, built by :mod:`vllm_glm53.backends.latent_cache`): request
    token ranges, total and cached lengths, the block table and the new tokens' cache slots. A prefill chunk
    continuing a request reads its earlier tokens from the paged cache (``context_lens > 0``).

Both follow fla's varlen contract: request ``r`` owns tokens ``cu_seqlens[r]:cu_seqlens[r+1]`` of the batch.
This module imports only torch: the op backends and their tests use it without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StateSlots", "LatentCachePlan"]


@dataclass(frozen=True)
class StateSlots:
    """Where each request's recurrent state (KDA: conv window and delta-rule state, one slot index for both
    pools) comes from and goes to in one step.

    * ``cu_seqlens [R+1]`` int64: request r's tokens are ``cu_seqlens[r]:cu_seqlens[r+1]`` (zero-length rows are
      padding and touch nothing);
    * ``state_in [R]`` int64: the slot request r starts from, ``-1`` to start from zeros (a fresh sequence);
    * ``state_out [R, W]`` int64 and ``state_out_at [R, W]`` int64: for every column j with
      ``state_out_at[r, j] >= 0``, the state right after the request's token ``state_out_at[r, j]`` (counted from
      its first token) is stored in slot ``state_out[r, j]``.

    A decode or a prefill stores once, after its last token, into its own slot (``state_in`` is that slot, or -1
    for a fresh prompt). A request verifying ``n`` drafts (``1 + n`` tokens, vLLM's speculative slots) starts from
    the slot of its last accepted token and stores after token i into draft column i, so whatever the sampler
    accepts, the next step finds the state right after the last accepted token without recomputing anything.
    ``num_reqs``, ``num_tokens`` and ``max_query_len`` are known on the host when the step is scheduled.
    """

    cu_seqlens: torch.Tensor
    state_in: torch.Tensor
    state_out: torch.Tensor
    state_out_at: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int

    @staticmethod
    def fresh(num_tokens: int, device: torch.device | str = "cpu") -> StateSlots:
        """One fresh sequence whose state is not kept: vLLM's profiling and dummy runs."""
        cu = torch.tensor([0, num_tokens], dtype=torch.int64, device=device)
        none = torch.full((1, 1), -1, dtype=torch.int64, device=device)
        return StateSlots(cu, torch.full((1,), -1, dtype=torch.int64, device=device), none, none, 1, num_tokens,
                          num_tokens)

    @staticmethod
    def single_slot(cu_seqlens: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
                    num_tokens: int, max_query_len: int) -> StateSlots:
        """Plain requests (decodes, prefills, prefill chunks): start from ``slots[r]`` when
        ``has_initial_state[r]`` (else zeros), store the final state back into ``slots[r]``."""
        cu = cu_seqlens.to(torch.int64)
        slots = slots.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        state_in = torch.where(has_initial_state.to(torch.bool), slots, -1)
        return StateSlots(cu, state_in, slots.unsqueeze(1), (lens - 1).unsqueeze(1), int(slots.shape[0]),
                          num_tokens, max_query_len)

    @staticmethod
    def speculative(cu_seqlens: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
                    num_tokens: int, max_query_len: int) -> StateSlots:
        """Requests verifying drafts: ``slots [R, 1 + num_spec]`` one slot per draft position, the step starts
        from column ``num_accepted[r] - 1`` and stores after token i into column i."""
        cu = cu_seqlens.to(torch.int64)
        slots = slots.to(torch.int64)
        lens = (cu[1:] - cu[:-1]).unsqueeze(1)
        R, W = slots.shape
        col = torch.arange(W, device=slots.device).unsqueeze(0).expand(R, W)
        state_in = slots.gather(1, (num_accepted.to(torch.int64) - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        state_out_at = torch.where(col < lens, col, -1)
        return StateSlots(cu, state_in, slots, state_out_at, R, num_tokens, max_query_len)

    def to(self, device: torch.device | str) -> StateSlots:
        return StateSlots(*(t.to(device) for t in (self.cu_seqlens, self.state_in, self.state_out,
                                                     self.state_out_at)),
                          self.num_reqs, self.num_tokens, self.max_query_len)

    def rows(self) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
        """Per request ``(first token, length, slot in, [(store after token, slot), ...] sorted)`` as Python
        values: for the plain-torch reference forms only (it reads the plan back to the host)."""
        cu = self.cu_seqlens.tolist()
        state_in = self.state_in.tolist()
        outs = self.state_out.tolist()
        ats = self.state_out_at.tolist()
        return [(cu[r], cu[r + 1] - cu[r], state_in[r],
                 sorted((a, s) for a, s in zip(ats[r], outs[r]) if a >= 0)) for r in range(len(state_in))]


@dataclass(frozen=True)
class LatentCachePlan:
    """The sparse-MLA layers' view of a step: request r's new tokens are ``cu_seqlens[r]:cu_seqlens[r+1]`` of
    the batch and are its last ``seq_lens[r] - context_lens[r]`` positions (``context_lens[r]`` tokens of it are
    already in the cache: a decode, or a prefill chunk continuing the request); ``block_table [R, max_blocks]``
    maps its positions to cache pages; ``slot_mapping [num_tokens]`` is the cache slot of each new token (-1:
    padding, not stored)."""

    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int

    @staticmethod
    def fresh(num_tokens: int, device: torch.device | str = "cpu") -> LatentCachePlan:
        """One fresh sequence whose rows form a single page (block 0): vLLM's profiling and dummy runs."""
        cu = torch.tensor([0, num_tokens], dtype=torch.int64, device=device)
        seq_lens = cu[1:].clone()
        return LatentCachePlan(cu, seq_lens, torch.zeros_like(seq_lens),
                               torch.zeros(1, 1, dtype=torch.int32, device=device),
                               torch.arange(num_tokens, device=device), 1, num_tokens, num_tokens, num_tokens)

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request, position) [num_tokens]`` int64: which request each new token of the batch belongs to and its
        position in that request, computed on the plan's device (nothing is read back)."""
        token = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
        req = torch.searchsorted(self.cu_seqlens[1:], token, right=True)  # zero-length requests own no token
        return req, self.context_lens[req] + token - self.cu_seqlens[req]

