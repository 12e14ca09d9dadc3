"""Shared test helpers: runs of pytest or Python in a child process with a forced CPU path, a
server in a thread, a tiny chat model, and the checks that an engine ended empty."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on the CPU. That is chosen when
# triton is first imported (its own library functions are decorated then), and torch's dynamo,
# which transformers' models import, imports it: so here, before any other import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from model_utils import TINY

from treadle.core.engine_core import EngineCore
from treadle.core.kv_cache import KVCacheManager
from treadle.core.sched.scheduler import Scheduler
from treadle.model.kernels import load_kernels, prebuilt_library, this_build
from treadle.model.source import resolve_model

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


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random-weight Llama with the default model's tokenizer and chat template: fast, and
    real text goes in and out."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer_folder = resolve_model(None).folder
    vocab = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": vocab, "tie_word_embeddings": True})
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder


@pytest.fixture(scope="session", autouse=True)
def kernel_variants_built() -> None:
    """Each native-kernel variant the suite runs, built at most once per run, here: this CPU's,
    and the AVX2 one that AVX2_ENV's child processes load on an AVX-512 machine. Where the
    install's prebuilt variant fits (the sources it was built from), this only loads it;
    otherwise (an edited kernel, a checkout never installed) the variant is built into the
    cache once, not by the first child of each test file that forces the path, under its timeout."""
    build = this_build()
    load_kernels()
    if build.variant == "avx512" and prebuilt_library("avx2")[0] is None:
        result = run_forced(["-c", "from treadle.model.kernels import load_kernels; "
                             "load_kernels()"], AVX2_ENV, timeout=1200)
        assert result.returncode == 0, result.stderr


@pytest.fixture(params=[pytest.param(AVX2_ENV, id="avx2"),
                        pytest.param(PORTABLE_ENV, id="portable")])
def forced_env(request) -> dict[str, str]:
    return request.param


def assert_kv_cache_empty(manager: KVCacheManager) -> None:
    """After every request has ended: no tables, every block free with ref count 0."""
    manager.check_invariants()
    assert not manager.block_tables, f"block tables left: {sorted(manager.block_tables)}"
    assert not manager.block_hashes, f"block hashes left: {sorted(manager.block_hashes)}"
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """After every request has ended: no requests left and the KV cache entirely free."""
    scheduler.check_invariants()
    assert not scheduler.requests, f"requests left: {sorted(scheduler.requests)}"
    assert_kv_cache_empty(scheduler.kv_cache_manager)


def assert_engine_empty(core: EngineCore) -> None:
    """After every request has ended: no requests, every block free with ref count 0, the free
    list and hash map consistent, no seeded generators left behind."""
    assert_scheduler_empty(core.scheduler)
    assert not core.generators, f"generators left: {sorted(core.generators)}"
    assert not core.compiling, f"requests left compiling: {sorted(core.compiling)}"


def on_triton_device(kernel):
    """A Triton kernel called on the GPU where there is one (compiled Triton takes CUDA tensors
    only), with its result back on the CPU; else as is (interpreted)."""
    if not torch.cuda.is_available():
        return kernel

    def on_gpu(*args):
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        return kernel(*args).cpu()
    return on_gpu


@pytest.fixture
def triton_attention():
    """treadle.model.triton_attention, its kernel compiled on a GPU and interpreted on the CPU
    (TRITON_INTERPRET, set above), or the test is skipped without Triton."""
    pytest.importorskip("triton")
    import treadle.model.triton_attention

    return treadle.model.triton_attention


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The Gemma 3 270M GGUF (the second model family), or the test is skipped."""
    from treadle.model.source import ModelLoadError, gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelLoadError as e:
        pytest.skip(f"Gemma 3 270M GGUF not installed: {e}")
