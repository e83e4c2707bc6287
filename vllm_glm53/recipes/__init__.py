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

Modules: ``catalogue`` (hardware, checkpoint formats, features), ``schema`` (the YAML schema, loading, selection),
``options`` (reading finished argument lists), ``rules`` (features and the rules), ``build`` (the plan),
``plan`` (launches and the printed script), ``cpu`` (thread binding, the tiny-checkpoint plan), ``cli``.
"""

from vllm_glm53.recipes.build import build
from vllm_glm53.recipes.catalogue import FEATURES, HARDWARE, WEIGHTS, RecipeError
from vllm_glm53.recipes.cli import main
from vllm_glm53.recipes.cpu import cpu_bind, cpu_plan
from vllm_glm53.recipes.options import OPTION_ALIASES, option_values
from vllm_glm53.recipes.plan import Launch, Plan
from vllm_glm53.recipes.rules import RULES, serve_options
from vllm_glm53.recipes.schema import Recipe, Variant, hardware_names, load_recipes, select

__all__ = ["FEATURES", "HARDWARE", "OPTION_ALIASES", "RULES", "WEIGHTS", "Launch", "Plan", "Recipe", "RecipeError",
           "Variant", "build", "cpu_bind", "cpu_plan", "hardware_names", "load_recipes", "main", "option_values",
           "select", "serve_options"]
