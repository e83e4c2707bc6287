"""Features (what each turns on) and the rules every finished plan must pass."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

from vllm_glm53 import serving
from vllm_glm53.recipes.catalogue import (
    DFLASH_DRAFTER,
    DFLASH_TOKENS,
    FEATURES,
    Hardware,
    MTP_MAX_TOKENS,
    PARSER,
    RecipeError,
    TOKENIZER_MODE,
)
from vllm_glm53.recipes.schema import FeatureConfig, Recipe, Variant
from vllm_glm53.recipes.plan import Launch
from vllm_glm53.recipes.options import has_flag, last_value


def feature_args(name: str, cfg: FeatureConfig) -> list[str]:
    if name == "tools":
        return ["--tool-call-parser", PARSER, "--enable-auto-tool-choice"]
    if name == "reasoning":
        return ["--reasoning-parser", PARSER]
    if name == "mtp":
        spec = {"method": cfg.method, "num_speculative_tokens": cfg.tokens, **cfg.extra}
        return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if name == "dflash":
        spec = {"method": "dflash", "model": DFLASH_DRAFTER, "num_speculative_tokens": DFLASH_TOKENS}
        return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if name == "fp8-kv":
        return ["--kv-cache-dtype", "fp8"]
    if name == "expert-parallel":
        return ["--enable-expert-parallel"]
    if name == "aiter-topk":
        return ["--sparse-indexer-topk-backend", "aiter"]
    raise AssertionError(name)


def _unoffered_config(name: str, hw: Hardware) -> FeatureConfig:
    """How a feature would render where a recipe does not offer it (so a rule can explain why)."""
    if name == "mtp":
        if hw.platform == "ascend":
            return FeatureConfig("optional", "deepseek_mtp", 3, {"enforce_eager": True})
        return FeatureConfig("optional", "mtp", MTP_MAX_TOKENS)
    return FeatureConfig("optional")


@dataclass(frozen=True)
class RuleContext:
    recipe: Recipe
    hw: Hardware
    variant: Variant
    features: Mapping[str, FeatureConfig]
    serve: Sequence[Launch]
    served: serving.Serving


def _rule_one_drafter(c: RuleContext) -> str | None:
    """One speculative decoder at a time: mtp and dflash each emit --speculative-config."""
    if "mtp" in c.features and "dflash" in c.features:
        return "mtp and dflash both set --speculative-config; pick one (--feature no-mtp --feature dflash)"
    return None


def _rule_mtp_tokens(c: RuleContext) -> str | None:
    """MTP drafts 1 to 5 tokens (one MTP layer, re-applied; upstream validated up to 5)."""
    cfg = c.features.get("mtp")
    if cfg is not None and not 1 <= cfg.tokens <= MTP_MAX_TOKENS:
        return f"mtp={cfg.tokens}: MTP drafts 1 to {MTP_MAX_TOKENS} tokens"
    return None


def _rule_mtp_method(c: RuleContext) -> str | None:
    """MTP is method mtp, except on Ascend: deepseek_mtp with enforce_eager (no graph-mode drafting there)."""
    cfg = c.features.get("mtp")
    if cfg is None:
        return None
    if c.hw.platform == "ascend":
        if cfg.method != "deepseek_mtp" or cfg.extra.get("enforce_eager") is not True:
            return "on Ascend, MTP is method deepseek_mtp with enforce_eager: true"
    elif cfg.method != "mtp":
        return f"MTP is method mtp on {c.hw.platform}, not {cfg.method}"
    return None


def _rule_dflash_platform(c: RuleContext) -> str | None:
    """The DFlash2 drafter runs on NVIDIA GPUs only (unsupported on AMD; not ported to Ascend or CPU)."""
    if "dflash" in c.features and c.hw.platform != "cuda":
        return f"the DFlash2 drafter runs on NVIDIA GPUs only, not on {c.hw.display}"
    return None


def _rule_fp8_kv(c: RuleContext) -> str | None:
    """No FP8 KV cache on Hopper (sparse-MLA start-up failure, vllm#57713). (Where the plugin's model serves, CPU
    included, the serving-model rule refuses it: its latent cache stays in the model dtype.)"""
    for launch in c.serve:
        dtype = last_value(launch.args, "--kv-cache-dtype")
        if dtype and dtype.startswith("fp8") and c.hw.arch == "hopper":
            return (f"FP8 KV cache is not supported on Hopper ({c.hw.display}) for this model: "
                    "run the KV cache in BF16 (vllm#57713)")
    return None


def _rule_ascend_quantization(c: RuleContext) -> str | None:
    """On Ascend: --quantization ascend is for msmodelslim w8a8 checkpoints only, and they need it. The native
    FP8 checkpoint is re-grouped to MXFP8 at load; --quantization ascend would look for
    quant_model_description.json instead."""
    if c.hw.platform != "ascend":
        return None
    for launch in c.serve:
        quant = last_value(launch.args, "--quantization")
        if c.variant.weights == "fp8-block" and quant == "ascend":
            return ("do not pass --quantization ascend with the FP8 checkpoint: on Ascend its block scales are "
                    "re-grouped to MXFP8 at load, and the ascend method expects an msmodelslim checkpoint")
        if c.variant.weights == "w8a8" and quant != "ascend":
            return "the msmodelslim w8a8 checkpoint needs --quantization ascend"
    return None


def _rule_ascend_block_size(c: RuleContext) -> str | None:
    """On Ascend the kpool indexer needs --block-size 512."""
    if c.hw.platform == "ascend":
        for launch in c.serve:
            if last_value(launch.args, "--block-size") != "512":
                return "on Ascend, --block-size 512 is required (kpool indexer)"
    return None


def _rule_ascend_950_ep(c: RuleContext) -> str | None:
    """Expert parallel is not available on the Ascend 950 interconnect."""
    if c.hw.arch == "ascend-950" and any(has_flag(launch.args, "--enable-expert-parallel") for launch in c.serve):
        return "expert parallel is not available on the Ascend 950 interconnect; serve with TP8 only"
    return None


def _rule_nvfp4_blackwell(c: RuleContext) -> str | None:
    """NVFP4 checkpoints need Blackwell."""
    if c.variant.weights == "nvfp4" and c.hw.arch != "blackwell":
        return f"the NVFP4 checkpoint needs Blackwell GPUs, not {c.hw.display}"
    return None


def _rule_memory(c: RuleContext) -> str | None:
    """The devices holding one copy of the weights must have the memory the variant needs."""
    need, per_device = c.variant.memory_gb, c.hw.memory_gb
    if need is None or per_device is None or c.recipe.devices is None:
        return None
    have = c.recipe.devices * per_device
    if need > have:
        return (f"variant {c.variant.name} needs about {need:g} GB but {c.recipe.devices} x {c.hw.display} "
                f"has {have:g} GB; pick another variant or a recipe with more devices")
    return None


def _rule_cpu_launch(c: RuleContext) -> str | None:
    """On CPU: eager mode, a bounded --max-model-len (the checkpoint says 1,048,576) and an explicit KV budget."""
    if c.hw.platform != "cpu":
        return None
    for launch in c.serve:
        if not has_flag(launch.args, "--enforce-eager"):
            return "on CPU, pass --enforce-eager"
        if last_value(launch.args, "--max-model-len") is None:
            return "on CPU, pass a small --max-model-len (the checkpoint declares 1,048,576)"
        if last_value(launch.args, "--kv-cache-memory-bytes") is None and "VLLM_CPU_KVCACHE_SPACE" not in launch.env:
            return "on CPU, set the KV budget: --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE"
    return None


def _rule_python_frontend(c: RuleContext) -> str | None:
    """The plugin's tokenizer mode, renderer and parsers run in the Python front-end, not the Rust one."""
    for launch in c.serve:
        if launch.env.get("VLLM_USE_RUST_FRONTEND", "0").strip() not in ("", "0"):
            return ("VLLM_USE_RUST_FRONTEND must be 0: the plugin's glm5_next renderer and parsers run in the "
                    "Python front-end")
    return None


def _rule_glm_flags(c: RuleContext) -> str | None:
    """Every serve command uses the glm5_next tokenizer mode (the plugin's chat format)."""
    for launch in c.serve:
        if last_value(launch.args, "--tokenizer-mode") != TOKENIZER_MODE:
            return f"--tokenizer-mode must be {TOKENIZER_MODE}"
    return None


_WEIGHTS_QUANTIZATION = {"fp8-block": "fp8", "nvfp4": "nvfp4", "w8a8": "ascend"}  # checkpoint -> vLLM method


def serve_options(args: Sequence[str], weights: str, platform: str | None = None) -> serving.ServeOptions:
    """What :func:`serving.refusals` judges, read from a finished ``vllm serve`` argument list (``platform``: the
    hardware's vLLM platform name)."""
    spec = last_value(args, "--speculative-config")
    method = None
    if spec:
        try:
            method = json.loads(spec).get("method")
        except (ValueError, AttributeError):
            raise RecipeError(f"--speculative-config is not a JSON object: {spec}") from None
    attention = last_value(args, "--attention-backend")
    config = last_value(args, "--attention-config")
    if attention is None and config:
        try:
            attention = json.loads(config).get("backend")
        except (ValueError, AttributeError):
            raise RecipeError(f"--attention-config is not a JSON object: {config}") from None
    return serving.ServeOptions(
        pipeline_parallel_size=int(last_value(args, "--pipeline-parallel-size") or 1),
        data_parallel_size=int(last_value(args, "--data-parallel-size") or 1),
        platform=platform,
        expert_parallel=has_flag(args, "--enable-expert-parallel"),
        eplb=has_flag(args, "--enable-eplb"),
        lora=has_flag(args, "--enable-lora"),
        kv_cache_dtype=last_value(args, "--kv-cache-dtype") or "auto",
        quantization=last_value(args, "--quantization") or _WEIGHTS_QUANTIZATION.get(weights),
        speculative_method=method,
        attention_backend=attention,
        sparse_indexer_topk_backend=last_value(args, "--sparse-indexer-topk-backend") or "auto",
        prefix_caching=last_value(args, "--enable-prefix-caching") != "no",  # vLLM's default for this model: on
    )


def _rule_serving_model(c: RuleContext) -> str | None:
    """Every printed command is one its model serves (serving.refusals: the plugin's model runs the same check at
    start-up)."""
    model = serving.capabilities(c.served.model)
    for launch in c.serve:
        problems = serving.refusals(model, serve_options(launch.args, c.variant.weights, c.hw.platform))
        if problems:
            return "; ".join(problems)
    return None


RULES: list[tuple[str, Callable[[RuleContext], str | None]]] = [
    ("one-drafter", _rule_one_drafter),
    ("mtp-tokens", _rule_mtp_tokens),
    ("mtp-method", _rule_mtp_method),
    ("dflash-platform", _rule_dflash_platform),
    ("fp8-kv", _rule_fp8_kv),
    ("ascend-quantization", _rule_ascend_quantization),
    ("ascend-block-size", _rule_ascend_block_size),
    ("ascend-950-ep", _rule_ascend_950_ep),
    ("nvfp4-blackwell", _rule_nvfp4_blackwell),
    ("memory", _rule_memory),
    ("cpu-launch", _rule_cpu_launch),
    ("python-frontend", _rule_python_frontend),
    ("glm-flags", _rule_glm_flags),
    ("serving-model", _rule_serving_model),
]


def check_rules(context: RuleContext) -> None:
    for name, rule in RULES:
        message = rule(context)
        if message:
            raise RecipeError(f"{message} [rule {name}]")


def _feature_request(text: str) -> tuple[str, bool, int | None]:
    """Parse ``NAME``, ``no-NAME`` or ``NAME=VALUE`` into (name, on, value)."""
    name, _, value = text.partition("=")
    on = not name.startswith("no-")
    name = name if on else name[3:]
    if name not in FEATURES:
        known = "; ".join(f"{f.name}{'[=N]' if f.takes_value else ''}: {f.help}" for f in FEATURES.values())
        raise RecipeError(f"unknown feature {text!r}; valid (prefix no- to turn off): {known}")
    if not value:
        return name, on, None
    if not on or not FEATURES[name].takes_value:
        raise RecipeError(f"feature {text!r} takes no value")
    try:
        return name, on, int(value)
    except ValueError:
        raise RecipeError(f"feature {text!r}: {value!r} is not an integer") from None


def choose_features(recipe: Recipe, hw: Hardware, requests: Iterable[str]
                     ) -> tuple[dict[str, FeatureConfig], list[str]]:
    """Enabled features after the requests, and requested features the recipe does not offer."""
    chosen = {n: cfg for n, cfg in recipe.features.items() if cfg.state in ("default", "required")}
    unoffered = []
    for text in requests:
        name, on, value = _feature_request(text)
        if not on:
            if recipe.features.get(name, FeatureConfig("optional")).state == "required":
                raise RecipeError(f"feature {name} is required by recipe {recipe.id} and cannot be turned off")
            chosen.pop(name, None)
            continue
        cfg = recipe.features.get(name)
        if cfg is None:
            cfg = _unoffered_config(name, hw)
            unoffered.append(name)
        chosen[name] = replace(cfg, tokens=value) if value is not None else chosen.get(name, cfg)
    return chosen, unoffered
