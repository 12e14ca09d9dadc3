"""A simulation's report: `bench serve`'s metrics (treadle.bench.metrics, over the same
RequestRecord), plus queue time, goodput against each request's own objectives, per-tenant
tables with Jain's fairness index, per-LoRA-adapter queue time and TTFT (what `max_loras`
holds back), preemptions and KV cache usage over time."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from treadle.bench.metrics import RequestRecord, compute_metrics, latency_stats, tpot
from treadle.sim.simulator import SimResult

KV_POINTS = 50  # KV usage over time: the largest usage in each of this many time slices


def records(result: SimResult) -> list[RequestRecord]:
    out = []
    for request, t in zip(result.requests, result.timelines, strict=True):
        ok = t.finish_reason in ("length", "stop")
        record = RequestRecord(start=request.arrival, prompt_tokens=request.prompt_len,
                               success=ok, output_tokens=t.num_output_tokens if ok else 0,
                               error="" if ok else (t.finish_reason or "unfinished"))
        if ok:
            record.ttft = t.first_token - request.arrival
            record.e2e = t.finished - request.arrival
            record.itl = t.itl
        out.append(record)
    return out


def jain_index(values: list[float]) -> float | None:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one gets everything."""
    if not values or not any(values):
        return None
    x = np.asarray(values, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x ** 2).sum()))


def meets_objectives(request, record: RequestRecord) -> bool:
    if not record.success:
        return False
    if request.ttft is not None and record.ttft > request.ttft:
        return False
    return request.tpot is None or (tpot(record) or 0.0) <= request.tpot


def kv_usage_over_time(result: SimResult) -> list[tuple[float, float]]:
    """(slice end in virtual seconds, the largest KV usage any replica reached in it)."""
    steps = [s for replica in result.steps for s in replica]
    if not steps:
        return []
    start = min(s.start for s in steps)
    span = max(s.start + s.duration for s in steps) - start or 1.0
    peaks = [0.0] * KV_POINTS
    for s in steps:
        i = min(KV_POINTS - 1, int((s.start - start) / span * KV_POINTS))
        peaks[i] = max(peaks[i], s.kv_usage)
    return [(start + span * (i + 1) / KV_POINTS, p) for i, p in enumerate(peaks)]


def queue_seconds(result: SimResult) -> list[float | None]:
    """Each request's wait from arrival to its first schedule (None: never scheduled)."""
    return [None if t.scheduled is None else t.scheduled - r.arrival
            for r, t in zip(result.requests, result.timelines, strict=True)]


def adapter_table(result: SimResult, recs: list[RequestRecord]) -> dict[str, dict]:
    """Per LoRA adapter (by name; none when no request has one): its requests, how long they
    queued (a request whose adapter would be one too many waits for a running one's requests
    to end) and their TTFT."""
    queue = queue_seconds(result)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(result.requests):
        if r.lora is not None:
            groups[r.lora].append(i)
    return {name: {"requests": len(idx),
                   "successful": sum(recs[i].success for i in idx),
                   "queue_ms": latency_stats([queue[i] for i in idx if queue[i] is not None]),
                   "ttft_ms": latency_stats([recs[i].ttft for i in idx if recs[i].success])}
            for name, idx in sorted(groups.items())}


def summarize(result: SimResult, slos: dict[str, float] | None = None,
              per_request: bool = False) -> dict:
    recs = records(result)
    duration = max(result.duration, 1e-9)
    report = compute_metrics(recs, duration, slos)
    report["queue_ms"] = latency_stats([q for q in queue_seconds(result) if q is not None])
    with_objectives = [(r, rec) for r, rec in zip(result.requests, recs, strict=True)
                       if r.ttft is not None or r.tpot is not None]
    if with_objectives:
        good = sum(meets_objectives(r, rec) for r, rec in with_objectives)
        report["objectives"] = {"requests": len(with_objectives), "met": good,
                                "goodput": good / duration}
    tenants: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(result.requests):
        tenants[r.tenant].append(i)
    per_tenant = {}
    for tenant, idx in sorted(tenants.items()):
        m = compute_metrics([recs[i] for i in idx], duration)
        per_tenant[tenant] = {
            "requests": len(idx), "successful": m["successful"],
            "service_tokens": m["total_input_tokens"] + m["total_output_tokens"],
            "output_throughput": m["output_throughput"], "ttft_ms": m["ttft_ms"],
            "tpot_ms": m["tpot_ms"]}
    report["tenants"] = per_tenant
    report["jain_index"] = jain_index([t["service_tokens"] for t in per_tenant.values()])
    report["adapters"] = adapter_table(result, recs)
    steps = [s for replica in result.steps for s in replica]
    report["most_loras_in_a_step"] = max((s.num_loras for s in steps), default=0)
    report["steps"] = len(steps)
    report["preemptions"] = result.num_preemptions
    report["rejected"] = len(result.rejected)
    report["cached_prompt_tokens"] = sum(t.num_cached_tokens for t in result.timelines)
    report["kv_usage"] = {"peak": max((s.kv_usage for s in steps), default=0.0),
                          "mean": float(np.mean([s.kv_usage for s in steps])) if steps else 0.0,
                          "over_time": kv_usage_over_time(result)}
    report["per_replica_requests"] = [sum(1 for t in result.timelines if t.replica == i)
                                      for i in range(result.settings.replicas)]
    report["sim_wall_s"] = result.wall_s
    report["speedup_vs_real_time"] = duration / result.wall_s if result.wall_s else None
    if per_request:
        report["requests"] = [{
            "arrival": r.arrival, "tenant": r.tenant, "lora": r.lora, "prompt_len": r.prompt_len,
            "output_len": r.output_len, "replica": t.replica, "finish_reason": t.finish_reason,
            "queue_s": None if t.scheduled is None else t.scheduled - r.arrival,
            "ttft_s": rec.ttft if rec.success else None,
            "tpot_s": tpot(rec) if rec.success else None,
            "e2e_s": rec.e2e if rec.success else None, "preemptions": t.num_preemptions,
            "cached_tokens": t.num_cached_tokens}
            for r, t, rec in zip(result.requests, result.timelines, recs, strict=True)]
    return report


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


ROWS = [
    ("successful", lambda r: str(r["successful"])),
    ("failed / rejected", lambda r: f"{r['failed']} / {r['rejected']}"),
    ("duration (s)", lambda r: _fmt(r["duration_s"], ".2f")),
    ("requests/s", lambda r: _fmt(r["request_throughput"], ".2f")),
    ("output tok/s", lambda r: _fmt(r["output_throughput"])),
    ("total tok/s", lambda r: _fmt(r["total_token_throughput"])),
    *((f"{m.upper()} {s} (ms)", lambda r, m=m, s=s: _fmt(r[f"{m}_ms"][s]))
      for m in ("ttft", "tpot", "itl", "e2e", "queue") for s in ("median", "p90", "p99")),
    ("goodput (req/s, SLOs)", lambda r: _fmt(r["goodput"] and r["goodput"]["request_goodput"],
                                             ".2f")),
    ("objectives met", lambda r: "-" if "objectives" not in r else
     f"{r['objectives']['met']}/{r['objectives']['requests']}"),
    ("Jain's index (tenants)", lambda r: _fmt(r["jain_index"], ".3f")),
    ("preemptions", lambda r: str(r["preemptions"])),
    ("steps", lambda r: str(r["steps"])),
    ("KV usage peak / mean", lambda r: f"{r['kv_usage']['peak']:.0%} / "
                                       f"{r['kv_usage']['mean']:.0%}"),
    ("cached prompt tokens", lambda r: str(r["cached_prompt_tokens"])),
    ("requests per replica", lambda r: ",".join(map(str, r["per_replica_requests"]))),
    ("sim wall (s) / x real", lambda r: f"{r['sim_wall_s']:.2f} / "
                                        f"{_fmt(r['speedup_vs_real_time'], '.0f')}"),
]


def format_table(labels: list[str], reports: list[dict]) -> str:
    """One column per run (side by side), one row per metric."""
    width = max(12, *(len(label) + 2 for label in labels))
    lines = [f"{'':<24}" + "".join(f"{label:>{width}}" for label in labels)]
    lines += [f"{name:<24}" + "".join(f"{fn(r):>{width}}" for r in reports)
              for name, fn in ROWS]
    return "\n".join(lines)


def format_tenants(report: dict) -> str:
    lines = [f"{'tenant':<12}{'requests':>9}{'service tok':>12}{'out tok/s':>10}"
             f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"]
    for name, t in report["tenants"].items():
        lines.append(f"{name:<12}{t['requests']:>9}{t['service_tokens']:>12}"
                     f"{t['output_throughput']:>10.1f}{_fmt(t['ttft_ms']['median']):>10}"
                     f"{_fmt(t['ttft_ms']['p99']):>10}{_fmt(t['tpot_ms']['median']):>10}")
    return "\n".join(lines)


def format_adapters(report: dict) -> str:
    lines = [f"{'adapter':<12}{'requests':>9}{'queue p50':>10}{'queue p99':>10}"
             f"{'TTFT p50':>10}{'TTFT p99':>10}"]
    for name, a in report["adapters"].items():
        lines.append(f"{name:<12}{a['requests']:>9}{_fmt(a['queue_ms']['median']):>10}"
                     f"{_fmt(a['queue_ms']['p99']):>10}{_fmt(a['ttft_ms']['median']):>10}"
                     f"{_fmt(a['ttft_ms']['p99']):>10}")
    return "\n".join(lines)


def format_kv(report: dict, width: int = 50) -> str:
    """KV usage over time as one line of block characters."""
    bars = " ▁▂▃▄▅▆▇█"
    points = report["kv_usage"]["over_time"]
    line = "".join(bars[min(8, round(p * 8))] for _, p in points[:width])
    end = points[-1][0] if points else 0.0
    return f"KV usage over {end:.1f} s |{line}|"
