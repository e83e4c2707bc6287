"""Checkpoint tensor names, shared by the weight loader (model.weights) and the quantization plan (quant.plan).

A leaf module (no imports from the package) so that neither of those two imports the other.
"""

from __future__ import annotations

NESTED_TEXT_PREFIX = "model.language_model."


def canonical_name(name: str) -> str:
    """Nested (released, multimodal) and flat (text-only) checkpoints name the text model differently; use the
    flat names."""
    if name.startswith(NESTED_TEXT_PREFIX):
        return "model." + name[len(NESTED_TEXT_PREFIX):]
    return name
