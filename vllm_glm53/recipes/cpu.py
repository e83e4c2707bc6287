"""CPU helpers: thread binding per tensor-parallel rank, and the tiny-checkpoint plan the demo and tests serve."""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from vllm_glm53.recipes.catalogue import RecipeError
from vllm_glm53.recipes.plan import Plan
from vllm_glm53.recipes.build import build


CPU_TINY_STRATEGY = "tiny-checkpoint"


def cpu_bind(tp: int, cpus: Iterable[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each of ``tp`` ranks its own contiguous share of ``cpus`` (default:
    the cores this process may run on), e.g. ``0-3|4-6`` on 8 cores, with the last core left to vLLM's engine core
    and API server when there are more cores than ranks.

    Why leave one: while a step runs, the engine core polls for the worker's result on a core of its own; with
    every core bound to a rank it takes turns with one of that rank's OpenMP threads, and every parallel region
    waits for the descheduled thread. On 2 cores (worker on one core instead of both) batch-1 decode measured 1.7x
    faster and steadier (268-330 against 152-185 tokens/s over three engine starts each), prefill about 1.7x
    slower (benchmarks/README.md). vLLM's own default binding (``auto``) leaves a core for the same reason."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = sorted(set(cpus))
    if tp < 1 or len(cores) < tp:
        raise RecipeError(f"cannot bind {tp} TP rank(s) to {len(cores)} core(s): each rank needs its own core")
    if len(cores) > tp:
        cores = cores[:-1]
    share, spare = divmod(len(cores), tp)
    ranks, start = [], 0
    for rank in range(tp):
        size = share + (1 if rank < spare else 0)
        ranks.append(_core_list(cores[start:start + size]))
        start += size
    return "|".join(ranks)


def _core_list(cores: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def cpu_plan(checkpoint: str | os.PathLike, *, port: int = 8000, tp: int = 1, host: str = "127.0.0.1",
             features: Iterable[str] = (), extra_args: Sequence[str] = (),
             cpus: Iterable[int] | None = None) -> Plan:
    """The ``cpu`` / ``tiny-checkpoint`` recipe for a local checkpoint: one serve launch whose ``argv`` and
    ``env`` (merge it over os.environ) start the server on ``host:port`` with ``tp`` ranks, each bound to its
    own cores."""
    params = {"MODEL": os.fspath(checkpoint), "PORT": port, "HOST": host, "TP": tp, "CPU_BIND": cpu_bind(tp, cpus)}
    return build("cpu", CPU_TINY_STRATEGY, features=features, params=params, extra_args=extra_args)
