"""The stateful layers' custom ops: a KDA or sparse-MLA layer is its projections plus one registered op that reads
the step plan and the layer's cache, and runs the layer's batch-wide ops on it (vLLM's
``direct_register_custom_op`` pattern). To torch (``torch.compile``, CUDA graphs) the op is one opaque call with
a fake implementation that only gives output shapes; inside it the forward has no Python loop over requests and
reads nothing back from the device.

The ops live in the plugin's own library, ``torch.ops.vllm_glm53_layers``; each finds its layer by name in
vLLM's forward context, the way vLLM's own stateful layers do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_glm53 import _vllm

_LIBRARY = torch.library.Library("vllm_glm53_layers", "FRAGMENT")  # lives as long as the module


def register_layer_op(name: str, fn: Callable, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Define ``torch.ops.vllm_glm53_layers.<name>`` once per process (a second import of a model module,
    e.g. in tests, finds it defined) and return it."""
    if not hasattr(torch.ops.vllm_glm53_layers, name):
        _vllm.direct_register_custom_op(name, fn, mutates_args=list(mutates_args), fake_impl=fake,
                                        target_lib=_LIBRARY)
    return getattr(torch.ops.vllm_glm53_layers, name)


def forward_layer(name: str):
    """The layer registered under ``name`` in this step's forward context."""
    return _vllm.get_forward_context().no_compile_layers[name]
