"""A broken checkpoint fails at startup with one message that names the problem."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import EngineRunError, run_engine

pytestmark = pytest.mark.engine


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _startup_error(path) -> str:
    with pytest.raises(EngineRunError) as info:
        run_engine(path, [[1, 2, 3]], 2, timeout=600)
    return info.value.stderr


def test_every_missing_and_misshapen_tensor_is_named_in_one_start(tiny_ckpt, tmp_path):
    """One start-up reports every problem of the checkpoint, not the first one only: a tensor of the wrong shape
    (named with both shapes) and a missing one (the misshapen tensor's parameter is not also called missing)."""
    path = _copy(tiny_ckpt("flat", layout="flat", seed=1), tmp_path / "broken")
    cut = "model.layers.3.self_attn.kv_b_proj.weight"

    def edit(t):
        t.pop("model.layers.1.self_attn.o_norm.weight")
        t[cut] = t[cut][:, :-1].clone()

    _edit_tensors(path, edit)
    err = _startup_error(path)
    assert f"cannot load checkpoint tensor {cut} (128, 31) into {cut}" in err
    assert "missing tensors for 1 parameters: model.layers.1.self_attn.o_norm.weight" in err


def test_unsupported_config_value_is_named(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt("flat", layout="flat", seed=1), tmp_path / "config")
    cfg = json.loads((path / "config.json").read_text())
    cfg["index_topk"] = 10  # not a multiple of index_kpool = 4
    (path / "config.json").write_text(json.dumps(cfg))
    err = _startup_error(path)
    assert "index_topk" in err and "index_kpool" in err and "divisible" in err
