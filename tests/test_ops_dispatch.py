"""The op layer's contracts: one dispatch mechanism (first implementation that accepts a call runs, the others say
why they declined, one log line per outcome), and every platform package exporting the same interface per op
family (a layer written against one runs on the other).

The GPU package imports Triton and fla-core, which this environment does not have, so its interface is read from
the source (the interpreter run, tests/test_gpu_backends_interpreter.py, also checks it by import)."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_glm53.backends import dispatch
from vllm_glm53.backends.dispatch import Op

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_glm53" / "backends"
FAMILIES = ["kda", "indexer", "sparse_mla", "mhc", "moe", "norm"]


def _interface(path: Path) -> dict[str, tuple[list[str], bool]]:
    """``name -> (parameter names, is an Op)`` for each name in the module's ``__all__``: a function's own
    parameters, or an Op's reference implementation's (the last one registered), or a re-export's."""
    tree = ast.parse(path.read_text())
    public, ops, funcs, imports = [], set(), {}, {}
    registered: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "__all__":
                public = [e.value for e in node.value.elts]
            elif isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "Op":
                ops.add(name)
        elif isinstance(node, ast.FunctionDef):
            funcs[node.name] = [a.arg for a in node.args.args]
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "register":
                    registered[dec.func.value.id] = funcs[node.name]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imports[alias.asname or alias.name] = (node.module, alias.name)
    out = {}
    for name in public:
        if name in ops:
            out[name] = (registered[name], True)
        elif name in funcs:
            out[name] = (funcs[name], False)
        else:  # re-exported from the CPU package
            module, original = imports[name]
            source = PACKAGE.parent.parent / (module.replace(".", "/") + ".py")
            params = _interface_of_name(source, original)
            out[name] = (params, original in _ops_in(source))
    return out


def _interface_of_name(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"{name} not defined in {path}")


def _ops_in(path: Path) -> set[str]:
    return {n.targets[0].id for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) == "Op"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_platform_package_exports_the_same_interface(family):
    cpu = _interface(PACKAGE / "cpu" / f"{family}.py")
    cuda = _interface(PACKAGE / "cuda" / f"{family}.py")
    assert set(cpu) == set(cuda), f"{family}: only cpu {set(cpu) - set(cuda)}, only cuda {set(cuda) - set(cpu)}"
    for name, (params, _) in cpu.items():
        assert cuda[name][0][: len(params)] == params, f"{family}.{name}: {cuda[name][0]} vs {params}"


def test_the_batch_ops_dispatch_on_every_platform():
    """The ops a layer calls once per step are Ops (one dispatch with decline reasons) in both packages."""
    batch_ops = {"kda": ["kda_varlen", "causal_conv1d_varlen"], "indexer": ["store_pooled_keys", "select_batch"],
                 "sparse_mla": ["sparse_latent_attention_paged"]}
    for family, names in batch_ops.items():
        for platform in ("cpu", "cuda"):
            for name in names:
                assert _interface(PACKAGE / platform / f"{family}.py")[name][1], f"{platform}.{family}.{name}"


def test_first_accepting_implementation_runs_and_declines_are_logged(caplog):
    op = Op("test_double")

    @op.register("fast", lambda x: None if x.dtype == torch.float32 else f"needs float32, got {x.dtype}")
    def fast(x):
        return x * 2

    @op.register("reference")
    def reference(x):
        """The reference."""
        return x + x

    with caplog.at_level(logging.INFO, logger="vllm_glm53.backends.dispatch"):
        assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
        assert torch.equal(op(torch.ones(2, dtype=torch.float64)), torch.full((2,), 2.0, dtype=torch.float64))
        op(torch.ones(3, dtype=torch.float64))  # same outcome again: no second line
    lines = [r.getMessage() for r in caplog.records if "test_double" in r.getMessage()]
    assert lines == ["vllm-glm53 op test_double: fast",
                     "vllm-glm53 op test_double: reference (fast declined: needs float32, got torch.float64)"]
    assert ("test_double", "reference", ("fast declined: needs float32, got torch.float64",)) in dispatch.decisions()
    assert op.implementation("reference") is reference and op.implementations == ["fast", "reference"]
    assert op.__doc__ == "The reference."


def test_no_implementation_is_an_error_naming_every_reason():
    op = Op("test_never")
    op.register("a", lambda x: "no a")(lambda x: x)
    op.register("b", lambda x: "no b")(lambda x: x)
    with pytest.raises(NotImplementedError, match="a declined: no a; b declined: no b"):
        op(1)


def test_compiled_kernels_check_names_the_tensor_it_cannot_take(monkeypatch):
    """With the kernels loaded, the compiled check accepts CPU tensors of the kernels' dtypes (and absent ones) and
    declines any other device or dtype, saying which."""
    monkeypatch.setattr(dispatch, "_compiled_status", lambda: None)
    check = dispatch.compiled_kernels_check(lambda a, b: (a, b))
    cpu = torch.ones(2, dtype=torch.bfloat16)
    assert check(cpu, None) is None and check(cpu, torch.ones(2)) is None
    assert check(cpu, torch.ones(2, device="meta")) == "needs CPU tensors, got meta"
    assert check(torch.ones(2, dtype=torch.float64), cpu) == "reads float32/bfloat16/float16, got torch.float64"


def test_forced_torch_path_says_why_in_one_line():
    """With ``VLLM_GLM53_CPU_KERNELS=0`` the compiled implementations decline with the reason, logged once."""
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from vllm_glm53.backends.cpu import mhc\n"
        "X = torch.randn(2, 4, 8)\n"
        "for _ in range(3): mhc.mhc_collapse(X, torch.rand(2, 4))\n"
    )
    env = {**os.environ, "VLLM_GLM53_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "op mhc_collapse" in line]
    assert lines == ["vllm-glm53 op mhc_collapse: torch (compiled declined: kernels not loaded (plain torch "
                     "(VLLM_GLM53_CPU_KERNELS=0)))"]
