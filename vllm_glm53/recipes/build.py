"""Building a plan from a recipe, a variant, feature requests, parameters and extra arguments."""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from vllm_glm53 import envs, serving
from vllm_glm53.recipes.catalogue import (
    FEATURES,
    HARDWARE,
    Hardware,
    INSTALL,
    RecipeError,
    SERVE,
    TOKENIZER_MODE,
    PLACEHOLDER,
)
from vllm_glm53.recipes.schema import select
from vllm_glm53.recipes.plan import Launch, Plan
from vllm_glm53.recipes.options import merge_options
from vllm_glm53.recipes.rules import RuleContext, check_rules, choose_features, feature_args


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
    chosen, unoffered = choose_features(recipe, hw, features)

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

        return PLACEHOLDER.sub(one, text)

    override_env: dict[str, str] = {}
    override_args: list[str] = []
    for key in (hw.arch, hw.name):  # arch first, then the exact hardware
        if key in recipe.overrides:
            override_env.update(recipe.overrides[key]["env"])
            override_args += recipe.overrides[key]["args"]
    enabled_args = [t for name in FEATURES if name in chosen for t in feature_args(name, chosen[name])]
    shared_env = {**recipe.env, **override_env, **var.env}
    if served_by is not None:
        shared_env["VLLM_GLM53_MODEL"] = served_by

    node_env = [{k: fill(v, node) for k, v in shared_env.items()} for node in range(recipe.nodes)]
    launches = []
    for spec in recipe.launches:
        if spec.kind == "serve":
            program = list(SERVE)
            args = ["${MODEL}", "--tokenizer-mode", TOKENIZER_MODE, *recipe.args, *override_args, *var.args,
                    *spec.args, *enabled_args]
            args = merge_options(args, extra_args)
        else:
            program, args = [spec.run[0]], list(spec.run[1:])
        own = {k: fill(v, spec.node) for k, v in spec.env.items()}
        launches.append(Launch(spec.name, spec.node, spec.kind, [fill(t, spec.node) for t in program],
                               [fill(t, spec.node) for t in args], {**node_env[spec.node], **own}, own))

    serve = [launch for launch in launches if launch.kind == "serve"]
    served = _served(hw, serve)
    check_rules(RuleContext(recipe, hw, var, chosen, serve, served))
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
