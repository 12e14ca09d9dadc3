"""Serving metrics over per-request records, as `vllm bench serve` defines them.

- TTFT: from sending the request to the first chunk that carries choices.
- ITL: the gap between consecutive such chunks, one per chunk: a chunk carrying k > 1 tokens
  gives one gap, not k (vLLM does not spread it either); TPOT is where token counts matter.
- TPOT: (e2e - ttft) / (output tokens - 1), over requests with more than one output token;
  output tokens are the server's `usage.completion_tokens` where it sends usage.
- E2E: from sending the request to its last token-carrying chunk.
- Goodput: successful requests per second that meet every SLO given (ttft, tpot, e2el, in ms);
  a one-token request's TPOT counts as 0 there, as in vLLM.
- Percentiles: numpy's default (linear interpolation between closest ranks).
Only successful requests enter the latency statistics; failed ones count nowhere but `failed`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `start` from the run's start."""

    start: float
    prompt_tokens: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def tpot(record: RequestRecord) -> float | None:
    if record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """Mean, median and percentiles in milliseconds; None where there is no value."""
    names = ["mean", "median", *(f"p{p}" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(names)
    ms = np.asarray(seconds, dtype=float) * 1e3
    values = [ms.mean(), np.median(ms), *np.percentile(ms, PERCENTILES)]
    return {n: float(v) for n, v in zip(names, values, strict=True)}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r} is not NAME:MS with NAME one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number") from None
        if ms <= 0:
            raise ValueError(f"goodput SLO {item!r} must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft, "tpot": tpot(record) or 0.0, "e2el": record.e2e}
    return record.success and all(measured[k] * 1e3 <= ms for k, ms in slos.items())


def compute_metrics(records: list[RequestRecord], duration: float,
                    slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics = {
        "successful": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": latency_stats([r.ttft for r in ok]),
        "tpot_ms": latency_stats([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in ok]),
        "goodput": None,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        metrics["goodput"] = {"slos_ms": slos, "good_requests": good,
                              "request_goodput": good / duration}
    return metrics
