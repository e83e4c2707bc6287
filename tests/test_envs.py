"""The plugin's environment variables: one table (vllm_glm53/envs.py), all documented, bad values named."""

from pathlib import Path

import pytest

from vllm_glm53 import envs

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_variable_is_in_the_readme_knobs_table():
    table = README[README.index("| knob | effect |"):README.index("## Layout")]
    for name in envs.VARIABLES:
        assert f"`{name}" in table, f"{name} is missing from the README's Configuration knobs table"


def test_every_variable_the_package_reads_is_in_the_table():
    """No VLLM_GLM53_* name read anywhere in the package outside envs.py."""
    package = Path(envs.__file__).parent
    import re

    for path in package.rglob("*.py"):
        if path.name == "envs.py":
            continue
        for name in re.findall(r"VLLM_GLM53_[A-Z_]+", path.read_text()):
            assert name in envs.VARIABLES, f"{path.relative_to(package)} mentions {name}, not in envs.VARIABLES"


@pytest.mark.parametrize("name", sorted(envs.VARIABLES))
def test_default_and_bad_values(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) == envs.VARIABLES[name].default
    monkeypatch.setenv(name, "no-such-value")
    with pytest.raises(envs.EnvError, match=rf"{name}='no-such-value' is not valid; expected one of"):
        getattr(envs, name)
