"""Build the compiled CPU kernels (``csrc/``) into this package directory.

    python -m vllm_glm53.backends.cpu.build [--isa auto|avx512|avx2|portable ...] [--force] [--verbose]

The set-up (``scripts/setup-cpu.sh``) runs this; ``pip install`` never compiles anything, so a machine without a
compiler still installs the plugin and uses the plain-torch backends. One library is built per instruction set
(``avx512``: AVX-512 F/BW/VL/DQ; ``avx2``: AVX2 + FMA + F16C; ``portable``: no ISA flags, the x86-64 baseline),
by default every one this CPU runs, so the tests check each path the loader could pick here (an AVX-512 machine
also builds and tests avx2 and portable). Each library is built against the torch in this environment and named
for it and for its instruction set, e.g. ``_kernels.avx2.torch-2.13.0+cpu.so``: after a torch upgrade, or on a
CPU that lacks the instruction set, the loader (:mod:`vllm_glm53.backends.cpu.kernels`) finds no matching file
and falls back instead of loading a library that would fail or fault. The compiler is called directly (no import
of the result here), objects are built in a temporary directory in parallel, and the finished file is moved into
place atomically. A library newer than every source is kept (``--force`` rebuilds).
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
SOURCES = ("registration.cpp", "kda.cpp", "kda_gates.cpp", "indexer.cpp", "sparse_mla.cpp", "mhc.cpp", "moe.cpp",
           "moe_route.cpp", "linear.cpp", "norm.cpp")
HEADERS = ("vec.h", "common.h", "gemv.h", "amx.h")

# Per instruction set, best first: the /proc/cpuinfo flags a CPU needs to run it and the compiler flags that make
# vec.h compile that path. Explicit feature flags, not -march=native: the library runs on any CPU with them.
ISA_CPU_FLAGS = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
ISA_CFLAGS = {
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
ISAS = tuple(ISA_CFLAGS)


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


def runnable_isas() -> list[str]:
    """The instruction sets this CPU runs, best first (``portable`` always)."""
    flags = cpu_flags()
    return [isa for isa in ISAS if set(ISA_CPU_FLAGS[isa]) <= flags]


def best_isa() -> str:
    return runnable_isas()[0]


def compiler() -> str | None:
    """The C++ compiler the build would call (``$CXX``, else ``c++``), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


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


def _compile_commands(isa: str, src: Path, out_dir: Path, out: Path,
                      extra_cflags: tuple[str, ...] = ()) -> tuple[list[list[str]], list[str]]:
    import torch
    from torch.utils import cpp_extension

    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r}) on PATH")
    # -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers (AT_PARALLEL_OPENMP); without
    # the flag it silently runs on one thread. The library then needs libgomp.so.1, which importing torch has
    # already loaded (torch ships its own), so both share one OpenMP runtime and its thread settings.
    # -ffp-contract=off: only the kernels' explicit fma() fuses; scalar code rounds each step as written (as
    # torch's elementwise ops do), the same way on every instruction set (GCC fuses a * b + c by default in C++).
    cflags = [
        "-O3", "-DNDEBUG", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *ISA_CFLAGS[isa],
        *extra_cflags,
    ]
    cflags += [f"-I{p}" for p in cpp_extension.include_paths()]
    objects, compiles = [], []
    # (source_dir() checked that this tree's csrc/ has them all; an older revision's copy may have fewer files)
    for name in (name for name in SOURCES if (src / name).is_file()):
        obj = out_dir / (name + ".o")
        compiles.append([cxx, *cflags, "-c", str(src / name), "-o", str(obj)])
        objects.append(str(obj))
    lib_dirs = cpp_extension.library_paths()
    link = [cxx, "-shared", "-fopenmp", "-o", str(out), *objects, *[f"-L{d}" for d in lib_dirs],
            *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu", "-ltorch"]
    return compiles, link


def _newer_than_sources(target: Path, extra_sources: tuple[Path, ...] = ()) -> bool:
    src = source_dir()
    sources = [src / name for name in SOURCES + HEADERS] + list(extra_sources)
    return target.is_file() and target.stat().st_mtime > max(p.stat().st_mtime for p in sources)


def up_to_date(isa: str) -> bool:
    """Whether ``isa``'s library for this torch exists and is newer than every kernel source."""
    return _newer_than_sources(library_path(isa))


def compile_library(isa: str, target: Path, extra_cflags: tuple[str, ...] = (), extra_sources: tuple[Path, ...] = (),
                    verbose: bool = False, force: bool = False, src: Path | None = None) -> Path:
    """Compile csrc/ with ``isa``'s flags (and ``extra_cflags``) into ``target``, unless it is newer than every
    kernel source and ``extra_sources`` (the tests' emulated avx512 build uses both). ``src``: another copy of csrc/
    (benchmarks/bench_kernel_ab.py builds a git revision's), always compiled."""
    if src is not None:
        force = True
    else:
        src = source_dir()
    if not force and _newer_than_sources(target, extra_sources):
        return target
    with tempfile.TemporaryDirectory(prefix=f"glm53-kernels-{isa}-") as tmp:
        tmp_dir = Path(tmp)
        staged = tmp_dir / target.name
        compiles, link = _compile_commands(isa, src, tmp_dir, staged, extra_cflags)

        def run(cmd: list[str]) -> None:
            if verbose:
                print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiler failed for {isa} ({proc.returncode}):\n{proc.stderr[-4000:]}")

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(run, compiles))
        run(link)
        shutil.copy2(staged, target.with_suffix(".so.tmp"))
        os.replace(target.with_suffix(".so.tmp"), target)
    return target


def build(isas: str | list[str] = "auto", verbose: bool = False, force: bool = False) -> list[Path]:
    """Compile csrc/ against this torch for each of ``isas`` ("auto": every instruction set this CPU runs);
    returns the library paths. Raises on any failure."""
    if isas == "auto":
        isas = runnable_isas()
    elif isinstance(isas, str):
        isas = [isas]
    unknown = [isa for isa in isas if isa not in ISA_CFLAGS]
    if unknown:
        raise ValueError(f"unknown instruction set(s) {unknown}; known: {', '.join(ISAS)}")
    return [compile_library(isa, library_path(isa), verbose=verbose, force=force) for isa in isas]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.backends.cpu.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", nargs="+", choices=["auto", *ISAS], default=["auto"],
                        help="instruction sets to build (auto: every one this CPU runs; avx512 and avx2 also "
                             "compile where the CPU cannot run them)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the library is up to date")
    parser.add_argument("--verbose", action="store_true", help="print the compiler commands")
    parser.add_argument("--if-compiler", action="store_true",
                        help="succeed without building where there is no C++ compiler (the set-up: the plugin then "
                             "runs its plain-torch backends); a failed build still fails")
    args = parser.parse_args(argv)
    if args.if_compiler and compiler() is None:
        print(f"vllm-glm53: no C++ compiler ({os.environ.get('CXX', 'c++')!r}): CPU kernels not built; the "
              "plain-torch backends will be used", file=sys.stderr)
        return 0
    isas = list(dict.fromkeys(isa for name in args.isa for isa in (runnable_isas() if name == "auto" else [name])))
    try:
        paths = build(isas, args.verbose, args.force)
    except (OSError, RuntimeError) as exc:
        print(f"vllm-glm53: CPU kernels not built ({exc})", file=sys.stderr)
        return 1
    for path in paths:
        print(f"vllm-glm53: CPU kernels ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
