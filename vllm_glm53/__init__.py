"""vllm-glm53: GLM-5.3-Flash (``glm5_next``) for stock vLLM.

``register`` is the only entry point (``vllm.general_plugins``: ``glm53 = vllm_glm53:register``). vLLM calls
it once in every process it starts (front-end, model-inspection subprocess, engine core, workers), so it
must stay cheap: it registers lazy ``module:Class`` strings and imports no model code, no torch kernels.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logger = logging.getLogger("vllm_glm53")

# What the plugin registers, by vLLM registry. Values are (module, class) and are imported lazily by vLLM.
MODELS = {
    "Glm5NextForCausalLM": ("vllm_glm53.model", "Glm5NextForCausalLM"),
    "Glm5NextForConditionalGeneration": ("vllm_glm53.model", "Glm5NextForConditionalGeneration"),
    "Glm5NextMTPModel": ("vllm_glm53.model", "Glm5NextMTPModel"),
}
TOKENIZER_MODES: dict[str, tuple[str, str]] = {
    "glm5_next": ("vllm_glm53.chat.tokenizer", "Glm5NextTokenizer"),
}
RENDERERS: dict[str, tuple[str, str]] = {
    "glm5_next": ("vllm_glm53.chat.renderer", "Glm5NextRenderer"),
}
# glm45 and glm47 are one parser (as in vLLM, where both names map to the GLM-4.7 parser).
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "glm47": ("vllm_glm53.parsers.tool", "Glm47ToolParser"),
    "glm45": ("vllm_glm53.parsers.tool", "Glm47ToolParser"),
}
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "glm47": ("vllm_glm53.parsers.reasoning", "Glm47ReasoningParser"),
    "glm45": ("vllm_glm53.parsers.reasoning", "Glm47ReasoningParser"),
}

# Model types whose architecture facts (cache row size, not vLLM's MLA) the plugin reports to vLLM
# (see _vllm.register_text_arch).
TEXT_ARCH_MODEL_TYPES = ("glm5_next", "glm5_next_text")

_registered: list[str] | None = None


def _cache_row_size(hf_text_config) -> int:
    from vllm_glm53.config import text_arch

    return text_arch(hf_text_config).cache_row_size


def _check_engine_config(vllm_config) -> None:
    """Runs where vLLM runs a model's own config checks, before its hybrid-state hook sizes prefix-cache blocks:
    refuses what the plugin's state handling cannot serve, naming the flags."""
    from vllm_glm53 import _vllm, serving

    problems = serving.state_refusals(_vllm.serve_options(vllm_config))
    if problems:
        raise ValueError("vllm-glm53: " + "; ".join(problems))
    if _vllm.platform_kind() == "cpu":
        # Before vLLM spawns its engine and workers, which inherit LD_PRELOAD (vllm_glm53/cpu_malloc.py says why).
        from vllm_glm53 import cpu_malloc

        cpu_malloc.preload_tcmalloc()
    if _vllm.serial_pipeline_steps(vllm_config):
        logger.info("vllm-glm53: drafts with pipeline parallel: one step in flight at a time (vLLM 0.32's V1 "
                    "runner cannot pipeline drafts; the stages do not overlap)")
    if _vllm.cpu_ray_executor(vllm_config):
        logger.info("vllm-glm53: Ray on CPU: each Ray node offers its ranks as the resource %r (ray start "
                    "--resources '{\"%s\": N}')", _vllm.CPU_RAY_RESOURCE, _vllm.CPU_RAY_RESOURCE)


def register() -> list[str]:
    """Register the plugin's pieces with vLLM. Idempotent; ``VLLM_GLM53_DISABLE=1`` turns it off.

    The model classes (and the cache-row sizing and quantization configs that belong to them) are registered only
    where the plugin's model serves (:mod:`vllm_glm53.serving`); the tokenizer mode, renderer and parsers
    everywhere. Returns the list of what was registered (empty when disabled).
    """
    global _registered
    from vllm_glm53 import _vllm, envs

    _vllm.use_vllm_log(logger.name)
    if envs.flag("VLLM_GLM53_DISABLE"):
        logger.info("vllm-glm53: VLLM_GLM53_DISABLE is set; nothing registered")
        return []
    if _registered is not None:
        return _registered

    from vllm_glm53 import serving

    served = serving.decide(_vllm.platform_kind(), envs.VLLM_GLM53_MODEL, _vllm.ascend_glm5next_module())
    done: list[str] = []
    if served.plugin_model:
        for arch, target in MODELS.items():
            _vllm.register_model(arch, *target)
            done.append(f"model {arch}")
        if _vllm.register_text_arch(TEXT_ARCH_MODEL_TYPES, _cache_row_size):
            done.append("text arch " + "/".join(TEXT_ARCH_MODEL_TYPES))
        if _vllm.register_config_hook(tuple(MODELS), _check_engine_config):
            done.append("config hook " + "/".join(MODELS))
        if _vllm.install_serial_pipeline_steps():
            done.append("serial pipeline steps for drafts")
    for mode, target in TOKENIZER_MODES.items():
        _vllm.register_tokenizer_mode(mode, *target)
        done.append(f"tokenizer-mode {mode}")
    for mode, target in RENDERERS.items():
        if _vllm.register_renderer(mode, *target):
            done.append(f"renderer {mode}")
    for name, target in TOOL_PARSERS.items():
        _vllm.register_tool_parser(name, *target)
        done.append(f"tool-parser {name}")
    for name, target in REASONING_PARSERS.items():
        _vllm.register_reasoning_parser(name, *target)
        done.append(f"reasoning-parser {name}")
    from vllm_glm53.quant.configs import register_configs

    quantization, fp8_note = register_configs(served)
    done += quantization

    _registered = done
    # One line that says which model serves and why, and what was registered.
    logger.info("vllm-glm53 %s: %s%s; registered: %s", __version__, served.describe(),
                f"; {fp8_note}" if fp8_note else "", ", ".join(done))
    return done
