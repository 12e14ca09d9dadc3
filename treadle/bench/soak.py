"""`treadle bench soak`: a bounded mixed load for a while, watching for leaks.

It starts `treadle serve` on free loopback ports (or takes `--base-url` of a running server,
and `--server-pid` to watch its memory), then for `--duration` keeps `--concurrency` clients
busy with a mix of requests: completions and chats, streamed and not, random `max_tokens`,
some `n` > 1, some stop strings, some streams closed mid-way (the client disconnects), some bad
requests that must get a 4xx, and gRPC Generate calls (some cancelled, some ended by `Abort`)
where the server has a gRPC port. Every `--sample-interval` seconds it records the resident
memory of the server process and of its engine process (from /proc), the server's /metrics
(running, waiting, KV cache usage) and the requests' outcomes so far. At the end it waits for
the server to go idle and checks that no request is left running or waiting and no KV cache
block is still in use.

The engine's resident memory grows as KV cache blocks are first written (the pool is allocated
zeroed, so its pages become resident when used, and the free list hands out the least recently
used block): up to the pool's size, that growth is no leak. Judge a long run by the growth after
the pool is warm, from the later samples.

The report: a table of the samples over time, the requests by kind and outcome, each process's
memory growth (first sample to last) and the leaked blocks. It exits 1 on any 5xx, transport
error, wrong answer (a bad request accepted, a stream without `[DONE]`, an error event), or a
server not idle at the end; 2 on bad arguments or a server that did not start.

Outcomes: ok; aborted (closed or aborted by the client on purpose); rejected (a bad request
refused with a 4xx, as it must be); 4xx (a good request refused, such as 429 under overload:
reported, not a failure); 5xx; transport (no answer: refused, reset, timed out); wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from treadle.sse import sse_data

OUTCOMES = ("ok", "aborted", "rejected", "4xx", "5xx", "transport", "wrong")
FAILING = ("5xx", "transport", "wrong")
MIB = 1 << 20
WORDS = ("the", "sea", "a", "quiet", "river", "runs", "under", "old", "stone", "bridges", "and",
         "light", "falls", "on", "green", "hills", "where", "children", "play", "until", "night",
         "comes", "slowly", "over", "town", "with", "its", "bells", "ringing", "softly", "café",
         "naïve", "über", "日本", "😀", ", ", ". ", "?", "\n")
STOPS = (".", "\n", "the", "ing", "é", "😀", "!!", "and the")
METRICS = {"treadle:num_requests_running": "running", "treadle:num_requests_waiting": "waiting",
           "treadle:kv_cache_usage_perc": "kv_cache_usage",
           "treadle:kv_cache_num_blocks": "num_blocks"}
# How often each kind of request is sent (gRPC kinds only where the server has a gRPC port).
MIX = {"completion": 3, "completion-stream": 3, "chat": 2, "chat-stream": 2, "disconnect": 1.5,
       "bad": 1.5, "grpc": 2, "grpc-cancel": 0.5, "grpc-abort": 0.5, "grpc-bad": 0.5}


def parse_duration(text: str) -> float:
    """'90s', '10m', '1.5h', '2m30s' or plain seconds ('45') -> seconds; ValueError if none."""
    text = text.strip().lower()
    units = {"": 1, "s": 1, "m": 60, "h": 3600}
    parts = re.fullmatch(r"(?:\d+(?:\.\d+)?[smh]?)+", text) and \
        re.findall(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if not parts or (len(parts) > 1 and any(unit == "" for _, unit in parts)):
        raise ValueError(f"{text!r} is not a duration such as 90s, 10m or 1h")
    seconds = sum(float(value) * units[unit] for value, unit in parts)
    if not seconds > 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def read_rss(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Resident memory of `pid` in bytes (VmRSS), or None if it is gone or unreadable."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                value, unit = line.split()[1:3]
                return int(value) * {"kB": 1 << 10, "mB": MIB, "gB": 1 << 30}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None  # a zombie has no VmRSS


def child_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The children of `pid`: from /proc/PID/task/*/children where the kernel has it, else by
    the parent pid in each /proc/*/stat."""
    children: set[int] = set()
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []
    found = False
    for task in tasks:
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
            found = True
        except (OSError, ValueError):
            continue
    if found:
        return sorted(children)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # pid (comm) state ppid ...: comm may hold spaces and parentheses.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(children)


def engine_pid(server_pid: int, proc: Path = Path("/proc")) -> int | None:
    """The server's engine process: its largest child that is not multiprocessing's resource
    tracker. Looked up at each sample, since a restarted engine has a new pid."""
    best: tuple[int, int] | None = None
    for child in child_pids(server_pid, proc):
        try:
            cmdline = (proc / str(child) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" in cmdline or b"semaphore_tracker" in cmdline:
            continue
        rss = read_rss(child, proc)
        if rss is not None and (best is None or rss > best[0]):
            best = (rss, child)
    return None if best is None else best[1]


def parse_metrics(text: str) -> dict[str, float]:
    """The load gauges of a Prometheus text page (summed over labels): running, waiting,
    kv_cache_usage and num_blocks, those the page has."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
            values[METRICS[name]] = values.get(METRICS[name], 0.0) + value
    return values


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Tally:
    """Outcomes by kind, and the first few failures' messages."""

    counts: dict[str, Counter] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    max_errors: int = 20

    def add(self, kind: str, outcome: str, message: str = "") -> None:
        self.counts.setdefault(kind, Counter())[outcome] += 1
        if outcome in FAILING + ("4xx",) and len(self.errors) < self.max_errors:
            self.errors.append(f"{kind}: {outcome}: {message}"[:300])

    def totals(self) -> dict[str, int]:
        total: Counter = Counter()
        for counts in self.counts.values():
            total.update(counts)
        return {outcome: total[outcome] for outcome in OUTCOMES}


def http_outcome(status: int, bad: bool) -> str:
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "rejected" if bad else "4xx"
    return "wrong" if bad else "ok"


class Load:
    """The request mix, sent by `concurrency` workers until `deadline` or `max_requests`."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_model_len: int,
                 max_tokens: int, grpc_target: str | None, api_key: str | None,
                 tally: Tally, seed: int, request_timeout: float) -> None:
        self.client, self.model, self.tally = client, model, tally
        self.max_model_len = max_model_len
        # Prompts stay under a quarter of the context (a chat template adds its own tokens).
        self.max_tokens = max(1, min(max_tokens, max_model_len // 2))
        self.max_words = max(1, min(48, max_model_len // 8))
        self.grpc_target = grpc_target
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.seed = seed
        self.timeout = request_timeout
        self.sent = 0
        kinds = {k: w for k, w in MIX.items() if grpc_target or not k.startswith("grpc")}
        self.kinds, self.weights = list(kinds), list(kinds.values())

    def text(self, rng: random.Random) -> str:
        return "".join(rng.choice(WORDS) + " " for _ in range(rng.randint(1, self.max_words)))

    def sampling(self, rng: random.Random) -> dict:
        body: dict = {"max_tokens": rng.randint(1, self.max_tokens),
                      "temperature": rng.choice((0.0, 0.0, 0.7, 1.0)), "seed": rng.randint(0, 99)}
        if rng.random() < 0.25:  # several samples: sampled, since greedy ones would be equal
            body["n"] = rng.randint(2, 4)
            body["temperature"] = rng.choice((0.7, 1.0))
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        if rng.random() < 0.2:
            body["ignore_eos"] = True
        return body

    async def run(self, workers: int, deadline: float, max_requests: int | None) -> None:
        grpc_channel = None
        stub = None
        if self.grpc_target:
            import grpc

            from treadle.server.grpc import treadle_pb2_grpc as pb_grpc

            grpc_channel = grpc.aio.insecure_channel(self.grpc_target)
            stub = pb_grpc.GenerationStub(grpc_channel)
        try:
            await asyncio.gather(*(self.worker(i, deadline, max_requests, stub)
                                   for i in range(workers)))
        finally:
            if grpc_channel is not None:
                await grpc_channel.close()

    async def worker(self, index: int, deadline: float, max_requests: int | None, stub) -> None:
        rng = random.Random(self.seed * 1_000_003 + index)
        number = 0
        while time.monotonic() < deadline and (max_requests is None or self.sent < max_requests):
            self.sent += 1
            number += 1
            kind = rng.choices(self.kinds, self.weights)[0]
            try:
                if kind.startswith("grpc"):
                    outcome, message = await asyncio.wait_for(
                        self.grpc_request(kind, rng, stub, f"soak-{index}-{number}"),
                        self.timeout)
                else:
                    outcome, message = await self.http_request(kind, rng)
            except TimeoutError:
                outcome, message = "transport", f"no answer in {self.timeout:g} s"
            except httpx.HTTPError as e:
                outcome, message = "transport", f"{type(e).__name__}: {e}"
            self.tally.add(kind, outcome, message)

    async def http_request(self, kind: str, rng: random.Random) -> tuple[str, str]:
        if kind == "bad":
            return await self.bad_request(rng)
        chat = kind.startswith("chat")
        body = {"model": self.model, **self.sampling(rng)}
        if chat:
            body["messages"] = [{"role": "user", "content": self.text(rng)}]
            if rng.random() < 0.3:
                body["messages"].insert(0, {"role": "system", "content": self.text(rng)})
        else:
            body["prompt"] = self.text(rng)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if kind == "disconnect":
            body.update(stream=True, ignore_eos=True, max_tokens=self.max_tokens)
            body.pop("stop", None)
            return await self.disconnect(path, body, rng.randint(1, 8))
        if not kind.endswith("stream"):
            response = await self.client.post(path, json=body)
            if response.status_code != 200:
                return http_outcome(response.status_code, False), response.text[:200]
            choices = response.json().get("choices", [])
            if len(choices) != body.get("n", 1):
                return "wrong", f"{len(choices)} choices for n={body.get('n', 1)}"
            return "ok", ""
        body.update(stream=True, stream_options={"include_usage": True})
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return http_outcome(response.status_code, False), response.text[:200]
            events = [data async for data in sse_data(response)]
        if not events or events[-1] != "[DONE]":
            return "wrong", "the stream ended without [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        if errors:
            return "wrong", f"error event: {errors[0]}"
        finished = sum(1 for c in chunks for choice in c.get("choices", ())
                       if choice.get("finish_reason") is not None)
        if finished != body.get("n", 1):
            return "wrong", f"{finished} finished choices for n={body.get('n', 1)}"
        return "ok", ""

    async def disconnect(self, path: str, body: dict, after: int) -> tuple[str, str]:
        """A stream the client closes after `after` events: the server must free it."""
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return http_outcome(response.status_code, False), response.text[:200]
            seen = 0
            async for _ in sse_data(response):
                seen += 1
                if seen >= after:
                    break  # leaving the block closes the connection mid-stream
        return "aborted", ""

    async def bad_request(self, rng: random.Random) -> tuple[str, str]:
        model, ctx = self.model, self.max_model_len
        cases: list[tuple[str, object]] = [
            ("/v1/completions", {"model": model}),
            ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -1}),
            ("/v1/completions", {"model": model, "prompt": "hi", "n": 0}),
            ("/v1/completions", {"model": model, "prompt": "hi", "temperature": "hot"}),
            ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": ctx + 1}),
            ("/v1/completions", {"model": model, "prompt": "hi", "stop": ["x"] * 1000}),
            ("/v1/completions", {"model": model, "prompt": "hi",
                                 "logit_bias": {str(i): 1 for i in range(1000)}}),
            ("/v1/completions", {"model": model, "prompt": "a\ud800b"}),
            ("/v1/completions", {"model": model, "prompt": "hi", "top_p": 7}),
            ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
            ("/v1/completions", b"\xff\xfe not json"),
            ("/v1/chat/completions", {"model": model, "messages": []}),
            ("/v1/chat/completions", {"model": model,
                                      "messages": [{"role": "wizard", "content": "hi"}]}),
            ("/v1/chat/completions", {"model": model, "messages": "hi"}),
            ("/v1/chat/completions", {"model": model, "stream": True, "n": -3,
                                      "messages": [{"role": "user", "content": "hi"}]}),
        ]
        path, body = rng.choice(cases)
        if isinstance(body, bytes):
            response = await self.client.post(path, content=body,
                                              headers={"content-type": "application/json"})
        else:
            # Not httpx's json=: it refuses to encode a lone surrogate.
            response = await self.client.post(
                path, content=json.dumps(body).encode(),
                headers={"content-type": "application/json"})
        outcome = http_outcome(response.status_code, True)
        return outcome, f"{response.status_code} for {str(body)[:80]}"

    async def grpc_request(self, kind: str, rng: random.Random, stub, label: str
                           ) -> tuple[str, str]:
        import grpc

        from treadle.server.grpc import treadle_pb2 as pb

        sampling = self.sampling(rng)
        stop = pb.StopCriteria(max_tokens=sampling["max_tokens"], stop=sampling.get("stop", ()),
                               ignore_eos=sampling.get("ignore_eos", False))
        n = sampling.get("n", 1)
        if kind == "grpc-bad":
            stop = pb.StopCriteria(max_tokens=self.max_model_len + 1)
        elif kind != "grpc":
            stop = pb.StopCriteria(max_tokens=self.max_tokens, ignore_eos=True)
            n = 1
        if rng.random() < 0.5:
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=self.text(rng))])
            inputs = {"chat": chat}
        else:
            inputs = {"text": self.text(rng)}
        message = pb.GenerateRequest(
            request_id=label, model=self.model, n=n, stop=stop,
            sampling=pb.SamplingParameters(temperature=sampling["temperature"],
                                           seed=sampling["seed"]), **inputs)
        call = stub.Generate(message, metadata=self.metadata)
        chunks = finished = aborted = 0
        after = rng.randint(1, 8)
        try:
            async for response in call:
                if response.WhichOneof("response") == "chunk":
                    chunks += 1
                    if chunks == after and kind == "grpc-cancel":
                        call.cancel()
                        return "aborted", ""
                    if chunks == after and kind == "grpc-abort":
                        await stub.Abort(pb.AbortRequest(request_id=label),
                                         metadata=self.metadata)
                    continue
                reason = response.complete.finish_reason
                if reason == pb.FINISH_REASON_ERROR:
                    return "5xx", "finished with FINISH_REASON_ERROR"
                aborted += reason == pb.FINISH_REASON_ABORT
                finished += 1
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.CANCELLED and kind == "grpc-cancel":
                return "aborted", ""
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED):
                return ("rejected" if kind == "grpc-bad" else "4xx"), f"{code.name}: " \
                    f"{e.details()}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "transport", f"{code.name}: {e.details()}"
            return "5xx", f"gRPC {code.name}: {e.details()}"
        if kind == "grpc-bad":
            return "wrong", "a request past the context was accepted"
        if finished != n:
            return "wrong", f"{finished} Completes for n={n}"
        if kind == "grpc-abort" and chunks >= after:
            return ("aborted", "") if aborted else ("ok", "")  # it may have finished first
        return "ok", ""


@dataclass
class Sample:
    t: float
    server_rss: int | None
    engine_rss: int | None
    engine_pid: int | None
    metrics: dict[str, float]
    outcomes: dict[str, int]

    def as_dict(self) -> dict:
        usage, blocks = self.metrics.get("kv_cache_usage"), self.metrics.get("num_blocks")
        return {"t": round(self.t, 2), "server_rss": self.server_rss,
                "engine_rss": self.engine_rss, "engine_pid": self.engine_pid,
                **{k: self.metrics.get(k) for k in ("running", "waiting", "kv_cache_usage")},
                "kv_blocks_used": None if usage is None or blocks is None
                else round(usage * blocks), "outcomes": self.outcomes}


async def fetch_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    return parse_metrics(response.text) if response.status_code == 200 else {}


async def take_sample(client: httpx.AsyncClient, server_pid: int | None, start: float,
                      tally: Tally) -> Sample:
    child = engine_pid(server_pid) if server_pid else None
    return Sample(t=time.monotonic() - start,
                  server_rss=read_rss(server_pid) if server_pid else None,
                  engine_rss=read_rss(child) if child else None, engine_pid=child,
                  metrics=await fetch_metrics(client), outcomes=tally.totals())


def is_idle(metrics: dict[str, float]) -> bool:
    return (metrics.get("running") == 0 and metrics.get("waiting") == 0
            and metrics.get("kv_cache_usage") == 0)


async def soak(base_url: str, duration: float, concurrency: int = 16,
               sample_interval: float = 10.0, server_pid: int | None = None,
               grpc_target: str | None = None, api_key: str | None = None,
               max_tokens: int = 64, max_requests: int | None = None, seed: int = 0,
               request_timeout: float = 120.0, idle_timeout: float = 30.0,
               progress: bool = True) -> dict:
    """Run the load against `base_url` and return the report (see `format_soak`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tally = Tally()
    async with httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=30.0, pool=None),
            limits=httpx.Limits(max_connections=concurrency + 4,
                                max_keepalive_connections=concurrency + 4)) as client:
        response = await client.get("/v1/models", timeout=30)
        response.raise_for_status()
        card = response.json()["data"][0]
        model, max_model_len = card["id"], card["max_model_len"]
        load = Load(client, model, max_model_len, max_tokens, grpc_target, api_key, tally, seed,
                    request_timeout)
        start = time.monotonic()
        samples = [await take_sample(client, server_pid, start, tally)]

        async def sampler() -> None:
            while True:
                await asyncio.sleep(sample_interval)
                samples.append(await take_sample(client, server_pid, start, tally))
                if progress:
                    print(format_row(samples[-1]), file=sys.stderr, flush=True)

        if progress:
            print(format_header(), file=sys.stderr, flush=True)
            print(format_row(samples[0]), file=sys.stderr, flush=True)
        sampling = asyncio.create_task(sampler())
        try:
            await load.run(concurrency, start + duration, max_requests)
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
        load_end = time.monotonic()
        # Idle: nothing running or waiting, no block in use (aborts take a step to free).
        final: dict[str, float] = {}
        idle_deadline = time.monotonic() + idle_timeout
        while True:
            final = await fetch_metrics(client)
            if is_idle(final) or time.monotonic() > idle_deadline:
                break
            await asyncio.sleep(0.2)
        idle_after = time.monotonic() - load_end
        samples.append(await take_sample(client, server_pid, start, tally))
        if progress:
            print(format_row(samples[-1]), file=sys.stderr, flush=True)
        health = await client.get("/health", timeout=10)
    return build_report(samples, tally, final, idle=is_idle(final), idle_after=idle_after,
                        healthy=health.status_code == 200,
                        config={"base_url": base_url, "grpc_target": grpc_target,
                                "model": model, "max_model_len": max_model_len,
                                "duration_s": duration, "concurrency": concurrency,
                                "sample_interval_s": sample_interval, "max_tokens": max_tokens,
                                "seed": seed, "server_pid": server_pid},
                        elapsed=load_end - start, sent=load.sent)


def memory_summary(values: list[int | None]) -> dict | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"first": known[0], "last": known[-1], "peak": max(known),
            "growth": known[-1] - known[0]}


def build_report(samples: list[Sample], tally: Tally, final: dict[str, float], *, idle: bool,
                 idle_after: float, healthy: bool, config: dict, elapsed: float, sent: int
                 ) -> dict:
    usage = final.get("kv_cache_usage")
    num_blocks = final.get("num_blocks")
    leaked = None if usage is None or num_blocks is None else round(usage * num_blocks)
    totals = tally.totals()
    failures = [f"{totals[o]} {o}" for o in FAILING if totals[o]]
    if usage is None:
        failures.append("no KV cache usage in /metrics")
    elif leaked or usage > 0:
        failures.append(f"{leaked if leaked is not None else 'some'} KV cache blocks leaked "
                        f"({usage:.2%} in use at idle)")
    if final.get("running") or final.get("waiting"):
        failures.append(f"not idle: {final.get('running'):g} running, "
                        f"{final.get('waiting'):g} waiting")
    if not healthy:
        failures.append("/health is not 200 at the end")
    return {
        "config": config, "elapsed_s": round(elapsed, 2), "requests_sent": sent,
        "requests": {"total": sum(totals.values()), "by_outcome": totals,
                     "by_kind": {k: dict(sorted(c.items())) for k, c in
                                 sorted(tally.counts.items())},
                     "rate_per_s": round(sum(totals.values()) / elapsed, 2) if elapsed else None},
        "samples": [s.as_dict() for s in samples],
        "memory": {"server": memory_summary([s.server_rss for s in samples]),
                   "engine": memory_summary([s.engine_rss for s in samples]),
                   "engine_pids": sorted({s.engine_pid for s in samples if s.engine_pid})},
        "final": {"running": final.get("running"), "waiting": final.get("waiting"),
                  "kv_cache_usage": usage, "num_blocks": num_blocks, "leaked_blocks": leaked,
                  "idle": idle, "idle_after_s": round(idle_after, 2), "healthy": healthy},
        "errors": tally.errors, "failures": failures, "passed": not failures,
    }


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def format_header() -> str:
    return (f"{'t (s)':>8} {'ok':>7} {'aborted':>7} {'rejected':>8} {'4xx':>5} {'5xx':>5} "
            f"{'transport':>9} {'wrong':>5} {'running':>7} {'waiting':>7} {'kv %':>6} "
            f"{'kv blocks':>9} {'server MiB':>10} {'engine MiB':>10}")


def format_row(sample: Sample | dict) -> str:
    s = sample.as_dict() if isinstance(sample, Sample) else sample
    o = s["outcomes"]

    def gauge(name: str, scale: float = 1.0, spec: str = ".0f") -> str:
        value = s.get(name)
        return "-" if value is None else format(value * scale, spec)

    return (f"{s['t']:>8.1f} {o['ok']:>7} {o['aborted']:>7} {o['rejected']:>8} {o['4xx']:>5} "
            f"{o['5xx']:>5} {o['transport']:>9} {o['wrong']:>5} {gauge('running'):>7} "
            f"{gauge('waiting'):>7} {gauge('kv_cache_usage', 100, '.2f'):>6} "
            f"{gauge('kv_blocks_used'):>9} "
            f"{mib(s['server_rss']):>10} {mib(s['engine_rss']):>10}")


def format_soak(report: dict) -> str:
    config, final, requests = report["config"], report["final"], report["requests"]
    lines = [f"soak: {config['model']} at {config['base_url']}"
             + (f" (+ gRPC {config['grpc_target']})" if config["grpc_target"] else "")
             + f", {config['concurrency']} clients, {report['elapsed_s']:.0f} s",
             "", format_header(), *(format_row(s) for s in report["samples"]), "",
             f"requests: {requests['total']} ({requests['rate_per_s']}/s): "
             + ", ".join(f"{n} {o}" for o, n in requests["by_outcome"].items()),
             f"5xx: {requests['by_outcome']['5xx']}, transport errors: "
             f"{requests['by_outcome']['transport']}, wrong answers: "
             f"{requests['by_outcome']['wrong']}"]
    for kind, counts in requests["by_kind"].items():
        lines.append(f"  {kind:<18} " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    for name in ("server", "engine"):
        m = report["memory"][name]
        lines.append(f"{name} RSS: " + ("not measured" if m is None else
                     f"{mib(m['first'])} -> {mib(m['last'])} MiB ({m['growth'] / MIB:+.1f} "
                     f"MiB), peak {mib(m['peak'])} MiB"))
    if len(report["memory"]["engine_pids"]) > 1:
        lines.append(f"engine pids: {report['memory']['engine_pids']} (the engine restarted)")
    usage = final["kv_cache_usage"]
    count = {name: "-" if final[name] is None else f"{final[name]:g}"
             for name in ("running", "waiting", "num_blocks")}
    lines.append(f"at the end: {count['running']} running, {count['waiting']} waiting, KV "
                 f"cache {'-' if usage is None else f'{usage:.2%}'} in use, leaked blocks: "
                 f"{'unknown' if final['leaked_blocks'] is None else final['leaked_blocks']} "
                 f"of {count['num_blocks']}, idle {final['idle_after_s']} s after the load")
    for error in report["errors"][:10]:
        lines.append(f"  error: {error}")
    lines.append("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))
    return "\n".join(lines)


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(threads=None)  # the client runs no model
    parser.add_argument("--duration", type=duration_arg, default=600.0,
                        help="how long to send load: 90s, 10m, 1h (default 10m)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients at once")
    parser.add_argument("--sample-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between samples of memory and /metrics")
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start `treadle serve` on free "
                             "loopback ports and stop it at the end)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --base-url: the server's pid, to sample its and its "
                             "engine's memory")
    parser.add_argument("--grpc-target", default=None, metavar="HOST:PORT",
                        help="with --base-url: send gRPC calls too")
    parser.add_argument("--no-grpc", action="store_true", help="REST only")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as a bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="largest max_tokens drawn (at most half the context)")
    parser.add_argument("--max-requests", type=int, default=1_000_000,
                        help="stop sending after this many requests")
    parser.add_argument("--request-timeout", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument("--idle-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long the server may take to go idle after the load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the report as JSON to FILE (alone: print it instead of "
                             "the table)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no sample rows on stderr while it runs")
    started = parser.add_argument_group("the server it starts (without --base-url)")
    started.add_argument("--model", default=None,
                         help="Hugging Face folder or .gguf file (default: the default model)")
    started.add_argument("--dtype", default=None)
    started.add_argument("--max-model-len", type=int, default=None)
    started.add_argument("--engine-threads", type=int, default=None,
                         help="the server's --threads")
    started.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                         help="one more argument for `treadle serve` (repeatable), e.g. "
                              "--server-arg=--max-num-seqs=32")
    started.add_argument("--server-log", default=None, metavar="FILE",
                         help="the server's output (default: a temporary file, shown if it "
                              "fails)")
    started.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")


def start_server(args: argparse.Namespace, log) -> tuple[subprocess.Popen, str, str | None]:
    """`treadle serve` on free loopback ports, in its own session; once /health answers 200:
    the process, the base URL and the gRPC target (None with --no-grpc)."""
    port = free_port()
    command = [sys.executable, "-m", "treadle.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]
    grpc_target = None
    if not args.no_grpc:  # treadle serve opens gRPC only when given a port
        grpc_port = free_port()
        command += ["--grpc-port", str(grpc_port)]
        grpc_target = f"127.0.0.1:{grpc_port}"
    for flag, value in (("--model", args.model), ("--dtype", args.dtype),
                        ("--max-model-len", args.max_model_len),
                        ("--threads", args.engine_threads)):
        if value is not None:
            command += [flag, str(value)]
    if args.api_key:
        command += ["--api-key", args.api_key]
    command += args.server_arg
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not answer /health in {args.startup_timeout:g} s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, grpc_target
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout: float = 40.0) -> int | None:
    """SIGTERM, as a process manager stops it; SIGKILL to its whole session past `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine too, if anything is left
    return proc.wait()


def run_soak(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or not args.sample_interval > 0 or args.max_tokens < 1:
        print("treadle: --concurrency, --sample-interval and --max-tokens must be positive",
              file=sys.stderr)
        return 2
    if args.base_url is None and (args.server_pid is not None or args.grpc_target):
        print("treadle: --server-pid and --grpc-target go with --base-url", file=sys.stderr)
        return 2
    proc = None
    log_path = Path(args.server_log) if args.server_log else None
    temp_log = False
    if args.base_url is None:
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="treadle-soak-", suffix=".log")
            os.close(handle)
            log_path, temp_log = Path(name), True
        with log_path.open("wb") as log:
            try:
                proc, base_url, grpc_target = start_server(args, log)
            except RuntimeError as e:
                print(f"treadle: {e}; its log, {log_path}:\n"
                      f"{log_path.read_text(errors='replace')[-4000:]}", file=sys.stderr)
                return 2
        server_pid = proc.pid
        if args.progress:
            print(f"started treadle serve (pid {proc.pid}) at {base_url}"
                  + (f", gRPC {grpc_target}" if grpc_target else "") + f"; log: {log_path}",
                  file=sys.stderr)
    else:
        base_url, server_pid = args.base_url, args.server_pid
        grpc_target = None if args.no_grpc else args.grpc_target
    try:
        report = asyncio.run(soak(base_url, args.duration, args.concurrency,
                                  args.sample_interval, server_pid, grpc_target, args.api_key,
                                  args.max_tokens, args.max_requests, args.seed,
                                  args.request_timeout, args.idle_timeout, args.progress))
    except (httpx.HTTPError, KeyError, ValueError) as e:
        print(f"treadle: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            status = stop_server(proc)
            if args.progress:
                print(f"stopped the server (exit status {status})", file=sys.stderr)
    if proc is not None and (not temp_log or not report["passed"]):
        report["config"]["server_log"] = str(log_path)  # kept: named by --server-log, or failed
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_soak(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    if temp_log and report["passed"]:
        log_path.unlink(missing_ok=True)
    return 0 if report["passed"] else 1

