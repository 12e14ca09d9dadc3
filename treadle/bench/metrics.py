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

With tenants (`--tenants`), each tenant gets the same statistics, and the run Jain's fairness
index J = (sum x)^2 / (n sum x^2) over the tenants' normalised service x_i = S_i / F_i:
- the window: from the start until the first tenant has all its requests answered (the time
  every tenant still has work in the system);
- S_i, service: prompt and output tokens tenant i received within the window (a request's prompt
  counts at its first token, its outputs spread evenly from first token to last);
- F_i, its fair service: the max-min fair split of the window's total service over the tenants,
  each capped at its demand D_i (tokens of its requests sent within the window): a tenant asking
  for less than an equal share gets all it asked, the rest split the remainder equally.
J is 1 when every tenant got its max-min fair share (a light tenant fully served, a heavy one
using what is left), and falls toward 1/n as service goes to some tenants at others' expense.
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
    tenant: str = ""  # with --tenants: whose request it was

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


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything."""
    if not values:
        raise ValueError("Jain's index needs at least one value")
    squares = sum(x * x for x in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)


def max_min_shares(capacity: float, demands: dict[str, float]) -> dict[str, float]:
    """The max-min fair split of `capacity` over demands (water-filling): those demanding less
    than an equal share of what is left get their demand, the rest share equally."""
    shares: dict[str, float] = {}
    left, pending = capacity, sorted(demands, key=lambda t: demands[t])
    while pending:
        equal = left / len(pending)
        tenant = pending[0]
        if demands[tenant] <= equal:
            shares[tenant] = demands[tenant]
            left -= demands[tenant]
            pending.pop(0)
        else:
            for tenant in pending:
                shares[tenant] = equal
            break
    return shares


def tokens_by(record: RequestRecord, t: float) -> float:
    """Tokens the request had received by time `t` (run clock): its prompt at its first token,
    its outputs spread evenly from the first token to the last."""
    first, last = record.start + record.ttft, record.start + record.e2e
    if not record.success or t < first:
        return 0.0
    if t >= last or record.output_tokens <= 1:
        return float(record.prompt_tokens + record.output_tokens)
    done = 1 + (record.output_tokens - 1) * (t - first) / (last - first)
    return record.prompt_tokens + done


def normalised_service(records: list[RequestRecord]) -> dict[str, float]:
    """Per tenant, S_i / F_i over the window (the module's doc); tenants with no demand in it
    are left out."""
    ok = [r for r in records if r.success]
    tenants = sorted({r.tenant for r in ok})
    if not tenants:
        return {}
    end = min(max(r.start + r.e2e for r in ok if r.tenant == t) for t in tenants)
    service = {t: sum(tokens_by(r, end) for r in ok if r.tenant == t) for t in tenants}
    demand = {t: float(sum(r.prompt_tokens + r.output_tokens for r in ok
                           if r.tenant == t and r.start <= end)) for t in tenants}
    fair = max_min_shares(sum(service.values()), demand)
    return {t: service[t] / fair[t] for t in tenants if fair[t] > 0}


def tenant_metrics(records: list[RequestRecord], duration: float,
                   slos: dict[str, float] | None) -> dict:
    """Per tenant: its requests' statistics; and Jain's index over normalised service."""
    tenants = sorted({r.tenant for r in records})
    per_tenant = {}
    for tenant in tenants:
        mine = [r for r in records if r.tenant == tenant]
        stats = compute_metrics(mine, duration, slos)
        per_tenant[tenant] = {k: stats[k] for k in (
            "successful", "failed", "request_throughput", "output_throughput",
            "total_token_throughput", "ttft_ms", "tpot_ms", "e2e_ms", "goodput")}
    normalised = normalised_service(records)
    for tenant, x in normalised.items():
        per_tenant[tenant]["normalised_service"] = x
    return {"tenants": per_tenant,
            "jain_fairness": jain_index(list(normalised.values())) if normalised else None}


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
