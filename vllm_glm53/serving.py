"""Who serves GLM-5.3 on a platform: vLLM's own model, vllm-ascend's, or the plugin's.

vLLM 0.32 ships its own GLM5Next (``vllm/models/glm5next``: NVIDIA and AMD op folders, FlashMLA / FlashInfer /
AITER sparse MLA, fla KDA, FusedMoE with EPLB, pipeline parallel, EAGLE3, MTP). Where it runs, the plugin leaves the
model to it and only completes vLLM (tokenizer mode, renderer, parsers, recipes): replacing a validated model with
one that has never run on that hardware would make vLLM worse. vLLM's model cannot run on CPU (CUDA-only ops,
torchvision through glm4_1v) and refuses XPU; there, and on any other platform, the plugin's model serves. On an
Ascend NPU whose vllm-ascend ships GLM5Next, vllm-ascend's model serves.

This module is pure (no vLLM, no torch): ``register()`` asks it with the platform vLLM detected, the recipe builder
asks it with the platform of a hardware entry, so both give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

PLUGIN = "plugin"
VLLM = "vllm"
VLLM_ASCEND = "vllm-ascend"

# vLLM platform names (``_vllm.platform_kind()``) where vLLM's own GLM5Next has op implementations.
VLLM_MODEL_PLATFORMS = ("cuda", "rocm")

DESCRIPTIONS = {
    PLUGIN: "the plugin's model (vllm_glm53.model)",
    VLLM: "vLLM's own GLM5Next (vllm.models.glm5next)",
    VLLM_ASCEND: "vllm-ascend's GLM5Next",
}


class ServingError(ValueError):
    """The requested model cannot serve on this platform."""


@dataclass(frozen=True)
class Serving:
    model: str  # PLUGIN | VLLM | VLLM_ASCEND
    reason: str

    @property
    def plugin_model(self) -> bool:
        return self.model == PLUGIN

    def describe(self) -> str:
        return f"GLM-5.3 is served by {DESCRIPTIONS[self.model]}: {self.reason}"


def decide(platform: str, choice: str = "auto", ascend_model: str | None = None) -> Serving:
    """Which model serves on ``platform`` (``cuda``, ``rocm``, ``cpu``, ``npu``, ``xpu``, ...).

    ``choice`` is ``VLLM_GLM53_MODEL`` (``auto``, ``plugin`` or ``vllm``); ``ascend_model`` the module of
    vllm-ascend's GLM5Next when one is installed on an NPU. Raises :class:`ServingError` for ``vllm`` where no
    vLLM model can run.
    """
    if choice == PLUGIN:
        return Serving(PLUGIN, "VLLM_GLM53_MODEL=plugin")
    if platform == "npu" and ascend_model is not None:
        forced = " (VLLM_GLM53_MODEL=vllm)" if choice == VLLM else " (VLLM_GLM53_MODEL=plugin forces the plugin's)"
        return Serving(VLLM_ASCEND, f"the installed vllm-ascend ships it ({ascend_model}){forced}")
    if platform in VLLM_MODEL_PLATFORMS:
        forced = "VLLM_GLM53_MODEL=vllm" if choice == VLLM else "VLLM_GLM53_MODEL=plugin forces the plugin's"
        why = f"it runs on {platform} ({forced})"
        return Serving(VLLM, why)
    if choice == VLLM:
        where = "on an NPU without a GLM5Next in vllm-ascend" if platform == "npu" else f"on {platform}"
        raise ServingError(
            f"VLLM_GLM53_MODEL=vllm, but vLLM's own GLM5Next cannot run {where} (it has CUDA and ROCm ops only); "
            "unset VLLM_GLM53_MODEL (auto) to serve with the plugin's model")
    return Serving(PLUGIN, f"vLLM's own GLM5Next cannot run on {platform}")


# ---------------------------------------------------------------------------------------------------------------
# What each model can serve. vLLM refuses some options by the model class's interfaces (a model without SupportsPP
# gets no pipeline parallel); other options a model would accept and silently ignore. The plugin's model checks both
# kinds at start-up with :func:`refusals`, and the recipe builder asks the same function of every command it prints,
# so a printed command is one its model serves. tests/test_serving.py pins each interface set to the model class it
# describes (the plugin's classes, and vLLM's own imported on CPU with a stand-in torchvision).
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeOptions:
    """The serve options that decide whether a model can serve, from ``vllm serve`` arguments or a VllmConfig."""

    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    eplb: bool = False
    lora: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # --quantization, or the checkpoint's format (nvfp4, ...)
    speculative_method: str | None = None
    attention_backend: str | None = None
    sparse_indexer_topk_backend: str = "auto"
    prefix_caching: bool = False  # vLLM turns it on by default for this (hybrid) model
    # pipeline stages holding no KDA layer, as "stage (layers a-b)": vLLM's prefix caching for hybrid models
    # ("align" mode) needs hybrid state on every stage (its worker asserts otherwise)
    stages_without_kda: tuple[str, ...] = ()
    platform: str | None = None  # vLLM platform name (cpu, cuda, ...), None where unknown


@dataclass(frozen=True)
class ModelCapabilities:
    name: str  # as in DESCRIPTIONS
    interfaces: frozenset[str]  # vLLM interface class names the model's classes declare
    # options vLLM's interfaces do not cover, each with the reason the model cannot honour it (None: it can)
    fp8_kv_cache: bool
    quantizations: frozenset[str] | None  # None: whatever vLLM's layers take
    own_attention_backends: bool  # ignores --attention-backend / --sparse-indexer-topk-backend
    expert_parallel: bool  # MixtureOfExperts is not enough: the experts must really be partitioned
    eplb: bool  # expert-parallel load balancing (redundant experts, rebalancing)
    # EP (over the TP ranks, or DP x TP) only for unquantized experts and, on CPU, block-FP8 ones (the CPU FP8
    # kernel takes a range of whole experts; FP8 it cannot run is dequantized at load); other quantized kernels
    # (w8a8, FP8 on GPUs) keep every expert
    expert_parallel_unquantized_only: bool
    # speculative decoding together with pipeline parallel, as (platforms, methods), None: any. The plugin's model
    # makes up for what vLLM 0.32's V1 runner lacks there on CPU workers and for MTP only (adapter ledger 10)
    pp_with_speculation: tuple[frozenset[str], frozenset[str]] | None


# Speculative methods that need an interface of the target model (vLLM checks it when the drafter loads).
SPECULATIVE_NEEDS = {"eagle": "SupportsEagle", "eagle3": "SupportsEagle3", "dflash": "SupportsEagle3"}

PLUGIN_MODEL = ModelCapabilities(
    name=PLUGIN,
    interfaces=frozenset({"HasInnerState", "IsHybrid", "SupportsMultiModal", "SupportsPP"}),
    fp8_kv_cache=False,  # the latent cache stores the model dtype (backends/latent_cache.py)
    quantizations=frozenset({"fp8", "glm5_next_fp8", "ascend", "glm5_next_mxfp8"}),
    own_attention_backends=True,
    expert_parallel=True,  # over the DP x TP ranks, unquantized or CPU block-FP8 experts (model/moe.py)
    eplb=False,
    expert_parallel_unquantized_only=True,
    pp_with_speculation=(frozenset({"cpu"}), frozenset({"mtp", "deepseek_mtp"})),
)

VLLM_MODEL = ModelCapabilities(
    name=VLLM,
    interfaces=frozenset({"HasInnerState", "IsHybrid", "SupportsMultiModal", "SupportsPP", "SupportsLoRA",
                          "SupportsEagle3", "MixtureOfExperts"}),
    fp8_kv_cache=True,  # hardware rules (no FP8 KV on Hopper) stay with the recipes
    quantizations=None,
    own_attention_backends=False,
    expert_parallel=True,
    eplb=True,
    expert_parallel_unquantized_only=False,
    pp_with_speculation=None,
)


def state_refusals(options: ServeOptions) -> list[str]:
    """The refusals about the hybrid state that must be decided before vLLM sizes its caches, whichever model
    serves (vLLM's own engine asserts on them; the plugin's config hook raises them at start-up first, and
    :func:`refusals` includes them)."""
    if options.prefix_caching and options.stages_without_kda:
        return [f"prefix caching (vLLM's default for this model, or --enable-prefix-caching) with "
                f"--pipeline-parallel-size {options.pipeline_parallel_size}: pipeline stage "
                f"{', '.join(options.stages_without_kda)} holds no KDA layer, and vLLM keeps prefix-cache state "
                "snapshots only on stages that have one; choose VLLM_PP_LAYER_PARTITION so that every stage has "
                "a KDA layer, or add --no-enable-prefix-caching (LLM(enable_prefix_caching=False))"]
    return []


def refusals(model: ModelCapabilities, options: ServeOptions) -> list[str]:
    """Why ``model`` cannot serve with ``options``: one sentence per refused option, naming the flag."""
    who = DESCRIPTIONS[model.name]
    out = state_refusals(options)
    if options.pipeline_parallel_size > 1 and "SupportsPP" not in model.interfaces:
        out.append(f"--pipeline-parallel-size {options.pipeline_parallel_size}: {who} has no pipeline parallel")
    if options.lora and "SupportsLoRA" not in model.interfaces:
        out.append(f"--enable-lora: {who} does not support LoRA adapters")
    need = SPECULATIVE_NEEDS.get(options.speculative_method or "")
    if need and need not in model.interfaces:
        out.append(f"--speculative-config method {options.speculative_method}: the drafter needs {need} (the "
                   f"target's auxiliary hidden states), which {who} does not provide; use method mtp")
    if options.pipeline_parallel_size > 1 and options.speculative_method and model.pp_with_speculation:
        platforms, methods = model.pp_with_speculation
        flags = (f"--speculative-config method {options.speculative_method} with --pipeline-parallel-size "
                 f"{options.pipeline_parallel_size}")
        if options.platform is not None and options.platform not in platforms:
            out.append(f"{flags}: {who} pipelines drafts on {', '.join(sorted(platforms))} workers only (vLLM 0.32's "
                       "V1 model runner cannot, and the plugin makes up for it there); use one or the other")
        elif options.speculative_method not in methods:
            out.append(f"{flags}: {who} pipelines its own MTP drafts only (method mtp); use one or the other")
    if options.expert_parallel and not model.expert_parallel:
        out.append(f"--enable-expert-parallel: {who} does not partition experts across ranks (every rank would keep "
                   "a tensor-parallel slice of every expert)")
    if options.expert_parallel and model.expert_parallel and model.expert_parallel_unquantized_only:
        partitioned = options.platform == "cpu" and options.quantization in (None, "fp8", "glm5_next_fp8")
        if options.quantization is not None and not partitioned:
            out.append(f"--enable-expert-parallel with quantization {options.quantization}: {who} partitions "
                       "unquantized experts only (and block-FP8 ones on CPU)")
    if options.eplb and not model.eplb:
        out.append(f"--enable-eplb: {who} has no expert-parallel load balancing")
    if options.kv_cache_dtype.startswith("fp8") and not model.fp8_kv_cache:
        out.append(f"--kv-cache-dtype {options.kv_cache_dtype}: {who} keeps its latent cache in the model dtype")
    if model.quantizations is not None and options.quantization not in (None, *model.quantizations):
        out.append(f"quantization {options.quantization}: {who} loads BF16, block-FP8 and msmodelslim w8a8 "
                   "checkpoints only")
    if model.own_attention_backends and options.attention_backend:
        out.append(f"--attention-backend {options.attention_backend}: {who} runs its own attention backends and "
                   "would ignore it")
    if model.own_attention_backends and options.sparse_indexer_topk_backend not in ("", "auto"):
        out.append(f"--sparse-indexer-topk-backend {options.sparse_indexer_topk_backend}: {who} runs its own "
                   "indexer and would ignore it")
    return out


def capabilities(model: str) -> ModelCapabilities:
    """What ``model`` (PLUGIN, VLLM or VLLM_ASCEND) can serve. vllm-ascend's GLM5Next is taken to serve what
    vLLM's does; the Ascend recipes' own rules (block size, quantization names) narrow it."""
    return PLUGIN_MODEL if model == PLUGIN else VLLM_MODEL
