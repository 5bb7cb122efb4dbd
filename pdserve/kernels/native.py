"""Build and load pdserve's native library: the AVX2 kernel for llama.cpp's Q4_1 and Q8_0
blocks (blocks_avx2.cpp: the other q4 kernel beside torch's, and the Q8_0 output head of a q4
model on it), the fused step ops (step_ops.cpp, `--step-ops`, see step_ops.py; their decode
attention in AVX-512 registers where the CPU has them, attend_avx512.h), and a decode step's
Llama layers in one call over them (decode_layer.cpp).

`--q4-kernel` picks how q4 layers multiply:
  torch   torch._weight_int4pack_mm_for_cpu, activations in bfloat16
  native  blocks_avx2.cpp, on llama.cpp's own block_q4_1 bytes, interleaved by 8 output rows:
          activations rounded to int8 per block of 32 and integer dot products, as llama.cpp
          computes Q4_1. The output head is then Q8_0 on the same kernel
          (quantized.output_head). It needs x86-64 Linux with AVX2, FMA and F16C.
  auto    (the default) native where torch's own CPU kernels run their AVX2 code, torch where
          they run AVX-512 code. Measured (docs/measurements.md, "Which q4 kernel"): on an
          AVX-512 EPYC torch's is as fast at one row and faster from 4; on an AVX2-only EPYC
          the native one is 1.8-2.0x faster at one row and 1.2-1.4x at 4-64 rows.

The two give slightly different logits, so the kernel is part of the model's fingerprint: a
prefill and a decode on different kernels refuse each other's KV by name.

The library is compiled once with the C++ compiler (`c++`, or $CXX) against the installed torch,
into $PDSERVE_KERNEL_DIR (default: share/pdserve-kernels in the Python environment), under a name
that hashes the source, torch's version and the flags, so a changed source or torch is rebuilt.
scripts/install.sh builds it (`python -m pdserve.kernels.native`), so no server waits for it.
It registers torch.ops.pdserve.q4_1_linear, q8_0_linear and the step ops: loaded through torch,
not Python's importer, it needs no Python headers and no build tool besides the compiler.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.core.config import Q4_KERNEL_CHOICES

log = logging.getLogger(__name__)

# One library from these sources: the q4 kernel, the fused step ops (step_ops.py) and the whole
# layer over both.
SOURCES = [
    Path(__file__).with_name(name)
    for name in ("blocks_avx2.cpp", "step_ops.cpp", "decode_layer.cpp", "decode_wide.cpp")
]
# The loops the sources share; hashed with them, so a changed header rebuilds the library too.
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("blocks_avx2.h", "step_kernels.h", "attend_avx512.h")
]
LIBRARY_PREFIX = "pdserve_native-"
# -ffp-contract=off: the compiler may otherwise fuse a scalar multiply and add in one tile shape
# and not in another, and a row's result would depend on how many rows share its call.
FLAGS = ["-O3", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
FLAGS += ["-std=c++20"]
CPU_FLAGS = ("avx2", "fma", "f16c")
BUILD_TIMEOUT_S = 600

_loaded = False


class KernelUnavailable(ValueError):
    """The native kernel cannot run here (a setting this machine cannot meet); says why."""


def require(choice: str) -> str:
    """`--q4-kernel` checked and `auto` resolved: native only where this machine can build and
    run it."""
    if choice not in Q4_KERNEL_CHOICES:
        raise ValueError(
            f"--q4-kernel must be one of {', '.join(Q4_KERNEL_CHOICES)}, got {choice!r}"
        )
    if choice == "auto":
        return auto_choice()
    reason = why_unavailable() if choice == "native" else None
    if reason is not None:
        raise KernelUnavailable(f"--q4-kernel native cannot run here: {reason}")
    return choice


def auto_choice() -> str:
    """The kernel `--q4-kernel auto` picks here: the native one wherever it can run, else
    torch's. Measured faster on both CPUs it was tried on, since its blocks are read 8 output
    rows at a time: on an AVX2-only EPYC and on an AVX-512 one, where torch runs its AVX-512 int4
    code (one-stream decode step 2.4x faster there; docs/measurements.md, "Which q4 kernel on
    AVX-512, again")."""
    return "native" if why_unavailable() is None else "torch"


def why_unavailable() -> str | None:
    """None where the native kernel is built or can be built; else the reason, for the log."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = [flag for flag in CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if not library_path().is_file() and compiler() is None:
        return "it is not built and there is no C++ compiler (set $CXX) to build it"
    return None


def ensure_built() -> None:
    """Builds the library unless it is built (KernelUnavailable where it cannot run here)."""
    reason = why_unavailable()
    if reason is not None:
        raise KernelUnavailable(f"the native q4 kernel cannot run here: {reason}")
    if not library_path().is_file():
        build(library_path())


def load() -> None:
    """Registers torch.ops.pdserve.q4_1_linear, building the library first if it is not built."""
    global _loaded
    if _loaded:
        return
    ensure_built()
    import torch

    torch.ops.load_library(str(library_path()))
    _loaded = True


def build(path: Path) -> None:
    """Compiles the library to `path`: into a temporary file first, renamed into place, so two
    processes building at once each finish with a whole library."""
    import torch.utils.cpp_extension as ext

    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler to build the native q4 kernel (set $CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log.info(
        "building the native library (q4 kernel, step ops; once per source and torch version) "
        "into %s",
        path,
    )
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        partial = Path(scratch) / path.name
        command = [cxx, *FLAGS, *_torch_flags(ext), *map(str, SOURCES), "-o", str(partial)]
        command += [f"-L{d}" for d in ext.library_paths()] + ["-lc10", "-ltorch_cpu"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelUnavailable(
                f"building the native q4 kernel failed ({cxx}, exit {done.returncode}):\n"
                + done.stderr[-4000:]
            )
        os.replace(partial, path)
    # Other sources' builds (and those from before the step ops joined): never loaded again.
    for stale in [*path.parent.glob(LIBRARY_PREFIX + "*.so"), *path.parent.glob("q4_1_avx2-*.so")]:
        if stale != path:
            stale.unlink(missing_ok=True)
    log.info("built the native library in %.0f s", time.perf_counter() - started)


def _torch_flags(ext) -> list[str]:
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{d}" for d in ext.include_paths()] + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


def library_path() -> Path:
    """Where the library for this source, torch version and flags lives (built or not)."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    digest.update(importlib.metadata.version("torch").encode())
    digest.update(" ".join(FLAGS).encode())
    directory = os.environ.get("PDSERVE_KERNEL_DIR") or Path(sys.prefix) / "share/pdserve-kernels"
    return Path(directory) / f"{LIBRARY_PREFIX}{digest.hexdigest()[:16]}.so"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main() -> int:
    """`python -m pdserve.kernels.native`: build the library now (scripts/install.sh runs it).
    Exits 0 where the kernel cannot run here, saying why: only --q4-kernel native needs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = why_unavailable()
    if reason is not None:
        print(
            f"native library: not built ({reason}); --q4-kernel native and --step-ops native "
            "are unavailable"
        )
        return 0
    started = time.perf_counter()
    load()
    print(f"native library: {library_path()} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
