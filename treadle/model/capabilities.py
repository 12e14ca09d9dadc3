"""What this machine computes natively, and so which device, dtype and fast paths the model uses.

The one place that decides: `probe()` asks torch and oneDNN (not /proc/cpuinfo) once per process,
`resolve_device()` turns `--device auto` into cuda where torch sees a GPU, else cpu,
`resolve_dtype()` turns `--dtype auto` into a dtype with the reason, and the linear layers and the
attention kernels read `probe()` rather than testing the machine themselves.

Each fast path has a fallback that gives the same results, and any of them can be forced off on
any machine, so a test run on an AVX-512 machine also covers the AVX2 path and the reverse:
- `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` (torch's and oneDNN's own switches)
  make this process behave as an AVX2-only CPU: no native bfloat16, no bf16 prepacked weights,
  native kernels built for x86-64-v3;
- `TREADLE_DISABLE=onednn,native-kernels` (or `all`) turns those paths off by name.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import asdict, dataclass

import torch

from treadle.config import DEVICES, KV_CACHE_DTYPES
from treadle.errors import UnsupportedSetting

logger = logging.getLogger(__name__)

FAST_PATHS = ("onednn", "native-kernels")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Capabilities:
    machine: str  # x86_64, aarch64, ...
    isa: str  # torch's kernel level: AVX512, AVX2, DEFAULT, SVE256, ... (ATEN_CPU_CAPABILITY)
    avx512_bf16: bool
    amx: bool
    onednn: bool  # oneDNN present and not disabled: prepacked linear weights
    onednn_bf16: bool  # oneDNN can prepack bf16 weights (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
    native_bf16: bool  # bf16 matmuls run natively (AVX-512 BF16 or AMX), not emulated
    vnni: bool  # AVX-512 VNNI: int8 dot products in one instruction (quantized kernels)
    native_kernels_allowed: bool  # TREADLE_DISABLE does not name native-kernels
    disabled: tuple[str, ...]
    cuda: bool = False  # torch sees a CUDA GPU

    def as_dict(self) -> dict:
        return asdict(self)


def disabled_fast_paths() -> tuple[str, ...]:
    names = {n.strip() for n in os.environ.get("TREADLE_DISABLE", "").split(",") if n.strip()}
    if "all" in names:
        return FAST_PATHS
    unknown = names - set(FAST_PATHS)
    if unknown:
        logger.warning("TREADLE_DISABLE names unknown fast paths %s; known: %s",
                       sorted(unknown), ", ".join(FAST_PATHS))
    return tuple(n for n in FAST_PATHS if n in names)


@functools.cache
def probe() -> Capabilities:
    disabled = disabled_fast_paths()
    isa = torch.backends.cpu.get_cpu_capability()
    # torch.cpu's checks read the CPU itself; gate them by the kernel level torch will use, so
    # ATEN_CPU_CAPABILITY=avx2 pretends they are missing.
    avx512 = isa.startswith("AVX512")
    avx512_bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
    amx = avx512 and torch.cpu._is_amx_tile_supported()
    onednn = torch.backends.mkldnn.is_available() and "onednn" not in disabled
    # Honours ONEDNN_MAX_CPU_ISA: below AVX-512 it says no, as a Zen 3 does.
    onednn_bf16 = onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return Capabilities(
        machine=platform.machine(), isa=isa, avx512_bf16=avx512_bf16, amx=amx, onednn=onednn,
        onednn_bf16=onednn_bf16,
        native_bf16=(avx512_bf16 or amx) and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        vnni=avx512 and torch.cpu._is_vnni_supported(),
        native_kernels_allowed="native-kernels" not in disabled, disabled=disabled,
        cuda=torch.cuda.is_available())


def resolve_device(requested: str) -> str:
    """`auto`, `cpu` or `cuda` -> the device served on: auto is cuda where torch sees a GPU."""
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {requested!r}")
    cuda = probe().cuda
    if requested == "cuda" and not cuda:
        raise ValueError("--device cuda, but torch sees no CUDA GPU here (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); "
                         "use --device cpu or auto")
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    return requested


@functools.cache  # once per process: one warning, one answer
def resolve_dtype(requested: str, device: str = "cpu") -> tuple[str, str]:
    """`auto`, `float32` or `bfloat16` on a resolved `device` -> (the dtype served, why)."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if device == "cuda":
        return ("bfloat16", "CUDA GPUs compute bfloat16 natively") if requested == "auto" \
            else (requested, "requested")
    caps = probe()
    native = "AMX" if caps.amx else "AVX-512 BF16"
    if requested == "auto":
        if caps.native_bf16:
            # Half the weight bytes per decode step and native bf16 matmuls: measured faster
            # with `treadle bench forward` on the AVX-512 BF16 machines.
            return "bfloat16", f"this CPU computes bfloat16 natively ({native})"
        return "float32", ("this CPU has no native bfloat16 (no AVX-512 BF16 or AMX), "
                           "where bfloat16 is emulated and runs several times slower")
    if requested == "bfloat16" and not caps.native_bf16:
        logger.warning("--dtype bfloat16 on a CPU without native bfloat16 (no AVX-512 BF16 or "
                       "AMX): it runs on the portable path, several times slower; "
                       "--dtype auto or float32 is faster here")
        return "bfloat16", "requested; emulated on this CPU (portable path, slower)"
    return requested, "requested"


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """A dtype name (`auto` resolved here, for a resolved `device`) as torch's dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_dtype(name, device)[0]]


def resolve_kv_cache_dtype(requested: str, model_dtype: str, device: str) -> str:
    """`--kv-cache-dtype` on a resolved `device`, for a model served in the resolved
    `model_dtype` -> the KV cache's storage: float32, bfloat16 or int8. Auto is the model's
    dtype, but bfloat16 for a float32 model on the CPU: half the cache's bytes (llama.cpp keeps
    an f16 cache under float32 compute), and decode attention reads half as much.
    UnsupportedSetting for a storage other than the model's dtype on CUDA (the Triton decode
    kernel reads keys in the model's dtype only) and for float32 under a bfloat16 model."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {requested!r}")
    if requested == "auto":
        return "bfloat16" if device == "cpu" else model_dtype
    if requested == model_dtype:
        return requested
    if device != "cpu":
        raise UnsupportedSetting("kv_cache_dtype", f"--kv-cache-dtype {requested} is served on "
                                 f"the CPU only, not on {device}; use --kv-cache-dtype auto")
    if requested == "float32":
        raise UnsupportedSetting("kv_cache_dtype", "--kv-cache-dtype float32 stores a float32 "
                                 f"model's keys; this model is served in {model_dtype}")
    return requested


def use_onednn_linear(dtype: torch.dtype) -> bool:
    """Prepacked oneDNN weights: 1.2-2x faster than F.linear where oneDNN supports the dtype."""
    caps = probe()
    return caps.onednn if dtype == torch.float32 else caps.onednn_bf16
