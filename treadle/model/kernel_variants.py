"""The native library's variants: the instruction sets each is compiled for, which CPUs run it,
its flags, and the hash of the sources a build was made from.

The package's build (setup.py) compiles every variant of `PREBUILT` into `treadle/model/prebuilt/`
with a manifest of the sources' hash and torch's version, as ggml's CPU backend ships one library
per CPU class and picks one at run time. kernels.py picks the variant the capability probe names
and loads the prebuilt one where its manifest matches, else builds that variant at first use.
Standard library only: setup.py loads this file by path, before the package's dependencies exist.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
MANIFEST = "manifest.json"
EXTENSION = "treadle_kernels"
X86_64 = ("x86_64", "AMD64")
# Fixed levels, not -march=native, so that one build serves every CPU of its class.
# avx512: VNNI's int8 dot products in the quantized kernels; AVX-512 BF16's dot products (prefill
# attention) are chosen at run time, so a VNNI CPU without them runs this one too.
MARCH = {"avx512": ["-march=x86-64-v4", "-mavx512vnni"], "avx2": ["-march=x86-64-v3"]}
PREBUILT = tuple(MARCH)  # what an x86-64 wheel carries; "generic" is built at first use only


def variant_for(machine: str, isa: str, vnni: bool) -> str:
    """The variant a CPU runs, from the probe: `isa` is the level torch runs at, so
    ATEN_CPU_CAPABILITY=avx2 picks avx2 on an AVX-512 machine."""
    if machine in X86_64 and isa.startswith("AVX512") and vnni:
        return "avx512"
    if machine in X86_64 and isa in ("AVX2", "AVX512"):
        return "avx2"
    return "generic"


def build_flags(machine: str, variant: str) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) of `variant`'s library on `machine`."""
    # -g0: Python's own CFLAGS, which setuptools passes on, ask for debug info (slower, larger).
    cflags = ["-O3", "-g0", "-fopenmp", "-fno-math-errno", *MARCH.get(variant, [])]
    ldflags = ["-fopenmp"]
    if machine in X86_64:
        ldflags.append("-lmvec")  # glibc's vector math, for the vectorized exp
    return cflags, ldflags


def library_name(variant: str) -> str:
    """The library's module name (its PyInit symbol), the same prebuilt and built at first use."""
    return f"{EXTENSION}_{variant}"


def source_files(csrc: Path | None = None) -> list[Path]:
    """Every file a build reads: the sources and the headers they share."""
    return sorted((csrc or CSRC).glob("*.[ch]*"))


def source_hash(csrc: Path | None = None) -> str:
    key = hashlib.sha256()
    for path in source_files(csrc):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    return key.hexdigest()
