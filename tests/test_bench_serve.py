"""`treadle bench serve` end to end: against a scripted SSE server (report, JSON, plots,
concurrency cap, failures), a scripted gRPC servicer, and a live `treadle serve`, whose own
usage the report's counts must match."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from test_bench_workloads import tiny_tokenizer

from treadle.cli import main
from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc


class ScriptedServer(ThreadingHTTPServer):
    """Streams `max_tokens` one-token chunks a few ms apart, then usage; answers 400 to a
    request for 13 tokens. Counts requests in flight."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.bodies: list[dict] = []


class ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.bodies.append(body)
            s.in_flight += 1
            s.most_in_flight = max(s.most_in_flight, s.in_flight)
        counted = True

        def count_out() -> None:
            # Before the response's last bytes: the client starts its next request as it reads
            # them, which can reach another handler before this thread runs on.
            nonlocal counted
            if counted:
                with s.lock:
                    s.in_flight -= 1
                counted = False

        try:
            if body["max_tokens"] == 13:
                error = json.dumps({"error": {"message": "too many tokens"}}).encode()
                count_out()
                self.send_response(400)
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for i in range(n):
                time.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": " w",
                                      "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            count_out()
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                             "data: [DONE]\n\n".encode())
        finally:
            count_out()


@pytest.fixture
def scripted():
    server = ScriptedServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer(1200).save_pretrained(str(path))
    return path


def test_report_json_and_plots_against_a_scripted_server(scripted, tokenizer_dir, tmp_path,
                                                         capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": list(range(5, 5 + k)), "output_len": n})
                                + "\n" for k, n in ((4, 3), (6, 5), (3, 13), (8, 1), (5, 4))))
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{scripted.server_port}",
                 "--model", "scripted", "--tokenizer", str(tokenizer_dir), "--workload", "file",
                 "--file", str(workload), "--request-rate", "200,400", "--max-concurrency", "2",
                 "--goodput", "ttft:60000", "--json", str(out), "--plot", str(plots),
                 "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    assert "Successful requests" in table and "P99 TTFT (ms)" in table
    assert "1 failed: HTTP 400: too many tokens" in table
    report = json.loads(out.read_text())
    assert [run["request_rate"] for run in report["runs"]] == [200, 400]
    for run in report["runs"]:
        assert (run["successful"], run["failed"]) == (4, 1)
        assert run["total_input_tokens"] == 4 + 6 + 8 + 5
        assert run["total_output_tokens"] == 3 + 5 + 1 + 4
        assert run["goodput"]["good_requests"] == 4
        assert run["errors"] == {"HTTP 400: too many tokens": 1}
        ok = [r for r in run["requests"] if r["success"]]
        assert [len(r["itl"]) for r in ok] == [2, 4, 0, 3]  # one chunk per token here
        assert all(0 < r["ttft"] <= r["e2e"] for r in ok)
    assert scripted.most_in_flight <= 2
    # one probe request (a token of the first prompt, one output token: it primes no cache for
    # the runs), then every request of each run; ids, exact lengths, greedy
    assert len(scripted.bodies) == 1 + 2 * 5
    assert (scripted.bodies[0]["prompt"], scripted.bodies[0]["max_tokens"]) == ([5], 1)
    body = next(b for b in scripted.bodies[1:] if b["max_tokens"] == 3)
    assert body == {"model": "scripted", "prompt": [5, 6, 7, 8], "max_tokens": 3,
                    "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["e2e_cdf.png", "itl_cdf.png", "p99_ttft_vs_rate.png",
                     "throughput_vs_rate.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_unreachable_server_is_a_clear_error(tokenizer_dir, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--tokenizer", str(tokenizer_dir), "--workload", "random", "--num-prompts", "2",
                 "--no-progress"])
    assert code == 1
    assert "first request" in capsys.readouterr().err


class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Streams chunks of two tokens (one for an odd last one), then Complete with usage;
    max_tokens 13 is refused, 11 ends in an engine error, 7 completes without usage."""

    def __init__(self) -> None:
        self.requests: list[tuple[pb.GenerateRequest, dict]] = []

    def Generate(self, request, context):
        self.requests.append((request, dict(context.invocation_metadata())))
        n = request.stop.max_tokens
        if n == 13:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many tokens")
        for first in range(0, n, 2):
            time.sleep(0.002)
            ids = list(range(first, min(n, first + 2)))
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ids, text=" w" * len(ids)))
        if n == 11:
            yield pb.GenerateResponse(complete=pb.Complete(finish_reason=pb.FINISH_REASON_ERROR))
            return
        usage = None if n == 7 else pb.Usage(prompt_tokens=len(request.token_ids.ids),
                                            completion_tokens=n)
        yield pb.GenerateResponse(complete=pb.Complete(finish_reason=pb.FINISH_REASON_LENGTH,
                                                       usage=usage))


def test_grpc_backend_against_a_scripted_servicer(tokenizer_dir, tmp_path):
    servicer = ScriptedGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": list(range(5, 5 + k)), "output_len": n})
                                + "\n" for k, n in ((4, 5), (6, 13), (3, 11), (8, 7), (2, 1))))
    out = tmp_path / "report.json"
    try:
        code = main(["bench", "serve", "--backend", "grpc", "--base-url", f"127.0.0.1:{port}",
                     "--model", "scripted", "--api-key", "sekrit", "--tokenizer",
                     str(tokenizer_dir), "--workload", "file", "--file", str(workload),
                     "--json", str(out), "--no-progress"])
    finally:
        server.stop(None)
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["successful"], run["failed"]) == (3, 2)
    assert run["errors"] == {"gRPC INVALID_ARGUMENT: too many tokens": 1,
                             "finished with FINISH_REASON_ERROR": 1}
    # usage where the server sent it; the chunks' token ids where it did not (7 tokens)
    assert run["total_output_tokens"] == 5 + 7 + 1
    assert run["total_input_tokens"] == 4 + 8 + 2
    ok = [r for r in run["requests"] if r["success"]]
    assert [len(r["itl"]) for r in ok] == [2, 3, 0]  # one gap per chunk of two tokens
    assert [r["output_tokens"] for r in ok] == [5, 7, 1]
    # TPOT over tokens, not chunks: the 5- and 7-token requests, 4 and 6 gaps of tokens
    tpots = [1e3 * (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok[:2]]
    assert run["tpot_ms"]["mean"] == pytest.approx(sum(tpots) / 2)
    # the probe (a token of the first prompt, one output token), then the run's requests in any
    # order
    probe = servicer.requests[0][0]
    assert (list(probe.token_ids.ids), probe.stop.max_tokens) == ([5], 1)
    request, metadata = next(r for r in servicer.requests[1:] if r[0].stop.max_tokens == 5)
    assert metadata["authorization"] == "Bearer sekrit"
    assert list(request.token_ids.ids) == [5, 6, 7, 8] and request.model == "scripted"
    assert (request.stop.max_tokens, request.stop.ignore_eos) == (5, True)
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "treadle.cli", "serve", "--dtype",
                                 "float32", "--port", str(port)], stdout=sink,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"treadle serve exited {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"treadle serve not ready in 300 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.default_model
def test_counts_match_the_live_servers_own_usage(live_server, tmp_path):
    from transformers import AutoTokenizer

    from treadle.bench.workloads import random_workload
    from treadle.model.source import resolve_model

    model = httpx.get(f"{live_server}/v1/models").json()["data"][0]["id"]
    out = tmp_path / "report.json"
    code = main(["bench", "serve", "--base-url", live_server, "--model", model,
                 "--workload", "random", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "8", "--range-ratio", "0.5", "--request-rate", "20",
                 "--max-concurrency", "2", "--json", str(out), "--no-progress"])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    # The same requests as bench serve built them (same tokenizer, seed, lengths), sent again
    # without streaming: the server's own usage must add up to the report's totals.
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).folder))
    requests = random_workload(tokenizer, 4, 16, 8, seed=0, range_ratio=0.5, with_text=False)
    usages = [httpx.post(f"{live_server}/v1/completions", timeout=120, json={
        "model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len,
        "ignore_eos": True, "temperature": 0.0}).json()["usage"] for r in requests]
    assert (run["successful"], run["failed"]) == (4, 0)
    assert run["total_input_tokens"] == sum(u["prompt_tokens"] for u in usages) \
        == sum(r.prompt_len for r in requests)
    assert run["total_output_tokens"] == sum(u["completion_tokens"] for u in usages) \
        == sum(r.output_len for r in requests)
    for record, r in zip(run["requests"], requests, strict=True):
        assert record["output_tokens"] == r.output_len
        assert len(record["itl"]) <= r.output_len - 1
        assert 0 < record["ttft"] <= record["e2e"]
    assert run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"] > 0
    # Each request with n: 2 (the fair-share scenario's heavy tenant uses n: 4).
    code = main(["bench", "serve", "--base-url", live_server, "--model", model,
                 "--workload", "random", "--num-prompts", "2", "--input-len", "16",
                 "--output-len", "8", "--range-ratio", "0.5", "--n", "2", "--json", str(out),
                 "--no-progress"])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    requests = random_workload(tokenizer, 2, 16, 8, seed=0, range_ratio=0.5, with_text=False)
    assert [r["output_tokens"] for r in run["requests"]] == [2 * r.output_len for r in requests]


@pytest.fixture(scope="module")
def live_grpc():
    """Treadle's frontends over an engine, in their own thread (bench serve runs its own loop in
    the test's thread): the gRPC one's address."""
    from treadle.frontend.async_engine import AsyncEngine

    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=0))
    wait_started(frontends, thread, timeout=300)
    yield f"127.0.0.1:{frontends.grpc_port}"
    stop_frontends(frontends, thread)


@pytest.mark.default_model
def test_grpc_counts_match_the_workload(live_grpc, tmp_path):
    from transformers import AutoTokenizer

    from treadle.bench.workloads import random_workload
    from treadle.model.source import resolve_model

    out = tmp_path / "report.json"
    code = main(["bench", "serve", "--backend", "grpc", "--base-url", live_grpc,
                 "--model", "SmolLM2-135M-Instruct", "--workload", "random",
                 "--num-prompts", "3", "--input-len", "12", "--output-len", "6",
                 "--range-ratio", "0.5", "--json", str(out), "--no-progress"])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).folder))
    requests = random_workload(tokenizer, 3, 12, 6, seed=0, range_ratio=0.5, with_text=False)
    assert (run["successful"], run["failed"]) == (3, 0)
    assert run["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert run["total_output_tokens"] == sum(r.output_len for r in requests)
    for record, r in zip(run["requests"], requests, strict=True):
        assert record["output_tokens"] == r.output_len
        assert len(record["itl"]) <= r.output_len - 1 and 0 < record["ttft"] <= record["e2e"]
