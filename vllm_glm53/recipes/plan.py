"""A finished plan: its launches, and the shell script that runs them."""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field

from vllm_glm53 import serving
from vllm_glm53.recipes.catalogue import HARDWARE, STATUSES, WEIGHTS, PLACEHOLDER
from vllm_glm53.recipes.options import option_groups


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
        for name in sorted(set(PLACEHOLDER.findall(text))):
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
        parts = PLACEHOLDER.split(token)  # literal, name, literal, name, ...
        body = "".join("${%s}" % part if i % 2 else re.sub(r'([\\"$`])', r"\\\1", part)
                       for i, part in enumerate(parts))
        return f'"{body}"'
    return shlex.quote(token)


def _render_command(launch: Launch) -> str:
    lines = [f"{k}={_sh(v)}" for k, v in launch.own_env.items()]
    groups = option_groups(launch.args)
    first = [*launch.program, *groups[0][1]] if groups and groups[0][0] is None else list(launch.program)
    lines.append(" ".join(_sh(t) for t in first))
    lines += ["    " + " ".join(_sh(t) for t in tokens) for key, tokens in groups if key is not None]
    return " \\\n".join(lines)
