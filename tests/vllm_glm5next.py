"""Import vLLM's own GLM5Next (``vllm.models.glm5next``) on CPU, for tests that compare against it.

vLLM's model cannot run here, but its classes and its multimodal processor can be imported once torchvision
exists: ``vllm.model_executor.models.glm4_1v`` imports transformers' GLM-4V image processor, which imports
``torchvision.transforms.v2`` at module level (the set-up removes torchvision: the PyPI wheel is a CUDA build that
breaks the CPU torch). A stand-in package whose attributes are mocks is enough for what the tests touch (class
interfaces; the processor's prompt layout, which never calls torchvision). Use it in a subprocess only
(``python tests/vllm_glm5next.py``, or :func:`install` in a child): the stand-in must not leak into other tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from unittest import mock


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install():
    """Import vLLM's GLM5Next package with the torchvision stand-in and return it."""
    # transformers decides once, at import, whether torchvision is available: let it see the truth (absent)
    # before the stand-in exists, so only modules that import torchvision unconditionally get the stand-in.
    import transformers  # noqa: F401
    import vllm.config  # noqa: F401

    sys.meta_path.insert(0, _StandInFinder())
    import vllm.models.glm5next as glm5next

    return glm5next


INTERFACES = ("HasInnerState", "IsHybrid", "SupportsMultiModal", "SupportsPP", "SupportsLoRA", "SupportsEagle",
              "SupportsEagle3", "MixtureOfExperts")


def interfaces(cls) -> list[str]:
    """The vLLM interfaces ``cls`` declares, by vLLM's own predicates."""
    from vllm.model_executor.models import interfaces as i

    checks = {"HasInnerState": i.has_inner_state, "IsHybrid": i.is_hybrid, "SupportsMultiModal": i.supports_multimodal,
              "SupportsPP": i.supports_pp, "SupportsLoRA": i.supports_lora, "SupportsEagle": i.supports_eagle,
              "SupportsEagle3": i.supports_eagle3,
              # a protocol with data members: declared by inheritance (vLLM checks instances at run time)
              "MixtureOfExperts": lambda c: i.MixtureOfExperts in c.__mro__}
    return sorted(name for name in INTERFACES if checks[name](cls))


def vllm_interfaces() -> dict[str, list[str]]:
    """``{class name: interfaces}`` of vLLM's two GLM5Next classes, found in a child process."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"importing vLLM's GLM5Next failed:\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("INTERFACES"))
    return json.loads(line[len("INTERFACES"):])


if __name__ == "__main__":
    import json

    glm5next = install()
    print("INTERFACES" + json.dumps({name: interfaces(getattr(glm5next, name))
                                     for name in ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")}))
