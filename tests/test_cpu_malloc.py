"""Which allocator vLLM's CPU processes get (vllm_glm53/cpu_malloc.py): the library chosen, where it goes in
LD_PRELOAD, and when LD_PRELOAD is left alone. That a served engine's processes really run on it is checked in
tests/test_serve.py."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from vllm_glm53 import cpu_malloc


@pytest.fixture
def libdirs(tmp_path):
    """Two library directories: an environment's (a full tcmalloc) and the system's (a minimal one, its -dev
    symlink, its debug build and an unrelated library)."""
    env, system = tmp_path / "env", tmp_path / "system"
    env.mkdir(), system.mkdir()
    (env / "libtcmalloc.so.4").touch()
    for name in ("libtcmalloc_minimal.so", "libtcmalloc_minimal.so.4", "libtcmalloc_minimal_debug.so.4",
                 "libtcmalloc_minimal.so.4.5.10", "libjemalloc.so.2"):
        (system / name).touch()
    return [str(env), str(system)]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("VLLM_GLM53_CPU_TCMALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    return monkeypatch


def test_the_minimal_build_first_its_installed_name_over_the_dev_symlink(libdirs):
    assert cpu_malloc.find_tcmalloc(libdirs) == libdirs[1] + "/libtcmalloc_minimal.so.4"
    # Without a minimal build anywhere, the full one.
    assert cpu_malloc.find_tcmalloc(libdirs[:1]) == libdirs[0] + "/libtcmalloc.so.4"


def test_none_where_there_is_none(tmp_path):
    assert cpu_malloc.find_tcmalloc([str(tmp_path)]) is None


def test_prepended_to_what_ld_preload_holds_once(clean_env, libdirs):
    clean_env.setenv("LD_PRELOAD", "/opt/libgomp.so.1")
    lib = cpu_malloc.preload_tcmalloc(libdirs)
    assert lib == libdirs[1] + "/libtcmalloc_minimal.so.4"
    assert os.environ["LD_PRELOAD"] == f"{lib}:/opt/libgomp.so.1"
    assert cpu_malloc.preload_tcmalloc(libdirs) is None  # vLLM builds the config more than once per launch
    assert os.environ["LD_PRELOAD"] == f"{lib}:/opt/libgomp.so.1"


def test_set_when_ld_preload_is_empty(clean_env, libdirs):
    assert cpu_malloc.preload_tcmalloc(libdirs) == os.environ["LD_PRELOAD"] == libdirs[1] + "/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("chosen", ["/usr/lib/libjemalloc.so.2", "/x/libtcmalloc.so.4:/y/libgomp.so",
                                    "/y/libgomp.so:/z/libmimalloc.so.2"])
def test_an_allocator_the_user_preloads_stays(clean_env, libdirs, chosen):
    clean_env.setenv("LD_PRELOAD", chosen)
    assert cpu_malloc.preload_tcmalloc(libdirs) is None
    assert os.environ["LD_PRELOAD"] == chosen


def test_switched_off(clean_env, libdirs):
    clean_env.setenv("VLLM_GLM53_CPU_TCMALLOC", "0")
    assert cpu_malloc.preload_tcmalloc(libdirs) is None
    assert "LD_PRELOAD" not in os.environ


def test_none_found_warns_once_and_changes_nothing(clean_env, tmp_path, caplog):
    clean_env.setattr(cpu_malloc, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="vllm_glm53"):
        assert cpu_malloc.preload_tcmalloc([str(tmp_path)]) is None
        assert cpu_malloc.preload_tcmalloc([str(tmp_path)]) is None
    assert "LD_PRELOAD" not in os.environ
    warnings = [r.getMessage() for r in caplog.records if "no tcmalloc found" in r.getMessage()]
    assert len(warnings) == 1 and "apt install libtcmalloc-minimal4" in warnings[0]


def test_the_default_search_looks_in_the_environments_first(monkeypatch, tmp_path):
    """A conda gperftools (this environment's prefix, then an active conda environment) before the system's."""
    for name in ("venv", "conda"):
        (tmp_path / name / "lib").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "conda"))
    dirs = cpu_malloc.library_dirs()
    assert dirs[:2] == [str(tmp_path / "venv" / "lib"), str(tmp_path / "conda" / "lib")]
    assert all(d.startswith(("/usr/", "/lib")) for d in dirs[2:]) and dirs[2:]
