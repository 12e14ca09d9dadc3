"""Native kernels, compiled on first use with torch's C++ extension builder and cached.

All sources under csrc/ build into one extension, so that the fused decoder calls the other
kernels directly. Its build folder is keyed by what the library was built for: the machine, the
instruction-set level torch runs at (the capability probe's `isa`), the flags, the sources,
torch's version and its install folder.
A cache shared by two machines (a network home, an image built elsewhere) therefore never hands
an AVX-512 build to an AVX2 CPU, where it would die with SIGILL. The level maps to a fixed
`-march` (x86-64-v4/v3, plus VNNI where the probe finds it), not `-march=native`, so two CPUs of
one level share one build.

A kernel is None where its build or load fails (no compiler, say) or the probe disables it:
its caller then takes the pure-torch path, which gives the same results. On CUDA the decode
attention kernel and the layers' elementwise steps are Triton's (treadle/model/triton_attention.py,
triton_layers.py), the matrix products torch's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from treadle.model.capabilities import probe

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
EXTENSION = "treadle_kernels"


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_flags(machine: str, isa: str, vnni: bool = False) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) for this machine and instruction-set level."""
    cflags = ["-O3", "-fopenmp", "-fno-math-errno"]
    ldflags = ["-fopenmp"]
    if machine in ("x86_64", "AMD64"):
        march = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}.get(isa)
        if march is not None:
            cflags.append(f"-march={march}")
        if march == "x86-64-v4" and vnni:
            cflags.append("-mavx512vnni")  # int8 dot products for the quantized kernels
        ldflags.append("-lmvec")  # glibc's vector math, for the vectorized exp
    return cflags, ldflags


def build_folder(machine: str, isa: str, cflags: list[str], ldflags: list[str]) -> Path:
    from treadle.model.source import cache_dir

    key = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]*")):  # sources and the header they share
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    # torch's install folder too: its build command names torch's headers by path, so two
    # environments sharing one cache rebuilt each other's kernels at every load (seen: a fresh
    # clone's venv and the dev venv, a test timing out on a rebuild it did not expect).
    key.update(" ".join([*cflags, "|", *ldflags, "|", torch.__version__, "|",
                         str(Path(torch.__file__).parent)]).encode())
    return cache_dir() / "kernels" / f"{EXTENSION}-{machine}-{isa.lower()}-{key.hexdigest()[:12]}"


def this_build() -> tuple[Path, list[str], list[str]]:
    caps = probe()
    cflags, ldflags = build_flags(caps.machine, caps.isa, caps.vnni)
    return build_folder(caps.machine, caps.isa, cflags, ldflags), cflags, ldflags


def kernel_status() -> dict:
    """For `treadle env`: where the kernels are built, with which flags, whether they load.
    Loads only a library already built: building is the first model load's job."""
    folder, cflags, ldflags = this_build()
    built = any(folder.glob(f"{EXTENSION}*.so"))
    return {EXTENSION: {"folder": str(folder), "cflags": cflags, "ldflags": ldflags,
                        "allowed": probe().native_kernels_allowed, "built": built,
                        "loads": (load_kernels() is not None) if built else None}}


@functools.cache
def load_kernels() -> ModuleType | None:
    if not probe().native_kernels_allowed:
        return None
    folder, cflags, ldflags = this_build()
    start = time.perf_counter()
    try:
        with build_lock(folder):
            library = folder / f"{EXTENSION}.so"
            if library.exists():
                try:
                    return import_library(EXTENSION, library)
                except ImportError as e:  # a build killed while it linked
                    logger.warning("rebuilding %s: its library fails to load: %s", EXTENSION, e)
                    library.unlink()
            logger.info("compiling %s for %s into %s (first start on this CPU class: a few "
                        "minutes)", EXTENSION, probe().isa, folder)
            from torch.utils.cpp_extension import load

            module = load(name=EXTENSION, sources=[str(p) for p in sources()],
                          extra_cflags=cflags, extra_ldflags=ldflags,
                          build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, a library that fails to load: serve without it
        logger.warning("native kernels %s unavailable, using the torch path: %s", EXTENSION, e)
        return None
    logger.info("%s built in %.0f s", EXTENSION, time.perf_counter() - start)
    return module


def import_library(name: str, library: Path) -> ModuleType:
    """Import a library built before. Not through torch's `load`: that reruns ninja, which
    rebuilds whenever the source file is newer than the library, and a fresh clone's files all
    are (seen: `treadle env` in a new checkout spent 135 s recompiling two kernels its cache
    held). The folder is keyed by the source's content, so its library is that source's."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold the build folder's lock: an flock, which the OS releases when its holder dies.
    torch's own lock is a plain file that a killed build leaves behind, and every later start
    then waited on it forever (seen: a server killed while compiling hung the next starts; an
    age limit on the file still hung a start that began waiting before the limit passed).
    Every build goes through here, so whoever holds the flock is the only builder and a torch
    lock it finds is a dead build's."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


def elementwise_kernels(device: str = "cpu") -> ModuleType | None:
    """`rms_norm(x, weight, eps, scale_in_float32)`, `rope(x, cos, sin)`, `silu_and_mul(x)` for
    `device`'s tensors: the native library on the CPU, Triton's (treadle/model/triton_layers.py)
    on CUDA; None: the torch formulas."""
    if device == "cuda":
        return triton_module("triton_layers")
    return load_kernels() if device == "cpu" else None


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """treadle.model.<name>, a module of Triton kernels, or None where Triton does not
    import (its callers then take the torch path)."""
    try:
        return importlib.import_module(f"treadle.model.{name}")
    except ImportError as e:  # no Triton in this environment
        logger.warning("Triton unavailable, CUDA %s take the torch path: %s", name, e)
        return None


def paged_decode_attention(device: str = "cpu") -> Callable | None:
    """The paged decode kernel for `device`'s tensors: the native one on the CPU, Triton's on
    CUDA (where Triton imports); None: the torch path."""
    if device == "cuda":
        module = triton_module("triton_attention")
        return None if module is None else module.paged_decode_attention
    return native_paged_decode_attention()


@functools.cache  # built once, not per layer and step
def native_paged_decode_attention() -> Callable | None:
    module = load_kernels()
    if module is None:
        return None

    def native(q, k_cache, v_cache, block_tables, context_lens, scale, window=0,
               max_context_len=0):  # the CPU kernel needs no splits
        return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, window)
    return native


def quant_linear_kernels() -> ModuleType | None:
    """`quant_linear(x, weight, qtype, bias)` and `dequantize(weight, qtype, in_features)`."""
    return load_kernels()


def sampling_kernels() -> ModuleType | None:
    """`sample_rows(logits, temperatures, u)`: unfiltered sampling, one token a row."""
    return load_kernels()


def llama_decoder_class() -> type | None:
    """`LlamaDecoder`: a Llama-family model's decode steps over GGUF blocks in one call."""
    module = load_kernels()
    return None if module is None else module.LlamaDecoder
