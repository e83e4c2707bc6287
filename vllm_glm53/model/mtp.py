"""The checkpoint's multi-token-prediction (MTP) draft layer, served as vLLM's ``Glm5NextMTPModel``
(architecture.md §10).

    e = embed(next token), zero at absolute position 0
    z = eh_proj([enorm(e) ; hnorm(h_prev)])          h_prev: the target's post-norm hidden state at t,
    r = z + MLA(input_layernorm(z))                         or this layer's own output for later drafts
    h = shared_head.norm(r + MoE(post_attention_layernorm(r)))

It is one plain pre-norm decoder block (no mHC) at checkpoint index ``num_hidden_layers``, with its own sparse
MLA, indexer and latent cache. msmodelslim w8a8 checkpoints made with QuaRot (``is_rot_used``) also carry
``rot.weight``, applied to ``h_prev`` like a linear layer before anything else (ascend.md §5).
Its embedding and LM head are the target model's: vLLM's MTP proposer installs
them after loading (``model.embed_tokens``, ``lm_head``), so this module creates neither, except the embedding
under pipeline parallel: the layer lives on the last stage and the target's embedding on the first, so vLLM lends
none and the layer loads the target's embedding rows itself (``model.embed_tokens.*``, not the layer's own copy:
the draft must embed exactly as the target does). Every draft step
runs the layer's own indexer (exact; vLLM's in-tree version reuses the first step's selection).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import LogitsProcessor, ReplicatedLinear, VocabParallelEmbedding
from vllm_glm53.config import TextArch, text_arch
from vllm_glm53.model.mla import Glm5NextSparseMLA
from vllm_glm53.model.moe import Glm5NextMLP, Glm5NextMoE
from vllm_glm53.model.norm import RMSNorm
from vllm_glm53.model.weights import CheckpointError, WeightLoader, after_weights_processed
from vllm_glm53.quant import w8a8


class Glm5NextMTPLayer(nn.Module):
    def __init__(self, arch: TextArch, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        D, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = ReplicatedLinear(2 * D, D, bias=False, prefix=f"{prefix}.eh_proj")
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attn = Glm5NextSparseMLA(arch, arch.num_layers, True, model_dtype, prefix=f"{prefix}.self_attn")
        if arch.n_routed_experts:
            self.mlp = Glm5NextMoE(arch, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Glm5NextMLP(D, arch.intermediate_size, arch.swiglu_limit, prefix=f"{prefix}.mlp")
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, eps)

    def forward(self, e: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        z, _ = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h_prev)], dim=-1))
        a, _ = self.self_attn(self.input_layernorm(z))
        r = z + a
        return self.shared_head.norm(r + self.mlp(self.post_attention_layernorm(r)))


class Glm5NextMTPModel(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config  # the proposer copies multimodal token ids onto it
        self.arch = text_arch(self.config)
        if self.arch.num_mtp_layers < 1:
            raise CheckpointError("this glm5_next config declares no MTP layer (num_nextn_predict_layers = 0); "
                                  "run without --speculative-config or use a checkpoint that has one")
        # ``model.layers[0]`` is checkpoint layer ``num_hidden_layers``; vLLM's proposer sets
        # ``model.embed_tokens`` and ``lm_head`` to the target's.
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            [Glm5NextMTPLayer(self.arch, vllm_config.model_config.dtype, prefix=f"model.layers.{self.arch.num_layers}")]
        )
        _, stages, _, _ = _vllm.pipeline_stage(self.arch.num_layers)
        self.own_embedding = stages > 1  # vLLM shares the target's embedding only without pipeline parallel
        if self.own_embedding:
            self.model.embed_tokens = VocabParallelEmbedding(self.arch.vocab_size, self.arch.hidden_size,
                                                             prefix="model.embed_tokens")
        # QuaRot leaves the target's final norm weightless (its weight folded into lm_head) and the MTP layer in
        # a rotated basis: ``rot.weight`` maps the hidden state the target hands over to the one the layer needs.
        description = _vllm.read_model_json(vllm_config.model_config, w8a8.DESCRIPTION_FILE)
        D = self.arch.hidden_size
        self.rot = ReplicatedLinear(D, D, bias=False, prefix="rot") if description.get("is_rot_used") else None
        self.logits_processor = LogitsProcessor(self.arch.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None, spec_step_idx: int = 0, **kwargs):
        """Returns ``(hidden for the draft logits, hidden for the next draft step)`` — the same tensor here."""
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        # The token at absolute position 0 has no previous hidden state to pair with.
        e = e.masked_fill((positions == 0).unsqueeze(-1), 0)
        if self.rot is not None:
            hidden_states, _ = self.rot(hidden_states)
        h = self.model.layers[0](e, hidden_states)
        return h, h

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.arch.num_layers
        # Only checkpoint layer N belongs here; the embedding and head are shared with the target, and the MTP
        # layer may carry its own copies of them (``embed_tokens``, ``shared_head.head``), which are not used.
        shared_copies = (f"model.layers.{n}.embed_tokens.", f"model.layers.{n}.shared_head.head.")

        def other(name: str) -> bool:
            # ``rot.weight`` (w8a8 QuaRot) is this module's too: a checkpoint that has it without declaring
            # ``is_rot_used`` fails as an unexpected tensor, one that declares it without it as a missing one.
            mine = name.startswith(f"model.layers.{n}.") or name == w8a8.MTP_ROTATION
            if self.own_embedding and name.startswith("model.embed_tokens."):
                return False
            return not mine or name.startswith(shared_copies)

        loader = WeightLoader(self, num_layers=1, layer_offset=n, skip=other)
        loaded = loader.load(weights)
        if not any(name.startswith("model.layers.") for name in loaded):
            raise CheckpointError(f"the checkpoint has no MTP layer (no tensors under layers.{n}.); "
                                  "run without --speculative-config")
        loader.check_complete()
        return loaded

    def process_weights_after_loading(self) -> None:
        after_weights_processed(self)
