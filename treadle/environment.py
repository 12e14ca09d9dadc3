"""`treadle env`: what a user pastes into a bug report (as vLLM's collect_env): versions, the CPU
and the features that matter, the GPU if torch sees one, the device and dtype `auto` pick, which
fast paths run and why, threads, and the kernel build."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

import torch

from treadle.model.capabilities import probe, resolve_device, resolve_dtype, use_onednn_linear
from treadle.model.kernels import kernel_status
from treadle.model.source import ModelLoadError, cache_dir, default_model_path

# Settings read from the environment that change what runs.
ENV_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TREADLE_DISABLE", "TREADLE_CACHE",
            "OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "CUDA_VISIBLE_DEVICES")


def cpu_model() -> str:
    with open("/proc/cpuinfo") if Path("/proc/cpuinfo").exists() else open(os.devnull) as f:
        for line in f:
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_env() -> dict:
    caps = probe()
    device = resolve_device("auto")
    dtype, reason = resolve_dtype("auto", device)
    gpu = None
    if caps.cuda:
        free, total = torch.cuda.mem_get_info()
        gpu = {"name": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
               "cuda": torch.version.cuda, "memory_free": free, "memory_total": total,
               "triton": version("triton")}
    try:
        model = str(default_model_path())
    except ModelLoadError as e:
        model = f"missing: {e}"
    return {
        "treadle": version("treadle"), "torch": torch.__version__,
        "transformers": version("transformers"), "python": sys.version.split()[0],
        "os": platform.platform(), "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_features": {name.removeprefix("_is_").removesuffix("_supported"): fn()
                         for name in sorted(dir(torch.cpu))
                         if name.startswith("_is_") and callable(fn := getattr(torch.cpu, name))},
        "capabilities": caps.as_dict(), "gpu": gpu, "device_auto": device,
        "dtype_auto": dtype, "dtype_auto_reason": reason,
        "onednn_linear": {"float32": use_onednn_linear(torch.float32),
                          "bfloat16": use_onednn_linear(torch.bfloat16)},
        "native_kernels": kernel_status(),
        "cache_folder": str(cache_dir()), "default_model": model,
        "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def kernel_lines(kernel: dict) -> list[str]:
    origin = ("prebuilt by the install" if kernel["prebuilt"]
              else f"compiled at first use: {kernel['not_prebuilt_because']}")
    if not kernel["allowed"]:
        state = "off (TREADLE_DISABLE)"
    elif not kernel["built"]:
        state = "not built yet (the first model load builds it)"
    else:
        state = "loads" if kernel["loads"] else "FAILS to load (torch path)"
    return [f"native kernels: {kernel['variant']} variant, {origin}; {state}",
            f"  library {kernel['library']}",
            f"  flags {' '.join(kernel['cflags'])} | {' '.join(kernel['ldflags'])}"]


def gpu_line(gpu: dict | None) -> str:
    if gpu is None:
        return "gpu: none that torch sees" + (" (torch built without CUDA)"
                                              if torch.version.cuda is None else "")
    triton = gpu["triton"] or "missing (decode attention takes the torch path)"
    return (f"gpu {gpu['name']} x{gpu['count']}, CUDA {gpu['cuda']}, "
            f"{gpu['memory_free'] / 2**30:.1f} of {gpu['memory_total'] / 2**30:.1f} GiB free, "
            f"triton {triton}")


def format_env(report: dict) -> str:
    caps = report["capabilities"]
    features = ", ".join(k for k, v in report["cpu_features"].items() if v) or "none"
    lines = [
        f"treadle {report['treadle']}  torch {report['torch']}  transformers "
        f"{report['transformers']}  python {report['python']}",
        f"os {report['os']}",
        f"cpu {report['cpu']}  ({report['cores']} cores, torch threads "
        f"{report['torch_threads']})",
        f"cpu features (torch): {features}",
        f"kernel level {caps['isa']} on {caps['machine']}; native bfloat16 "
        f"{'yes' if caps['native_bf16'] else 'no'}",
        gpu_line(report["gpu"]),
        f"device auto -> {report['device_auto']}",
        f"dtype auto -> {report['dtype_auto']}: {report['dtype_auto_reason']}",
        f"oneDNN prepacked linear: float32 {'on' if report['onednn_linear']['float32'] else 'off'}"
        f", bfloat16 {'on' if report['onednn_linear']['bfloat16'] else 'off'}",
        *kernel_lines(report["native_kernels"]),
        f"disabled fast paths: {', '.join(caps['disabled']) or 'none'}",
        f"cache folder {report['cache_folder']}",
        f"default model {report['default_model']}",
        "environment: " + (", ".join(f"{k}={v}" for k, v in report["environment"].items())
                           or "none of " + ", ".join(ENV_VARS)),
    ]
    return "\n".join(lines)
