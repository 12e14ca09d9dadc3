"""The capability probe and the paths it picks: `--dtype auto`, prepacked linear layers, the native
kernels' variant (prebuilt by the install, or built at first use), `treadle env`. Child processes
force the AVX2 path (as on a Zen 3) and the all-portable path, so an AVX-512 machine tests both and
an AVX2 one tests the fallbacks."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from conftest import AVX2_ENV, ROOT, free_port, run_forced

from treadle.model import capabilities, kernel_variants
from treadle.model.capabilities import probe, resolve_dtype
from treadle.model.kernel_variants import build_flags, library_name, variant_for
from treadle.model.kernels import build_folder, build_lock, this_build
from treadle.model.linear import Linear

PROBE = ("import json; from treadle.model.capabilities import probe, resolve_dtype; "
         "print(json.dumps({**probe().as_dict(), 'auto': resolve_dtype('auto')}))")


def test_auto_is_bfloat16_exactly_where_it_is_native():
    dtype, reason = resolve_dtype("auto")
    assert dtype == ("bfloat16" if probe().native_bf16 else "float32")
    assert reason


def test_an_avx2_cpu_gets_float32_and_no_bf16_prepack():
    result = run_forced(["-c", PROBE], AVX2_ENV)
    assert result.returncode == 0, result.stderr
    caps = json.loads(result.stdout)
    assert caps["isa"] == "AVX2"
    assert not caps["native_bf16"] and not caps["onednn_bf16"] and not caps["avx512_bf16"]
    assert caps["auto"][0] == "float32"


def test_disable_turns_fast_paths_off_by_name():
    result = run_forced(["-c", PROBE], {"TREADLE_DISABLE": "onednn,native-kernels"})
    caps = json.loads(result.stdout)
    assert not caps["onednn"] and not caps["onednn_bf16"]
    assert not caps["native_kernels_allowed"]
    assert caps["disabled"] == ["onednn", "native-kernels"]


def test_explicit_bfloat16_without_native_support_runs_with_one_warning():
    script = ("import logging, torch; logging.basicConfig()\n"
              "from treadle.model.capabilities import resolve_dtype\n"
              "from treadle.model.linear import Linear\n"
              "assert resolve_dtype('bfloat16') == resolve_dtype('bfloat16')\n"
              "w = torch.randn(64, 32).bfloat16(); x = torch.randn(3, 32).bfloat16()\n"
              "layer = Linear(w)\n"
              "assert not layer.prepacked\n"
              "assert torch.equal(layer(x), torch.nn.functional.linear(x, w))\n")
    result = run_forced(["-c", script], AVX2_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("without native bfloat16") == 1
    assert "--dtype auto or float32" in result.stderr


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_follows_the_probe_and_matches_f_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    layer = Linear(w, b)
    assert layer.prepacked == capabilities.use_onednn_linear(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert (layer(x).float() - F.linear(x, w, b).float()).abs().max().item() < tolerance * 10


def test_each_cpu_class_gets_its_variant_and_flags(monkeypatch):
    assert variant_for("x86_64", "AVX512", vnni=True) == "avx512"
    assert variant_for("x86_64", "AVX512", vnni=False) == "avx2"  # its int8 dots need VNNI
    assert variant_for("x86_64", "AVX2", vnni=False) == "avx2"
    assert variant_for("x86_64", "DEFAULT", vnni=False) == "generic"
    assert variant_for("aarch64", "DEFAULT", vnni=False) == "generic"
    v4, _ = build_flags("x86_64", "avx512")
    v3, ld3 = build_flags("x86_64", "avx2")
    arm, arm_ld = build_flags("aarch64", "generic")
    assert "-march=x86-64-v4" in v4 and "-mavx512vnni" in v4 and "-lmvec" in ld3
    assert "-march=x86-64-v3" in v3 and "-mavx512vnni" not in v3
    assert not any(f.startswith(("-march", "-mcpu")) for f in arm) and "-lmvec" not in arm_ld
    assert "-march=native" not in v4 + v3  # a shared cache must not hold a CPU-specific build
    folders = {build_folder("x86_64", "avx512", v4, ld3),
               build_folder("x86_64", "avx2", v3, ld3),
               build_folder("aarch64", "generic", arm, arm_ld)}
    assert len(folders) == 3
    here = build_folder("x86_64", "avx2", v3, ld3)
    assert f"{library_name('avx2')}-x86_64-" in str(here)
    monkeypatch.setattr(torch, "__file__", "/another/venv/torch/__init__.py")
    assert build_folder("x86_64", "avx2", v3, ld3) != here  # another torch install


def test_kernel_build_is_keyed_by_every_source_and_the_header(monkeypatch, tmp_path):
    flags = build_flags("x86_64", "avx2")
    shutil.copytree(kernel_variants.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(kernel_variants, "CSRC", tmp_path / "csrc")
    folders = {build_folder("x86_64", "avx2", *flags)}
    hashes = {kernel_variants.source_hash()}
    for path in sorted((tmp_path / "csrc").iterdir()):
        path.write_bytes(path.read_bytes() + b"\n")
        folders.add(build_folder("x86_64", "avx2", *flags))
        hashes.add(kernel_variants.source_hash())
    assert len(folders) == len(hashes) == 1 + len(list((tmp_path / "csrc").iterdir()))
    assert "kernels.h" in {p.name for p in (tmp_path / "csrc").iterdir()}


def edited_sources(tmp_path) -> Path:
    """A copy of csrc/ with one kernel edited, as a developer's editable install has it."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_variants.CSRC, csrc)
    with (csrc / "sampling.cpp").open("a") as f:
        f.write("// edited\n")
    return csrc


# A child process whose kernels read `csrc` (argv[1]): their first use builds where those are
# not the sources the package's variants were built from.
EDITED_KERNELS = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
                  "from pathlib import Path\n"
                  "from treadle.model import kernel_variants, kernels\n"
                  "kernel_variants.CSRC = Path(sys.argv[1])\n"
                  "kernels.PROGRESS_EVERY_S = 0.2\n"
                  "print(kernels.paged_decode_attention() is not None)\n")


def test_an_edited_kernel_is_built_at_first_use_with_progress_lines(tmp_path):
    """Not the package's variant, built from other sources: a build in the cache, whose log
    says every few seconds what is left; here the compiler fails, and the torch path serves."""
    compiler = tmp_path / "slow-failing-c++"
    compiler.write_text("#!/bin/sh\nsleep 1\nexit 1\n")
    compiler.chmod(0o755)
    result = run_forced(["-c", EDITED_KERNELS, str(edited_sources(tmp_path))],
                        {"TREADLE_CACHE": str(tmp_path / "cache"), "CXX": str(compiler)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    variant = this_build().variant
    assert f"compiling {library_name(variant)} into {tmp_path / 'cache'}" in result.stderr
    if this_build().prebuilt:
        assert "as the kernel sources changed since the package was built" in result.stderr
    assert "sources done, left: " in result.stderr and " s so far" in result.stderr
    assert f"native kernels {kernel_variants.EXTENSION} unavailable" in result.stderr


@pytest.mark.parametrize("env", [pytest.param({}, id="this-cpu"),
                                 pytest.param(AVX2_ENV, id="avx2")])
def test_the_installs_variant_loads_without_a_compiler(env, tmp_path):
    """The package's variant for this CPU (and for an AVX2 one) loads with no compiler and an
    empty cache, though the sources are newer than the library (a fresh clone's are)."""
    if not this_build().prebuilt:
        pytest.skip(f"no prebuilt kernels: {this_build().not_prebuilt_because}")
    os.utime(kernel_variants.CSRC / "sampling.cpp")
    script = ("import json\nfrom treadle.model.kernels import kernel_status, load_kernels\n"
              "print(load_kernels() is not None)\nprint(json.dumps(kernel_status()))\n")
    result = run_forced(["-c", script], {**env, "TREADLE_CACHE": str(tmp_path),
                                          "CXX": "/bin/false"}, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded, status = result.stdout.strip().splitlines()
    status = json.loads(status)
    assert loaded == "True" and status["prebuilt"] and status["loads"]
    assert status["variant"] == ("avx2" if env else this_build().variant)
    assert not list(tmp_path.iterdir())  # nothing built


def test_a_first_use_build_loads_though_its_sources_are_newer(tmp_path):
    """A fresh clone's files are all newer than the cache's libraries: a build in the cache
    loads as it is (here it could not rebuild: no compiler), and `treadle env` stays quick."""
    if not this_build().prebuilt:
        pytest.skip(f"no prebuilt library to stand for a cached build: "
                    f"{this_build().not_prebuilt_because}")
    csrc = edited_sources(tmp_path)
    cache = tmp_path / "cache"
    find_folder = ("import sys; from pathlib import Path\n"
                   "from treadle.model import kernel_variants, kernels\n"
                   "kernel_variants.CSRC = Path(sys.argv[1]); print(kernels.this_build().library)")
    result = run_forced(["-c", find_folder, str(csrc)], {"TREADLE_CACHE": str(cache)})
    library = Path(result.stdout.strip())
    assert library.is_relative_to(cache), result.stderr
    library.parent.mkdir(parents=True)
    shutil.copy(this_build().library, library)  # the same variant, as if built here before
    for path in csrc.iterdir():
        os.utime(path)
    result = run_forced(["-c", EDITED_KERNELS, str(csrc)],
                        {"TREADLE_CACHE": str(cache), "CXX": "/bin/false"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True", result.stderr
    assert "compiling" not in result.stderr


def test_treadle_env_reports_the_forced_path():
    result = run_forced(["-m", "treadle.cli", "env", "--json"], AVX2_ENV, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dtype_auto"] == "float32"
    assert report["capabilities"]["isa"] == "AVX2"
    kernel = report["native_kernels"]
    assert kernel["variant"] == "avx2"
    assert "-march=x86-64-v3" in kernel["cflags"] and "-mavx512vnni" not in kernel["cflags"]
    assert report["onednn_linear"] == {"float32": True, "bfloat16": False}
    # the forced settings, beside any the machine itself sets (OPENBLAS_CORETYPE on some)
    assert report["environment"].items() >= AVX2_ENV.items()
    text = run_forced(["-m", "treadle.cli", "env"], AVX2_ENV, timeout=120).stdout
    assert "dtype auto -> float32" in text and "native kernels: avx2 variant" in text
    if not torch.cuda.is_available():
        assert report["device_auto"] == "cpu" and report["gpu"] is None
        assert "gpu: none that torch sees" in text and "device auto -> cpu" in text


# The model's parity tests against transformers and the kernels' tests, rerun on the forced
# paths: the AVX2 path (kernels built for x86-64-v3: maddubs, not VNNI; bf16 weights not
# prepacked) and every fast path off.
PARITY_TESTS = ["tests/test_model_parity.py", "tests/test_attention.py", "tests/test_quantized.py",
                "tests/test_elementwise.py",
                "tests/test_loader.py::test_bfloat16_runner_stays_close_to_float32",
                "tests/test_capabilities.py::test_linear_follows_the_probe_and_matches_f_linear"]


def test_parity_on_the_forced_path(forced_env):
    # The install built the AVX2 variant: nothing compiles here.
    # Not the Triton kernels' cases: Triton's interpreter runs alike on every CPU path.
    result = run_forced(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not triton",
                         *PARITY_TESTS], forced_env, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary
    if forced_env == AVX2_ENV:  # the AVX2 variant's kernels run: nothing skips
        assert "skipped" not in summary



@pytest.mark.default_model
@pytest.mark.parametrize("env", [pytest.param({}, id="this-cpu"),
                                 pytest.param(AVX2_ENV, id="avx2")])
def test_serve_with_no_flags_answers_a_chat_completion(env, tmp_path):
    """`treadle serve` as the README starts it (no --dtype), on this CPU and as an AVX2 one."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "treadle.cli", "serve", "--port", str(port),
                                 "--max-model-len", "256"], cwd=ROOT,
                                env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not ready(url):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        card = client.models.list().data[0]
        assert card.dtype == ("float32" if env else resolve_dtype("auto")[0])
        assert card.platform["dtype_reason"]
        chat = client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
        assert "engine ready in" in log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_killed_builds_lock_is_removed_and_a_live_ones_kept(tmp_path):
    """A build killed mid-way leaves torch's lock file behind; waiting on it hung every later
    start. A live builder holds the flock (the next one waits); once it is killed, the next
    takes the lock at once and torch's leftover file is gone."""
    (tmp_path / "lock").touch()  # torch's file, as a killed build leaves it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from treadle.model.kernels import build_lock; "
         "lock = build_lock(Path(sys.argv[1])); lock.__enter__(); print('held', flush=True); "
         "time.sleep(600)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.flock") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live build: wait for it
        (tmp_path / "lock").touch()  # the holder is killed mid-build, leaving torch's file
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5
