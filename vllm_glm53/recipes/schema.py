"""The recipe schema (recipes/README.md), loading the YAML files, and picking one recipe and variant."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Mapping

import yaml

from vllm_glm53.recipes.catalogue import (
    ALWAYS_OFFERED,
    ARCHES,
    BUILTIN_PARAMS,
    FEATURES,
    FEATURE_STATES,
    HARDWARE,
    RecipeError,
    STATUSES,
    WEIGHTS,
    NODE_IP_PARAM,
    PLACEHOLDER,
)


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
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or name in BUILTIN_PARAMS or NODE_IP_PARAM.match(name):
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
            for name in PLACEHOLDER.findall(text):
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
        checkout = Path(__file__).resolve().parents[2] / "recipes"
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
