"""Option handling on finished ``vllm serve`` argument lists (the rules and extra arguments work on these)."""

from __future__ import annotations

import re
from typing import Sequence

from vllm_glm53.recipes.catalogue import RecipeError


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


def option_name(token: str) -> str | None:
    """The long option a token names, without leading dashes (``no-`` kept), or None for a value."""
    if not token.startswith("-") or re.match(r"^-\d", token):
        return None
    name = token.split("=", 1)[0]
    return OPTION_ALIASES.get(name, name).lstrip("-").replace("_", "-")


def option_key(token: str) -> str | None:
    """The option a token names with its polarity dropped: --no-enable-prefix-caching and
    --enable-prefix-caching are one option, as vLLM's parser sees them."""
    name = option_name(token)
    return name[3:] if name is not None and name.startswith("no-") else name


def option_groups(args: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """Split into (key, tokens) groups: leading positionals under None, then each option with its values."""
    groups: list[tuple[str | None, list[str]]] = []
    for token in args:
        key = option_key(token)
        if key is not None or not groups:
            groups.append((key, [token]))
        else:
            groups[-1][1].append(token)
    return groups


def merge_options(args: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``args`` with every option in ``extra`` replacing the same option (either polarity) already there."""
    extra_groups = option_groups(extra)
    if extra_groups and extra_groups[0][0] is None:
        raise RecipeError(f"extra serve arguments must be options; got {extra_groups[0][1][0]!r} "
                          "(to serve another checkpoint, use --model PATH)")
    replaced = {key for key, _ in extra_groups}
    kept = [tokens for key, tokens in option_groups(args) if key not in replaced]
    return [t for tokens in kept for t in tokens] + [t for _, tokens in extra_groups for t in tokens]


def option_values(args: Sequence[str], option: str) -> list[str | None]:
    """Every occurrence of ``option`` (long form) in ``args``: its value, or None for a flag; ``--no-X`` gives
    the string "no"."""
    want = option_key(option)
    found: list[str | None] = []
    for key, tokens in option_groups(args):
        if key != want:
            continue
        head = tokens[0]
        if "=" in head:
            found.append(head.split("=", 1)[1])
        elif option_name(head).startswith("no-"):
            found.append("no")
        else:
            found.append(tokens[1] if len(tokens) > 1 else None)
    return found


def last_value(args: Sequence[str], option: str) -> str | None:
    values = option_values(args, option)
    return values[-1] if values else None


def has_flag(args: Sequence[str], option: str) -> bool:
    """A boolean flag given and not negated (last occurrence wins, as in argparse)."""
    values = option_values(args, option)
    return bool(values) and values[-1] != "no"
