"""One dispatch mechanism for the op families: an :class:`Op` holds the implementations the platform packages
registered for it, in order of preference, each with a check that says why it declines a call (``"needs
bfloat16, got float32"``), as fla's dispatch does. A call runs the first implementation that accepts it; the last one
registered is the reference form and accepts everything it can compute.

Which implementation ran, and why the ones before it declined, is logged once per distinct outcome and op, in
one line: ``vllm-glm53 op kda_varlen: torch (compiled declined: kernels not loaded (VLLM_GLM53_CPU_KERNELS=0))``.
:func:`decisions` returns the same record for tests and tools.

Words as in :mod:`vllm_glm53.backends`: an *implementation* is one way to compute the op (``compiled`` CPU
kernels, ``torch``, ``triton``, ``fla``, ``flashmla``, ...); the platform packages (``backends.cpu``,
``backends.cuda``) register theirs on their own Op objects.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["Op", "decisions"]

_lock = threading.Lock()
_seen: dict[tuple[str, str, tuple[str, ...]], None] = {}


@dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable
    check: Callable[..., str | None] | None  # None: accepts every call


class Op:
    """A batch-wide operation with its implementations. Call it like a function; its signature (for
    ``inspect``) is the reference implementation's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.impls: list[Impl] = []
        self.__name__ = name

    def register(self, name: str, check: Callable[..., str | None] | None = None):
        """Decorator: ``fn`` is this op's implementation ``name``; ``check(*args, **kwargs)`` returns None to
        accept a call or the reason it declines. Registration order is preference order."""

        def add(fn: Callable) -> Callable:
            self.impls.append(Impl(name, fn, check))
            reference = self.impls[-1].fn
            self.__signature__ = inspect.signature(reference)
            self.__doc__ = reference.__doc__
            return fn

        return add

    def __call__(self, *args, **kwargs):
        declined = ()
        for impl in self.impls:
            reason = None if impl.check is None else impl.check(*args, **kwargs)
            if reason is None:
                key = (self.name, impl.name, declined)
                if key not in _seen:
                    _note(key)
                return impl.fn(*args, **kwargs)
            declined += (f"{impl.name} declined: {reason}",)
        raise NotImplementedError(f"{self.name}: no implementation accepts this call ({'; '.join(declined)})")

    def implementation(self, name: str) -> Callable:
        """The implementation registered as ``name`` (tests and benchmarks call a form explicitly through this)."""
        for impl in self.impls:
            if impl.name == name:
                return impl.fn
        raise KeyError(f"{self.name} has no {name} implementation ({self.implementations})")

    @property
    def implementations(self) -> list[str]:
        return [impl.name for impl in self.impls]

    def __repr__(self) -> str:
        return f"Op({self.name!r}, implementations={self.implementations})"


def _note(key: tuple[str, str, tuple[str, ...]]) -> None:
    with _lock:
        if key in _seen:
            return
        _seen[key] = None
    op, chosen, declined = key
    logger.info("vllm-glm53 op %s: %s%s", op, chosen, f" ({'; '.join(declined)})" if declined else "")


def decisions() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every ``(op, implementation that ran, reasons of those that declined)`` seen in this process, in order."""
    with _lock:
        return list(_seen)


@functools.lru_cache(maxsize=None)
def _compiled_status() -> str | None:
    from vllm_glm53.backends.cpu import kernels

    return None if kernels.ops() is not None else f"kernels not loaded ({kernels.description()})"


def compiled_kernels_check(*tensors_of: Callable) -> Callable[..., str | None]:
    """The check of a compiled-CPU implementation: the kernels are loaded and every tensor the ``tensors_of``
    selectors pick from the call (``lambda *a, **k: ...`` returning tensors) is a CPU tensor of a dtype they
    read."""
    from vllm_glm53.backends.cpu.kernels import KERNEL_DTYPES

    def check(*args, **kwargs) -> str | None:
        status = _compiled_status()
        if status is not None:
            return status
        for select in tensors_of:
            for t in select(*args, **kwargs):
                if t is None:
                    continue
                if not t.is_cpu:  # (``is_cpu``: a fifth of the time of ``device.type`` on every call)
                    return f"needs CPU tensors, got {t.device.type}"
                if t.dtype not in KERNEL_DTYPES:
                    return f"reads float32/bfloat16/float16, got {t.dtype}"
        return None

    return check
