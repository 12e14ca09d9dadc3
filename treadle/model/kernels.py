"""Native kernels, compiled on first use with torch's C++ extension builder and cached.

The build folder is keyed by what the library was built for: the machine, the instruction-set
level torch runs at (the capability probe's `isa`), the flags, the source and torch's version.
A cache shared by two machines (a network home, an image built elsewhere) therefore never hands
an AVX-512 build to an AVX2 CPU, where it would die with SIGILL. The level maps to a fixed
`-march` (x86-64-v4/v3), not `-march=native`, so two CPUs of one level share one build.

`paged_decode_attention()` is None where the build or the load fails (no compiler, say) or the
probe disables it: attention then takes its pure-torch path, which gives the same results.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from treadle.model.capabilities import probe

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
NAME = "treadle_paged_attention"


def build_flags(machine: str, isa: str) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) for this machine and instruction-set level."""
    cflags = ["-O3", "-fopenmp", "-fno-math-errno"]
    ldflags = ["-fopenmp"]
    if machine in ("x86_64", "AMD64"):
        march = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}.get(isa)
        if march is not None:
            cflags.append(f"-march={march}")
        ldflags.append("-lmvec")  # glibc's vector math, for the vectorized exp
    return cflags, ldflags


def build_folder(machine: str, isa: str, cflags: list[str], ldflags: list[str]) -> Path:
    from treadle.model.loader import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join([*cflags, "|", *ldflags, "|", torch.__version__]).encode())
    return cache_dir() / "kernels" / f"{machine}-{isa.lower()}-{key.hexdigest()[:12]}"


def kernel_status() -> dict:
    """For `treadle env`: where the kernel is built, with which flags, whether it loads. Loads
    only a kernel already built: building is the first model load's job."""
    caps = probe()
    cflags, ldflags = build_flags(caps.machine, caps.isa)
    folder = build_folder(caps.machine, caps.isa, cflags, ldflags)
    built = any(folder.glob(f"{NAME}*.so"))
    return {"folder": str(folder), "cflags": cflags, "ldflags": ldflags,
            "allowed": caps.native_attention_allowed, "built": built,
            "loads": (paged_decode_attention() is not None) if built else None}


@functools.cache
def paged_decode_attention() -> Callable | None:
    caps = probe()
    if not caps.native_attention_allowed:
        return None
    from torch.utils.cpp_extension import load

    cflags, ldflags = build_flags(caps.machine, caps.isa)
    folder = build_folder(caps.machine, caps.isa, cflags, ldflags)
    fresh = not any(folder.glob(f"{NAME}*.so"))
    if fresh:
        logger.info("compiling the native paged-attention kernel for %s %s into %s "
                    "(first start on this CPU class: about a minute)", caps.machine, caps.isa,
                    folder)
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        module = load(name=NAME, sources=[str(SOURCE)], extra_cflags=cflags,
                      extra_ldflags=ldflags, build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, a library that fails to load: serve without it
        logger.warning("native paged attention unavailable, using the torch path: %s", e)
        return None
    if fresh:
        logger.info("native paged-attention kernel built in %.0f s", time.perf_counter() - start)
    return module.paged_decode_attention
