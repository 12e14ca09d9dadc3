"""Simulated requests and where they come from: `bench serve` workloads, JSONL traces, and the
records of a real `bench serve --json` run.

A trace row (one JSON object a line):
    {"arrival": 0.25, "prompt_len": 120, "output_len": 64,           # required
     "prompt_token_ids": [...],   # instead of prompt_len: prefix caching sees real sharing
     "tenant": "a", "priority": 0, "ttft": 0.5, "tpot": 0.05,       # optional (s)
     "lora": "sql"}               # optional: the LoRA adapter it runs with (a served name)
Prompts given only as a length get token ids of their own (no prefix is shared).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from treadle.bench.workloads import draw_adapters
from treadle.core.request import DEFAULT_TENANT

UNIQUE_BASE = 1_000_000  # token ids of length-only prompts: above any real vocabulary


@dataclass
class SimRequest:
    arrival: float  # seconds from the start
    prompt_token_ids: list[int]
    output_len: int
    tenant: str = DEFAULT_TENANT
    priority: int = 0
    ttft: float | None = None  # objectives, seconds
    tpot: float | None = None
    lora: str | None = None  # its LoRA adapter's name; None: the base model

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def as_row(self, with_ids: bool = True) -> dict:
        row: dict = {"arrival": self.arrival, "output_len": self.output_len}
        if with_ids:
            row["prompt_token_ids"] = self.prompt_token_ids
        else:
            row["prompt_len"] = self.prompt_len
        if self.tenant != DEFAULT_TENANT:
            row["tenant"] = self.tenant
        if self.priority:
            row["priority"] = self.priority
        for name in ("ttft", "tpot", "lora"):
            if getattr(self, name) is not None:
                row[name] = getattr(self, name)
        return row


def unique_prompt(index: int, length: int) -> list[int]:
    """`length` token ids no other request's prompt starts with."""
    return [UNIQUE_BASE + index, *range(1, length)]


def from_row(row: dict, index: int, where: str = "") -> SimRequest:
    try:
        if "prompt_token_ids" in row:
            ids = [int(t) for t in row["prompt_token_ids"]]
        else:
            ids = unique_prompt(index, int(row["prompt_len"]))
        request = SimRequest(float(row["arrival"]), ids, int(row["output_len"]),
                             str(row.get("tenant", DEFAULT_TENANT)), int(row.get("priority", 0)),
                             row.get("ttft"), row.get("tpot"),
                             None if row.get("lora") is None else str(row["lora"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: expected arrival, prompt_len or prompt_token_ids, "
                         f"output_len ({type(e).__name__}: {e})") from None
    if not ids or request.output_len < 1 or request.arrival < 0:
        raise ValueError(f"{where}: needs a prompt, output_len >= 1 and arrival >= 0")
    return request


def read_trace(path: str | Path) -> list[SimRequest]:
    requests = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: {e}") from None
            requests.append(from_row(row, len(requests), f"{path}:{line_no}"))
    return sorted(requests, key=lambda r: r.arrival)  # stable: ties keep file order


def write_trace(requests: Iterable[SimRequest], path: str | Path, with_ids: bool = True) -> None:
    Path(path).write_text("".join(json.dumps(r.as_row(with_ids)) + "\n" for r in requests))


def from_bench_serve(report: dict, run: int = 0) -> list[SimRequest]:
    """The requests of run `run` of a `bench serve --json` report, at the times they were sent,
    with the prompt and output lengths the server reported, and the adapters its
    `--lora-modules` drew (by its seed, as it drew them). Failed requests are left out. The
    report holds no token ids: prompts get ids of their own (no prefix sharing)."""
    runs = report.get("runs") or []
    if not 0 <= run < len(runs):
        raise ValueError(f"the report has {len(runs)} runs; run {run} does not exist")
    records = runs[run]["requests"]  # in workload order, as bench serve drew adapters
    adapters = (draw_adapters(report["lora_modules"], len(records), report.get("seed", 0))
                if report.get("lora_modules") else [None] * len(records))
    requests = []
    for i, (rec, lora) in enumerate(zip(records, adapters, strict=True)):
        if rec.get("success") and rec.get("output_tokens", 0) >= 1:
            requests.append(SimRequest(float(rec["start"]),
                                       unique_prompt(i, max(1, int(rec["prompt_tokens"]))),
                                       int(rec["output_tokens"]), lora=lora))
    return sorted(requests, key=lambda r: r.arrival)


def from_bench(bench_requests: list, times: list[float], lora_modules: list[str] | None = None,
               seed: int = 0) -> list[SimRequest]:
    """`treadle.bench.workloads` requests sent at `times` (bench serve's arrival_times), with
    the tenant a workload file names (the same "tenant" field as a trace row's) and, given
    `lora_modules`, the adapter `bench serve --lora-modules` would draw for each by `seed`."""
    adapters = (draw_adapters(lora_modules, len(bench_requests), seed) if lora_modules
                else [None] * len(bench_requests))
    return [SimRequest(t, list(r.prompt_token_ids), r.output_len,
                       r.tenant or DEFAULT_TENANT, lora=lora)
            for r, t, lora in zip(bench_requests, times, adapters, strict=True)]
