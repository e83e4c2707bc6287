"""Build the compiled CPU kernels (``csrc/``) into this package directory.

    python -m vllm_glm53.backends.cpu.build [--isa auto|avx512|portable] [--force] [--verbose]

The set-up (``scripts/setup-cpu.sh``) runs this once; ``pip install`` never compiles anything, so a machine
without a compiler still installs the plugin and uses the plain-torch backends. The library is built against
the torch in this environment and named for it and for the instruction set, e.g.
``_kernels.avx512.torch-2.13.0+cpu.so``: after a torch upgrade or on a CPU without AVX-512 the loader
(:mod:`vllm_glm53.backends.cpu.kernels`) finds no matching file and falls back instead of loading a library
that would fail or fault. The compiler is called directly (no import of the result here), objects are built in
a temporary directory in parallel, and the finished file is moved into place atomically. A library newer than
every source is kept (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCES = ("registration.cpp", "kda.cpp", "indexer.cpp", "sparse_mla.cpp", "mhc.cpp", "moe.cpp")
HEADERS = ("vec.h", "common.h")

# What vec.h needs for its AVX-512 path; without all of them it compiles the portable path.
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ISA_CFLAGS = {
    "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c"],
    "portable": [],
}


def cpu_flags() -> set[str]:
    """Instruction-set flags of this CPU from /proc/cpuinfo (empty where that does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def best_isa() -> str:
    return "avx512" if set(AVX512_FLAGS) <= cpu_flags() else "portable"


def library_path(isa: str, torch_version: str | None = None) -> Path:
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    return PACKAGE_DIR / f"_kernels.{isa}.torch-{torch_version}.so"


def source_dir() -> Path:
    """``csrc/``: shipped inside the package as ``vllm_glm53/_csrc`` by a regular install, at the repository
    root in an editable one."""
    for candidate in (PACKAGE_DIR.parents[1] / "_csrc", PACKAGE_DIR.parents[2] / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES + HEADERS):
            return candidate
    raise FileNotFoundError("the kernel sources (csrc/) are not next to this package")


def _compile_commands(isa: str, src: Path, out_dir: Path, out: Path) -> tuple[list[list[str]], list[str]]:
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"no C++ compiler ({cxx!r}) on PATH")
    # -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers (AT_PARALLEL_OPENMP); without
    # the flag it silently runs on one thread. The library then needs libgomp.so.1, which importing torch has
    # already loaded (torch ships its own), so both share one OpenMP runtime and its thread settings.
    cflags = [
        "-O3", "-DNDEBUG", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *ISA_CFLAGS[isa],
    ]
    cflags += [f"-I{p}" for p in cpp_extension.include_paths()]
    objects, compiles = [], []
    for name in SOURCES:
        obj = out_dir / (name + ".o")
        compiles.append([cxx, *cflags, "-c", str(src / name), "-o", str(obj)])
        objects.append(str(obj))
    lib_dirs = cpp_extension.library_paths()
    link = [cxx, "-shared", "-fopenmp", "-o", str(out), *objects, *[f"-L{d}" for d in lib_dirs],
            *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu", "-ltorch"]
    return compiles, link


def build(isa: str = "auto", verbose: bool = False, force: bool = False) -> Path:
    """Compile csrc/ for ``isa`` against this torch; returns the library path. Raises on any failure."""
    if isa == "auto":
        isa = best_isa()
    target = library_path(isa)
    src = source_dir()
    newest_source = max((src / name).stat().st_mtime for name in SOURCES + HEADERS)
    if not force and target.is_file() and target.stat().st_mtime > newest_source:
        return target
    with tempfile.TemporaryDirectory(prefix="glm53-kernels-") as tmp:
        tmp_dir = Path(tmp)
        staged = tmp_dir / target.name
        compiles, link = _compile_commands(isa, src, tmp_dir, staged)

        def run(cmd: list[str]) -> None:
            if verbose:
                print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiler failed ({proc.returncode}):\n{proc.stderr[-4000:]}")

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(run, compiles))
        run(link)
        shutil.copy2(staged, target.with_suffix(".so.tmp"))
        os.replace(target.with_suffix(".so.tmp"), target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.backends.cpu.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=["auto", *ISA_CFLAGS], default="auto",
                        help="instruction set (auto: avx512 when this CPU has it, else portable)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the library is up to date")
    parser.add_argument("--verbose", action="store_true", help="print the compiler commands")
    args = parser.parse_args(argv)
    try:
        path = build(args.isa, args.verbose, args.force)
    except (OSError, RuntimeError) as exc:
        print(f"vllm-glm53: CPU kernels not built ({exc}); the plain-torch backends will be used", file=sys.stderr)
        return 1
    print(f"vllm-glm53: CPU kernels ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
