"""Shared test helpers: runs of pytest or Python in a child process with a forced CPU path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# torch's and oneDNN's own switches: the child process behaves as an AVX2-only CPU (a Zen 3):
# no native bfloat16, no bf16 prepacked weights, kernels built for x86-64-v3.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# Every fast path off: F.linear and the pure-torch attention.
PORTABLE_ENV = {"TREADLE_DISABLE": "all"}


def run_forced(args: list[str], env: dict[str, str], timeout: float = 600
               ) -> subprocess.CompletedProcess:
    """`python ARGS` from the checkout's root, with `env` added to this environment."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=[pytest.param(AVX2_ENV, id="avx2"),
                        pytest.param(PORTABLE_ENV, id="portable")])
def forced_env(request) -> dict[str, str]:
    return request.param
