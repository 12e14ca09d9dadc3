"""`treadle bench serve`: replay a workload against an OpenAI-compatible server (Treadle, vLLM,
the llama.cpp server) over streaming `/v1/completions`, or against Treadle's gRPC API
(`grpc_client`), and report what `vllm bench serve` does.

Each request asks for exactly its output length (`max_tokens` with `ignore_eos`, greedy) and
for usage in the last chunk (`stream_options.include_usage`), so token counts are the server's
own; a server that sends no usage gets its token-carrying chunks counted instead. Arrivals
follow vLLM's: gaps drawn from a gamma distribution with shape `burstiness` and scale
1 / (rate * burstiness) (burstiness 1 is a Poisson process; a rate of inf sends everything at
once), optionally capped at `max_concurrency` requests in flight. A request's clock starts when
it is sent, after any wait for a concurrency slot, as in vLLM. `metrics` says how each number is
defined.

Tenants (`--tenants NAME:SHARE,...`): each request is drawn for a tenant in proportion to the
shares (seeded), so each tenant's arrivals are its share of the request rate; it is sent with the
tenant's API key where one is given (`--tenant-key NAME=KEY`), else with `user` set to the
tenant's name. A workload file may name each request's tenant instead (its "tenant" column;
rows without one are the default tenant); `--tenants` then is an error. Objectives
(`--slo ttft:MS,tpot:MS`) go on every request (`ttft_ms`, `tpot_ms`; over gRPC the fields of
those names) and are the goodput SLOs.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from tqdm import tqdm

from treadle.bench.grpc_client import GrpcBackend
from treadle.bench.metrics import PERCENTILES, RequestRecord, compute_metrics, tenant_metrics
from treadle.bench.streaming import Backend, Clock, Send, StreamTimer
from treadle.bench.workloads import BenchRequest, draw_adapters
from treadle.core.request import DEFAULT_TENANT
from treadle.sse import sse_data


def assign_tenants(n: int, shares: dict[str, float], seed: int = 0) -> list[str]:
    """Each of `n` requests' tenant, drawn in proportion to `shares` (seeded)."""
    if not shares or any(not share > 0 for share in shares.values()):
        raise ValueError(f"tenant shares must be > 0, got {shares}")
    rng = random.Random(seed + 1)
    names = list(shares)
    return rng.choices(names, weights=[shares[t] for t in names], k=n)


def workload_tenants(requests: list[BenchRequest], shares: dict[str, float] | None,
                     seed: int = 0) -> list[str] | None:
    """Each request's tenant: the workload's own when it names any (a file's "tenant" column),
    else drawn by `shares`; None without either."""
    if any(r.tenant is not None for r in requests):
        if shares:
            raise ValueError("the workload file names its tenants; drop --tenants")
        return [r.tenant or DEFAULT_TENANT for r in requests]
    return assign_tenants(len(requests), shares, seed) if shares else None


def parse_tenants(text: str) -> dict[str, float]:
    """"heavy:10,light1:1" -> {"heavy": 10.0, "light1": 1.0}."""
    shares = {}
    for item in text.split(","):
        name, sep, share = item.strip().rpartition(":")
        try:
            value = float(share) if sep and name else float("nan")
        except ValueError:
            value = float("nan")
        if not (value > 0 and not math.isinf(value)):
            raise ValueError(f"--tenants item {item!r} is not NAME:SHARE with SHARE > 0")
        shares[name] = value
    return shares


def parse_slo(text: str) -> dict[str, float]:
    """"ttft:500,tpot:50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    from treadle.bench.metrics import parse_goodput

    slos = parse_goodput([x.strip() for x in text.split(",") if x.strip()])
    if "e2el" in slos:
        raise ValueError("--slo takes ttft and tpot (objectives the server knows); use "
                         "--goodput e2el:MS for an end-to-end SLO")
    return slos


def send_times(requests: list[BenchRequest], request_rate: float, burstiness: float = 1.0,
               seed: int = 0) -> list[float]:
    """When to send each request: the arrivals a workload file gives, else `arrival_times`."""
    if requests and requests[0].arrival is not None:
        return [r.arrival for r in requests]
    return arrival_times(len(requests), request_rate, burstiness, seed)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
                  ) -> list[float]:
    """Send times (seconds from the start) of `n` requests: the first at 0, then gaps of
    gamma(shape=burstiness, scale=1 / (request_rate * burstiness)), mean 1 / request_rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, "
                         f"{burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


def error_message(body: bytes, status: int) -> str:
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {message}"


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int,
                       start: float, clock: Clock = time.perf_counter,
                       headers: dict[str, str] | None = None, tenant: str = ""
                       ) -> RequestRecord:
    """Stream one completion; `start` is the send time relative to the run's start."""
    record = RequestRecord(start=start, prompt_tokens=prompt_len, tenant=tenant)
    timer = StreamTimer(record, clock)
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                record.error = error_message(await response.aread(), response.status_code)
                return record
            async for data in sse_data(response):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    record.error = error.get("message", str(error)) \
                        if isinstance(error, dict) else str(error)
                    return record
                usage = event.get("usage") or usage
                choices = event.get("choices")
                # A chunk with no text that only closes the choice carries no token.
                if choices and (choices[0].get("text")
                                or choices[0].get("finish_reason") is None):
                    timer.token_chunk()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    return timer.finish(usage.get("completion_tokens"), usage.get("prompt_tokens"))


class OpenAIBackend:
    """Streaming POST {base_url}/v1/completions."""

    def __init__(self, base_url: str, model: str, requests: list[BenchRequest],
                 prompt_format: str, ignore_eos: bool, api_key: str | None = None,
                 tenants: list[str] | None = None, tenant_keys: dict[str, str] | None = None,
                 objectives: dict[str, float] | None = None,
                 request_models: list[str] | None = None, n: int = 1) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prompt_lens = [r.prompt_len for r in requests]
        self.tenants = tenants or [""] * len(requests)
        tenant_keys = tenant_keys or {}
        self.request_headers = [{"Authorization": f"Bearer {tenant_keys[t]}"}
                                if t in tenant_keys else None for t in self.tenants]
        self.payloads = []
        models = request_models or [model] * len(requests)
        for r, tenant, request_model in zip(requests, self.tenants, models, strict=True):
            payload = {"model": request_model,
                       "prompt": r.prompt_token_ids if prompt_format == "ids" else r.prompt,
                       "max_tokens": r.output_len, "temperature": 0.0 if n == 1 else 1.0,
                       "stream": True,
                       "stream_options": {"include_usage": True}}
            if ignore_eos:
                payload["ignore_eos"] = True
            if n > 1:
                payload["n"] = n
            if tenant and tenant not in tenant_keys:
                payload["user"] = tenant
            for name, ms in (objectives or {}).items():
                payload[f"{name}_ms"] = ms
            self.payloads.append(payload)

    @asynccontextmanager
    async def connect(self, max_connections: int | None) -> AsyncIterator[Send]:
        # No pool limit beyond the benchmark's own, so no request waits for a connection
        # unseen; reads may take as long as a long generation's gaps.
        client = httpx.AsyncClient(
            headers=self.headers, timeout=httpx.Timeout(600.0, connect=30.0, pool=None),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))
        async with client:
            yield lambda i, start: send_request(client, self.url, self.payloads[i],
                                                self.prompt_lens[i], start,
                                                headers=self.request_headers[i],
                                                tenant=self.tenants[i])


async def run_requests(backend: Backend, times: list[float], max_concurrency: int | None,
                       progress: bool) -> tuple[list[RequestRecord], float]:
    """Send request i at times[i] (capped at `max_concurrency` in flight);
    (records in workload order, the run's duration in seconds)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(times), disable=not progress, unit="req")

    async with backend.connect(max_concurrency) as send:
        begin = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, begin + times[i] - time.perf_counter()))
            if slots is None:
                record = await send(i, time.perf_counter() - begin)
            else:
                async with slots:
                    record = await send(i, time.perf_counter() - begin)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(times))))
        duration = time.perf_counter() - begin
    bar.close()
    return list(records), duration


def probe_request(first: BenchRequest) -> BenchRequest:
    """The untimed check that the server answers: the first request's first prompt token and
    one output token. The whole first request primed the prefix cache with a measured prompt,
    which the run then found cached or not as the arrival order fell."""
    text = None if first.prompt is None else first.prompt.strip()[:1] or first.prompt[:1]
    return BenchRequest(first.prompt_token_ids[:1], 1, text, first.tenant)


async def probe(backend: Backend) -> RequestRecord:
    async with backend.connect(None) as send:
        return await send(0, 0.0)


def bench_serve(base_url: str, model: str, requests: list[BenchRequest],
                request_rates: list[float], burstiness: float = 1.0,
                max_concurrency: int | None = None, slos: dict[str, float] | None = None,
                prompt_format: str = "ids", ignore_eos: bool = True, seed: int = 0,
                backend: str = "openai", api_key: str | None = None,
                progress: bool = True, tenants: dict[str, float] | None = None,
                tenant_keys: dict[str, str] | None = None,
                objectives: dict[str, float] | None = None,
                lora_modules: list[str] | None = None, n: int = 1) -> dict:
    """One run per request rate, after one untimed request that checks the server answers
    (probe_request).
    `backend` "openai" takes an http(s) base URL; "grpc" a host:port of Treadle's gRPC API.
    `tenants`: name -> share of the requests (not with a workload that names its tenants,
    which are sent as given); `tenant_keys`: name -> API key; `objectives`:
    ttft / tpot in ms, set on every request and counted as goodput SLOs; `lora_modules`: adapter
    names, one drawn (seeded) per request as its `model` (vLLM's benchmark flag); `n`: choices
    per request, sampled at temperature 1 (greedy takes only n: 1); output tokens count every
    choice's, TTFT is the first token of any."""
    if not requests:
        raise ValueError("the workload has no requests")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if prompt_format == "text" and any(r.prompt is None for r in requests):
        raise ValueError("prompt format text needs the workload's prompt text")
    times = [send_times(requests, rate, burstiness, seed) for rate in request_rates]
    names = workload_tenants(requests, tenants, seed)
    if objectives:
        slos = {**(slos or {}), **objectives}
    if not 1 <= n <= 16:
        raise ValueError(f"n must be in [1, 16], got {n}")
    if n > 1 and backend == "grpc":
        raise ValueError("--n needs --backend openai")
    request_models = None
    if lora_modules:
        if backend == "grpc":
            raise ValueError("--lora-modules needs --backend openai (gRPC has no adapter field)")
        request_models = draw_adapters(lora_modules, len(requests), seed)

    def backend_for(sent: list[BenchRequest], tenant_names: list[str] | None,
                    models: list[str] | None) -> Backend:
        if backend == "grpc":
            return GrpcBackend(base_url, model, sent, prompt_format, ignore_eos, api_key,
                               tenant_names, tenant_keys, objectives)
        return OpenAIBackend(base_url, model, sent, prompt_format, ignore_eos, api_key,
                             tenant_names, tenant_keys, objectives, models, n)

    client = backend_for(requests, names, request_models)
    first = asyncio.run(probe(backend_for([probe_request(requests[0])], names and names[:1],
                                          request_models and request_models[:1])))
    if not first.success:
        raise RuntimeError(f"the first request to {base_url} failed: {first.error}")
    runs = []
    for rate, rate_times in zip(request_rates, times, strict=True):
        records, duration = asyncio.run(run_requests(client, rate_times, max_concurrency,
                                                     progress))
        errors = Counter(r.error for r in records if not r.success)
        runs.append({"request_rate": rate, "burstiness": burstiness,
                     "max_concurrency": max_concurrency,
                     **compute_metrics(records, duration, slos),
                     **(tenant_metrics(records, duration, slos) if names else {}),
                     "errors": dict(errors.most_common()),
                     "requests": [r.as_dict() for r in records]})
    return {"base_url": base_url, "backend": backend, "model": model,
            "lora_modules": lora_modules or [], "n": n,
            "prompt_format": prompt_format, "ignore_eos": ignore_eos, "seed": seed,
            "num_prompts": len(requests), "runs": runs,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_run(run: dict) -> str:
    rows = [
        ("Request rate (req/s)", f"{run['request_rate']:g}"),
        ("Burstiness", f"{run['burstiness']:g}"),
        ("Max concurrency", str(run["max_concurrency"] or "-")),
        ("Successful requests", str(run["successful"])),
        ("Failed requests", str(run["failed"])),
        ("Benchmark duration (s)", f"{run['duration_s']:.2f}"),
        ("Total input tokens", str(run["total_input_tokens"])),
        ("Total generated tokens", str(run["total_output_tokens"])),
        ("Request throughput (req/s)", f"{run['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{run['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{run['total_token_throughput']:.2f}"),
    ]
    if run["goodput"]:
        slos = " ".join(f"{k}:{v:g}" for k, v in run["goodput"]["slos_ms"].items())
        rows += [("Goodput SLOs (ms)", slos),
                 ("Good requests", str(run["goodput"]["good_requests"])),
                 ("Request goodput (req/s)", f"{run['goodput']['request_goodput']:.2f}")]
    lines = [f"{' Serving Benchmark Result ':=^50}", *(f"{k:<36}{v:>14}" for k, v in rows)]
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        stats = run[key]
        short = key.split("_")[0].upper()
        lines.append(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            lines.append(f"{stat.capitalize() + ' ' + short + ' (ms)':<36}{_ms(stats[stat]):>14}")
    if run.get("tenants"):
        lines.append(format_tenants(run))
    for message, count in list(run["errors"].items())[:5]:
        lines.append(f"{count} failed: {message}")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_tenants(run: dict) -> str:
    """One row per tenant, then Jain's index."""
    head = (f"{'tenant':<12}{'ok':>5}{'fail':>5}{'out tok/s':>10}{'TTFT p50':>9}{'p99':>8}"
            f"{'TPOT p50':>9}{'p99':>7}{'good':>6}{'norm':>6}")
    lines = [f"{' Tenants (ms) ':-^82}", head]
    for name, t in run["tenants"].items():
        good = t["goodput"]["good_requests"] if t["goodput"] else None
        norm = t.get("normalised_service")
        lines.append(
            f"{name[:12]:<12}{t['successful']:>5}{t['failed']:>5}{t['output_throughput']:>10.1f}"
            f"{_ms(t['ttft_ms']['median']):>9}{_ms(t['ttft_ms']['p99']):>8}"
            f"{_ms(t['tpot_ms']['median']):>9}{_ms(t['tpot_ms']['p99']):>7}"
            f"{'-' if good is None else good:>6}{'-' if norm is None else f'{norm:.2f}':>6}")
    jain = run.get("jain_fairness")
    lines.append(f"{'Jain fairness index (normalised service)':<68}"
                 f"{'-' if jain is None else f'{jain:.3f}':>14}")
    return "\n".join(lines)


def format_serve(report: dict) -> str:
    head = (f"{report['base_url']} ({report['backend']})  model {report['model']}  "
            f"{report['num_prompts']} requests  prompts as {report['prompt_format']}  "
            f"seed {report['seed']}")
    return "\n".join([head, *(format_run(run) for run in report["runs"])])
