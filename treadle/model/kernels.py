"""Native kernels: one library of every kernel in csrc/ (the fused decoder calls the others
directly), in the variant for this CPU that the capability probe picks (kernel_variants.py).

The package's build compiles the x86-64 variants into treadle/model/prebuilt/ (setup.py), so a
start only loads one. A variant is compiled here, at first use, with torch's C++ extension
builder, only where the package has none that fits: a CPU it carries no variant for (ARM, x86
before AVX2), or kernel sources changed since the build (an edited kernel in an editable install
rebuilds itself). That build's cache folder is keyed by the variant's flags, the sources, torch's
version and its install folder, so a cache shared by two machines never hands an AVX-512 build to
an AVX2 CPU, where it would die with SIGILL.

A kernel is None where the library neither loads nor builds (no compiler, say) or the probe
disables it: its caller then takes the pure-torch path, which gives the same results. On CUDA the
decode attention kernel and the layers' elementwise steps are Triton's
(treadle/model/triton_attention.py, triton_layers.py), the matrix products torch's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from treadle.model import kernel_variants
from treadle.model.capabilities import probe
from treadle.model.kernel_variants import (
    EXTENSION,
    build_flags,
    library_name,
    source_files,
    source_hash,
    variant_for,
)

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0  # a first-use build's progress line


@dataclass(frozen=True)
class KernelBuild:
    """The library this process loads: the package's prebuilt variant, or a first-use build."""
    variant: str
    library: Path
    prebuilt: bool
    not_prebuilt_because: str  # "" where prebuilt
    cflags: list[str]
    ldflags: list[str]


def this_build() -> KernelBuild:
    caps = probe()
    variant = variant_for(caps.machine, caps.isa, caps.vnni)
    cflags, ldflags = build_flags(caps.machine, variant)
    library, because = prebuilt_library(variant)
    if library is None:
        folder = build_folder(caps.machine, variant, cflags, ldflags)
        library = folder / f"{library_name(variant)}.so"
    return KernelBuild(variant, library, not because, because, cflags, ldflags)


def prebuilt_library(variant: str) -> tuple[Path | None, str]:
    """The package's library of `variant` where it was built from these sources for this
    torch; else None and why not."""
    try:
        manifest = json.loads((kernel_variants.PREBUILT_DIR / kernel_variants.MANIFEST).read_text())
    except FileNotFoundError:
        return None, "the package was built without native kernels"
    name = manifest["libraries"].get(variant)
    if name is None:
        return None, f"the package carries no {variant} variant"
    if manifest["sources"] != source_hash():
        return None, "the kernel sources changed since the package was built"
    if manifest["torch"] != torch.__version__:
        return None, f"the package was built for torch {manifest['torch']}"
    return kernel_variants.PREBUILT_DIR / name, ""


def build_folder(machine: str, variant: str, cflags: list[str], ldflags: list[str]) -> Path:
    """A first-use build's cache folder."""
    from treadle.model.source import cache_dir

    # torch's install folder too: its build command names torch's headers by path, so two
    # environments sharing one cache rebuilt each other's kernels at every load (seen: a fresh
    # clone's venv and the dev venv, a test timing out on a rebuild it did not expect).
    key = hashlib.sha256(" ".join([source_hash(), *cflags, "|", *ldflags, "|", torch.__version__,
                                   "|", str(Path(torch.__file__).parent)]).encode())
    return cache_dir() / "kernels" / f"{library_name(variant)}-{machine}-{key.hexdigest()[:12]}"


def kernel_status() -> dict:
    """For `treadle env`: the variant, where its library is and why, with which flags, whether
    it loads. Loads only a library already built: building is the first model load's job."""
    build = this_build()
    built = build.library.exists()
    return {"variant": build.variant, "prebuilt": build.prebuilt,
            "not_prebuilt_because": build.not_prebuilt_because, "library": str(build.library),
            "cflags": build.cflags, "ldflags": build.ldflags,
            "allowed": probe().native_kernels_allowed, "built": built,
            "loads": (load_kernels() is not None) if built else None}


@functools.cache
def load_kernels() -> ModuleType | None:
    if not probe().native_kernels_allowed:
        return None
    build = this_build()
    try:
        if build.prebuilt:
            return import_library(library_name(build.variant), build.library)
        return build_at_first_use(build)
    except Exception as e:  # no compiler, a library that fails to load: serve without it
        logger.warning("native kernels %s unavailable, using the torch path: %s", EXTENSION, e)
        return None


def build_at_first_use(build: KernelBuild) -> ModuleType:
    name = library_name(build.variant)
    folder = build.library.parent
    with build_lock(folder):
        if build.library.exists():
            try:
                return import_library(name, build.library)
            except ImportError as e:  # a build killed while it linked
                logger.warning("rebuilding %s: its library fails to load: %s", name, e)
                build.library.unlink()
        logger.info("compiling %s into %s, as %s (under a minute on two cores)", name, folder,
                    build.not_prebuilt_because)
        start = time.perf_counter()
        with progress_lines(name, folder, start):
            from torch.utils.cpp_extension import load

            module = load(name=name, sources=[str(p) for p in source_files() if p.suffix == ".cpp"],
                          extra_cflags=build.cflags, extra_ldflags=build.ldflags,
                          build_directory=str(folder), verbose=False)
    logger.info("%s built in %.0f s", name, time.perf_counter() - start)
    return module


@contextlib.contextmanager
def progress_lines(name: str, folder: Path, start: float) -> Iterator[None]:
    """A log line every PROGRESS_EVERY_S while a build runs: which sources are still compiling
    and for how long so far (one line at its start said nothing for minutes)."""
    sources = [p for p in source_files() if p.suffix == ".cpp"]
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            left = [p.name for p in sources if not (folder / f"{p.stem}.o").exists()]
            logger.info("compiling %s: %d of %d sources done, %s; %.0f s so far", name,
                        len(sources) - len(left), len(sources),
                        f"left: {', '.join(left)}" if left else "linking",
                        time.perf_counter() - start)

    thread = threading.Thread(target=report, name="kernel-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def import_library(name: str, library: Path) -> ModuleType:
    """Import a library built before. Not through torch's `load`: that reruns ninja, which
    rebuilds whenever the source file is newer than the library, and a fresh clone's files all
    are (seen: `treadle env` in a new checkout spent 135 s recompiling two kernels its cache
    held). A library is its sources' by the manifest's hash or the cache folder's key."""
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
               max_context_len=0, k_scales=None, v_scales=None):  # the CPU needs no splits
        return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, window, k_scales, v_scales)
    return native


@functools.cache
def native_prefill_attention() -> Callable | None:
    """`prefill_attention(q, keys, values, scale, window)`: a chunk's causal attention on the
    CPU, each query over the keys up to its own; None where this build has none (no AVX2)."""
    module = load_kernels()
    if module is None or not module.prefill_attention_available():
        return None
    return module.prefill_attention


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
