"""The command line: ``python -m vllm_glm53.recipes`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from vllm_glm53.recipes.catalogue import FEATURES, RecipeError
from vllm_glm53.recipes.schema import hardware_names, load_recipes, select
from vllm_glm53.recipes.build import build
from vllm_glm53.recipes.cpu import cpu_bind


def _list_table() -> str:
    rows = [("recipe", "hardware", "strategy", "nodes", "variants", "features", "status")]
    for r in load_recipes().values():
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
