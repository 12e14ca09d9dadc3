"""`treadle bench soak`: its duration parser, its /proc readers and metrics parser, and a short
run of the real command against a `treadle serve` it starts over a tiny random-weight model with
the default model's tokenizer (REST and gRPC, disconnects, bad requests), which must end with no
5xx, no transport error, no leaked KV block and memory samples of both processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from model_utils import TINY

from treadle.bench.soak import (
    OUTCOMES,
    child_pids,
    engine_pid,
    parse_duration,
    parse_metrics,
    read_rss,
)
from treadle.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("10m", 600), ("1h", 3600), ("2m30s", 150), ("45", 45), ("1.5m", 90),
    (" 15S ", 15)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", "0s", "-5s", "1 2", "m", "10m5", "s10"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_cli_takes_durations():
    args = build_parser().parse_args(["bench", "soak", "--duration", "90s", "--no-grpc"])
    assert (args.duration, args.concurrency, args.sample_interval) == (90, 16, 10.0)
    assert build_parser().parse_args(["bench", "soak"]).duration == 600
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "soak", "--duration", "soon"])


def fake_process(proc: Path, pid: int, rss_kb: int | None, ppid: int = 1, comm: str = "python",
                 cmdline: bytes = b"python\0", children: str | None = None) -> None:
    folder = proc / str(pid)
    (folder / "task" / str(pid)).mkdir(parents=True)
    status = f"Name:\t{comm}\nPid:\t{pid}\n" + ("" if rss_kb is None else
                                                f"VmRSS:\t{rss_kb:>8} kB\n")
    (folder / "status").write_text(status + "Threads:\t1\n")
    (folder / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194304\n")
    (folder / "cmdline").write_bytes(cmdline)
    if children is not None:
        (folder / "task" / str(pid) / "children").write_text(children)


def test_read_rss(tmp_path):
    fake_process(tmp_path, 10, 2048)
    fake_process(tmp_path, 11, None)  # a zombie has no VmRSS
    assert read_rss(10, tmp_path) == 2 << 20
    assert read_rss(11, tmp_path) is None
    assert read_rss(12, tmp_path) is None  # gone
    own = read_rss(os.getpid())
    assert own is not None and 10 << 20 < own < 64 << 30


def test_children_and_engine_from_proc(tmp_path):
    # Without task/*/children: found by the parent pid in /proc/*/stat (comm with ") (" in it).
    fake_process(tmp_path, 100, 500_000)
    fake_process(tmp_path, 101, 30_000, ppid=100, comm="py) (thon",
                 cmdline=b"python\0-c\0from multiprocessing.resource_tracker import main\0")
    fake_process(tmp_path, 102, 900_000, ppid=100,
                 cmdline=b"python\0-c\0from multiprocessing.spawn import spawn_main\0")
    fake_process(tmp_path, 103, 5_000, ppid=102)
    assert child_pids(100, tmp_path) == [101, 102]
    assert engine_pid(100, tmp_path) == 102  # the resource tracker is not the engine
    assert engine_pid(103, tmp_path) is None
    # With task/*/children, that file is the answer.
    fake_process(tmp_path, 200, 1000, children="202 201 ")
    fake_process(tmp_path, 201, 10, ppid=200)
    fake_process(tmp_path, 202, 20, ppid=200)
    assert child_pids(200, tmp_path) == [201, 202]
    assert engine_pid(200, tmp_path) == 202


def test_children_of_this_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid())
        assert engine_pid(os.getpid()) is not None
    finally:
        child.kill()
        child.wait()


def test_parse_metrics():
    text = """# HELP treadle:num_requests_running Requests in the running batch.
# TYPE treadle:num_requests_running gauge
treadle:num_requests_running{model_name="m"} 3.0
treadle:num_requests_waiting{model_name="m"} 0.0
treadle:kv_cache_usage_perc{model_name="m"} 0.015625
treadle:kv_cache_num_blocks{model_name="m"} 2048.0
treadle:num_requests_running_other{model_name="m"} 9.0
treadle:prompt_tokens_total{model_name="m",tenant="default"} 12.0
"""
    assert parse_metrics(text) == {"running": 3, "waiting": 0, "kv_cache_usage": 0.015625,
                                   "num_blocks": 2048}
    assert parse_metrics("") == {}


@pytest.mark.default_model  # its tokenizer
def test_short_soak(tiny_folder, tmp_path):
    report_path = tmp_path / "soak.json"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "bench", "soak", "--duration", "12s",
         "--sample-interval", "3", "--concurrency", "8", "--max-tokens", "16",
         "--model", str(tiny_folder), "--dtype", "float32",
         "--max-model-len", str(TINY["max_position_embeddings"]), "--engine-threads", "1",
         "--server-log", str(tmp_path / "server.log"), "--json", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    log = (tmp_path / "server.log").read_text(errors="replace")[-3000:]
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{log}"
    report = json.loads(report_path.read_text())
    assert set(report) >= {"config", "requests", "samples", "memory", "final", "errors",
                           "failures", "passed"}
    requests = report["requests"]
    assert set(requests["by_outcome"]) == set(OUTCOMES)
    assert requests["by_outcome"]["5xx"] == 0 and requests["by_outcome"]["transport"] == 0
    assert requests["by_outcome"]["wrong"] == 0, report["errors"]
    assert requests["by_outcome"]["4xx"] == 0, report["errors"]  # good requests all served
    assert requests["by_outcome"]["ok"] > 0 and requests["total"] > 20
    assert requests["by_outcome"]["rejected"] > 0  # bad requests were sent and refused
    assert {"completion", "chat-stream", "bad", "grpc"} <= set(requests["by_kind"])
    final = report["final"]
    assert final["leaked_blocks"] == 0 and final["num_blocks"] > 0
    assert final["running"] == 0 and final["waiting"] == 0 and final["kv_cache_usage"] == 0
    assert report["passed"] and report["failures"] == []
    samples = report["samples"]
    assert len(samples) >= 4  # at the start, every 3 s, at the end
    assert all(s["server_rss"] > 0 and s["engine_rss"] > 0 for s in samples)
    assert report["memory"]["server"]["first"] == samples[0]["server_rss"]
    assert report["memory"]["engine"]["last"] == samples[-1]["engine_rss"]
    assert "PASS" in result.stdout and "leaked blocks: 0" in result.stdout
    assert elapsed < 120
