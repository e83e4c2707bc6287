"""Import vLLM's own GLM5Next (``vllm.models.glm5next``) on CPU, for tests that compare against it.

vLLM's model cannot run here, but its classes and its multimodal processor can be imported once torchvision
exists: ``vllm.model_executor.models.glm4_1v`` imports transformers' GLM-4V image processor, which imports
``torchvision.transforms.v2`` at module level (the set-up removes torchvision: the PyPI wheel is a CUDA build that
breaks the CPU torch). A small stand-in package is enough for what the tests touch: class interfaces, and vLLM's
multimodal processor turning a prompt and an image into its placeholder layout. Use it in a subprocess only
(``python tests/vllm_glm5next.py ...``): the stand-in must not leak into other tests.
"""

from __future__ import annotations

import functools
import os
import sys


def install():
    """Put the torchvision stand-in on the path, import vLLM's GLM5Next package and return it."""
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torchvision_standin

    # Only the patch grid and the prompt layout are compared: the bilinear resize stand-in is enough.
    root = torchvision_standin.write(tempfile.mkdtemp(prefix="torchvision-standin-"), resize=True)
    sys.path.insert(0, str(root))  # before transformers decides whether torchvision is available
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


@functools.cache  # one child process per test session (two modules ask)
def vllm_interfaces() -> dict[str, list[str]]:
    """``{class name: interfaces}`` of vLLM's two GLM5Next classes, found in a child process."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"importing vLLM's GLM5Next failed:\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("INTERFACES"))
    return json.loads(line[len("INTERFACES"):])


def process(checkpoint: str, prompt: list[int], images_npy: list[str], max_model_len: int) -> list[dict]:
    """vLLM's own GLM5Next multimodal processor on ``prompt`` with each image in turn (``.npy`` files): prompt ids,
    placeholder ranges, patch grid and pixel rows, one summary per image. The plugin's general registration runs as
    in any vLLM process (tokenizer mode ...), then the architecture is pointed back at vLLM's own class, which is
    what registers vLLM's processor."""
    glm5next = install()  # first: transformers decides once, at its import, whether torchvision exists
    import numpy as np
    from PIL import Image
    from vllm import ModelRegistry
    from vllm.config import ModelConfig
    from vllm.model_executor.models.registry import _RegisteredModel
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    arch = "Glm5NextForConditionalGeneration"
    ModelRegistry.models[arch] = _RegisteredModel.from_model_cls(getattr(glm5next, arch))
    processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=checkpoint, max_model_len=max_model_len, limit_mm_per_prompt={"image": 1, "video": 0}))
    assert type(processor).__module__.startswith("vllm.models.glm5next"), type(processor)
    return [summarize(processor(prompt, processor.info.parse_mm_data({"image": [Image.fromarray(np.load(path))]}),
                                hf_processor_mm_kwargs={}))
            for path in images_npy]


def summarize(out) -> dict:
    """What two processors must agree on for the model to see the same input."""
    item = out["mm_kwargs"]["image"][0]
    return {"prompt_token_ids": list(out["prompt_token_ids"]),
            "placeholders": [[r.offset, r.length] for r in out["mm_placeholders"]["image"]],
            "image_grid_thw": [int(v) for v in item["image_grid_thw"].data.tolist()],
            "pixel_rows": int(item["pixel_values"].data.shape[0])}


if __name__ == "__main__":
    import json

    if sys.argv[1:2] == ["process"]:  # process CHECKPOINT SPEC.json: one line, a summary per image
        ckpt, spec = sys.argv[2], json.loads(open(sys.argv[3]).read())
        print("PROCESSED" + json.dumps(process(ckpt, spec["prompt"], spec["images"], spec["max_model_len"])))
        sys.exit(0)
    glm5next = install()
    print("INTERFACES" + json.dumps({name: interfaces(getattr(glm5next, name))
                                     for name in ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")}))
