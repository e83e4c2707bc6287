"""GLM-5.3-Flash text model for vLLM: embedding, mHC-wrapped decoder blocks, final norm, LM head.

    X = [embed(ids)] * hc_mult                               (mHC residual streams)
    for each layer:  X = mHC(X, KDA | sparse MLA, input_layernorm)
                     X = mHC(X, dense MLP | MoE, post_attention_layernorm)
    h = norm(mean over streams of X);  logits = lm_head(h)

The language model uses no positional encoding at all; ``positions`` only feed the indexer's pool
arithmetic (through the attention metadata).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import (
    HasInnerState,
    IntermediateTensors,
    IsHybrid,
    MULTIMODAL_REGISTRY,
    LogitsProcessor,
    ParallelLMHead,
    PPMissingLayer,
    SupportsMultiModal,
    SupportsPP,
    VocabParallelEmbedding,
    serve_options,
)
from vllm_glm53.config import TextArch, text_arch
from vllm_glm53.model.kda import Glm5NextKDA, kda_state_dtypes, kda_state_shapes
from vllm_glm53.model.mhc import MHCBlock
from vllm_glm53.model.mla import Glm5NextSparseMLA
from vllm_glm53.model.moe import Glm5NextMLP, Glm5NextMoE
from vllm_glm53.model.multimodal import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    Glm5NextDummyInputsBuilder,
    Glm5NextMultiModalProcessor,
    Glm5NextProcessingInfo,
)
from vllm_glm53.model.norm import RMSNorm
from vllm_glm53.model.vision import Glm5NextVisionTower, vision_arch
from vllm_glm53.model.weights import WeightLoader, after_weights_processed, before_weights_processed
from vllm_glm53.serving import PLUGIN_MODEL, refusals


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, arch: TextArch, idx: int, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.is_kda = arch.is_kda(idx)
        self.shares_selection = not self.is_kda and arch.indexer_types[idx] == "shared"
        D, eps = arch.hidden_size, arch.rms_norm_eps
        hc = dict(hidden_size=D, hc_mult=arch.hc_mult, hc_eps=arch.hc_eps, sinkhorn_iters=arch.hc_sinkhorn_iters,
                  norm_eps=eps)
        self.attn_hc = MHCBlock(**hc)
        self.ffn_hc = MHCBlock(**hc)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if self.is_kda:
            self.self_attn = Glm5NextKDA(arch, idx, model_dtype, prefix=f"{prefix}.self_attn")
        else:
            self.self_attn = Glm5NextSparseMLA(arch, idx, not self.shares_selection, model_dtype,
                                               prefix=f"{prefix}.self_attn")
        if arch.is_moe(idx):
            self.mlp = Glm5NextMoE(arch, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Glm5NextMLP(D, arch.intermediate_size, arch.swiglu_limit, prefix=f"{prefix}.mlp")

    def forward(self, X: torch.Tensor, selection):
        """``X [T, n, D]`` residual streams -> new streams, and the sparse selection for later shared layers."""
        u, post, comb = self.attn_hc.pre(X)
        h = self.input_layernorm(u)
        if self.is_kda:
            y = self.self_attn(h)
        else:
            y, selection = self.self_attn(h, selection if self.shares_selection else None)
        X = self.attn_hc.post(X, y, post, comb)
        u, post, comb = self.ffn_hc.pre(X)
        y = self.mlp(self.post_attention_layernorm(u))
        return self.ffn_hc.post(X, y, post, comb), selection


class Glm5NextModel(nn.Module):
    """The decoder stack, or this pipeline stage's part of it.

    With pipeline parallel each stage builds only its layers (vLLM's split, :func:`_vllm.pipeline_stage`); the
    others are ``PPMissingLayer`` placeholders with no parameters, as are the embedding off the first stage and
    the final norm off the last. What crosses a stage boundary is the model's whole state between two layers:
    the mHC residual streams ``[T, hc_mult, D]`` and, when the next stage's first MLA layer is a ``shared``
    one, the selection of the last ``full`` layer before the boundary (``[T, index width]`` int64).
    """

    STREAMS = "hc_streams"
    SELECTION = "shared_selection"

    def __init__(self, arch: TextArch, model_dtype: torch.dtype, prefix: str = "model") -> None:
        super().__init__()
        self.arch = arch
        rank, size, self.start_layer, self.end_layer = _vllm.pipeline_stage(arch.num_layers)
        self.is_first_stage, self.is_last_stage = rank == 0, rank == size - 1
        self.receives_selection = not self.is_first_stage and arch.selection_in_flight(self.start_layer)
        self.sends_selection = not self.is_last_stage and arch.selection_in_flight(self.end_layer)
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, prefix=f"{prefix}.embed_tokens")
                             if self.is_first_stage else PPMissingLayer())
        self.layers = nn.ModuleList(
            Glm5NextDecoderLayer(arch, i, model_dtype, prefix=f"{prefix}.layers.{i}")
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (canonical, flat) belongs to this stage."""
        if name.startswith("model.embed_tokens."):
            return self.is_first_stage
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return self.is_last_stage
        m = _LAYER_INDEX.match(name)
        if m is not None and int(m.group(1)) < self.arch.num_layers:
            return self.start_layer <= int(m.group(1)) < self.end_layer
        return True

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        """The receive buffer of this stage (vLLM slices it to each step's tokens)."""
        a = self.arch
        tensors = {self.STREAMS: torch.zeros(batch_size, a.hc_mult, a.hidden_size, dtype=dtype, device=device)}
        if self.receives_selection:
            tensors[self.SELECTION] = torch.full((batch_size, a.index_select_width), -1, dtype=torch.int64,
                                                 device=device)
        return IntermediateTensors(tensors)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None):
        selection = None
        if self.is_first_stage:
            e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            X = e.unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        else:
            X = intermediate_tensors[self.STREAMS]
            if self.receives_selection:
                selection = intermediate_tensors[self.SELECTION]
        for layer in self.layers[self.start_layer:self.end_layer]:
            X, selection = layer(X, selection)
        if not self.is_last_stage:
            out = {self.STREAMS: X}
            if self.sends_selection:
                # the selection covers the step's scheduled tokens; pad rows (if any) select nothing
                pad = X.shape[0] - selection.shape[0]
                out[self.SELECTION] = torch.nn.functional.pad(selection, (0, 0, 0, pad), value=-1) if pad else selection
            return IntermediateTensors(out)
        # Final collapse is a plain mean over the streams (no learned head weights in GLM-5.3).
        h = X.to(torch.float32).mean(dim=1).to(X.dtype)
        return self.norm(h)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def check_serve_options(vllm_config) -> None:
    """Refuse at start-up, naming the flag, what this model would otherwise fail on later or silently ignore
    (the recipe builder applies the same :func:`~vllm_glm53.serving.refusals` to the commands it prints)."""
    problems = refusals(PLUGIN_MODEL, serve_options(vllm_config))
    if problems:
        raise ValueError("vllm-glm53: the plugin's GLM-5.3 model cannot serve this configuration: "
                         + "; ".join(problems) + ". On CUDA/ROCm, vLLM's own model serves these (unset "
                         "VLLM_GLM53_MODEL).")


class Glm5NextForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsPP):
    """Flat (text-only) checkpoints: ``model.*`` and ``lm_head``. The LM head lives on the last pipeline stage."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        check_serve_options(vllm_config)
        _vllm.cpu_pp_receive_buffer(vllm_config)
        _vllm.cpu_align_spec_copies(vllm_config)
        _vllm.cpu_pp_speculation(vllm_config)
        before_weights_processed()
        hf_config = vllm_config.model_config.hf_config
        self.arch = text_arch(hf_config)
        self.model_dtype = vllm_config.model_config.dtype
        self.model = Glm5NextModel(self.arch, self.model_dtype, prefix="model")
        self.lm_head = (ParallelLMHead(self.arch.vocab_size, self.arch.hidden_size, prefix="lm_head")
                        if self.model.is_last_stage else PPMissingLayer())
        self.logits_processor = LogitsProcessor(self.arch.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, inputs_embeds, intermediate_tensors)

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        return self.model.make_empty_intermediate_tensors(batch_size, dtype, device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = WeightLoader(self, self.arch.num_layers,
                              skip=lambda name: name.startswith("model.visual.") or not self.model.owns(name))
        loaded = loader.load(weights)
        loader.check_complete()
        return loaded

    def process_weights_after_loading(self) -> None:
        after_weights_processed(self)

    # --- hybrid-state sizing (vLLM asks before building the model) ---------------------------------------------

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        arch = text_arch(vllm_config.model_config.hf_config)
        return kda_state_shapes(arch, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return kda_state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        # one whole state per draft slot: a copy is slot to slot (the adapter says how vLLM is told so)
        return _vllm.kda_state_copy_funcs()


@MULTIMODAL_REGISTRY.register_processor(
    Glm5NextMultiModalProcessor, info=Glm5NextProcessingInfo, dummy_inputs=Glm5NextDummyInputsBuilder
)
class Glm5NextForConditionalGeneration(Glm5NextForCausalLM, SupportsMultiModal):
    """Nested (released) checkpoints: ``model.language_model.*``, ``model.visual.*``, ``lm_head``.

    The language part is the same model; checkpoint names are normalised by the weight loader. Images and
    videos go through the vision tower (``visual``, :mod:`.vision`) into the rows of their placeholder
    tokens (:mod:`.multimodal` expands the prompt). With ``--limit-mm-per-prompt '{"image":0,"video":0}'`` the
    tower is not built at all and its checkpoint tensors are skipped.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mm_config = vllm_config.model_config.multimodal_config
        # vLLM runs the encoder on the first pipeline stage only
        wanted = mm_config is not None and any(mm_config.get_limit_per_prompt(m) > 0 for m in ("image", "video"))
        if wanted and self.model.is_first_stage:
            self.visual = Glm5NextVisionTower(vision_arch(vllm_config.model_config.hf_config), prefix="visual")
        else:
            self.visual = None
        # vLLM's MTP proposer reads the target's ``config.image_token_index`` (its generic name for the image
        # placeholder id) and drafts through ``get_language_model()``.
        self.config = vllm_config.model_config.hf_config
        if getattr(self.config, "image_token_index", None) is None:
            self.config.image_token_index = self.config.image_token_id

    def get_language_model(self) -> nn.Module:
        return self  # the text model lives here (``model``, ``lm_head``); ``visual`` is beside it

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}.get(modality)

    def embed_multimodal(self, **kwargs) -> list[torch.Tensor]:
        """Features of one modality batch, one ``[tokens, hidden]`` tensor per item, in item order."""
        for pixels_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            pixels = kwargs.get(pixels_key)
            if pixels is None:
                continue
            grids = [tuple(int(v) for v in g) for g in kwargs[grid_key]]
            features = self.visual(pixels, grids)
            merge = self.visual.arch.merge_area
            return list(features.split([t * h * w // merge for t, h, w in grids]))
        return []

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        features = torch.cat(list(multimodal_embeddings)).to(embeds.dtype)
        if int(is_multimodal.sum()) != features.shape[0]:
            raise ValueError(f"{int(is_multimodal.sum())} placeholder tokens for {features.shape[0]} feature rows")
        return embeds.masked_scatter(is_multimodal.unsqueeze(-1), features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        visual_tensors: list[tuple[str, torch.Tensor]] = []

        def text_tensors():
            for name, tensor in weights:
                if name.startswith("model.visual."):
                    if self.visual is not None:
                        visual_tensors.append((name[len("model.visual."):], tensor))
                else:
                    yield name, tensor

        loader = WeightLoader(self, self.arch.num_layers, skip=lambda name: not self.model.owns(name))
        loaded = set(loader.load(text_tensors()))
        loader.check_complete(optional=[n for n in loader.params if n.startswith("visual.")])
        if self.visual is not None:
            loaded |= {f"visual.{n}" for n in self.visual.load_weights(visual_tensors)}
        return loaded
