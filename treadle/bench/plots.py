"""PNG plots of a `bench serve` report: latency CDFs (one line per request rate) and, when the
report holds several rates, throughput and p99 TTFT against the rate."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402

from treadle.bench.metrics import RequestRecord, tpot  # noqa: E402


def _latencies(run: dict) -> dict[str, list[float]]:
    """Each latency metric's values in ms over the run's successful requests."""
    ok = [RequestRecord(**r) for r in run["requests"] if r["success"]]
    return {"TTFT": [1e3 * r.ttft for r in ok],
            "TPOT": [1e3 * t for r in ok if (t := tpot(r)) is not None],
            "ITL": [1e3 * gap for r in ok for gap in r.itl],
            "E2E": [1e3 * r.e2e for r in ok]}


def _rate_label(run: dict) -> str:
    rate = run["request_rate"]
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def plot_serve(report: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    per_run = [_latencies(run) for run in runs]
    written = []
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, values in zip(runs, per_run, strict=True):
            xs = sorted(values[metric])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=_rate_label(run))
        ax.set(xlabel=f"{metric} (ms)", ylabel="fraction of requests" if metric != "ITL"
               else "fraction of token gaps", title=f"{metric} CDF, {report['model']}",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
        written.append(save_figure(fig, out / f"{metric.lower()}_cdf.png"))
    finite = [run for run in runs if not math.isinf(run["request_rate"])]
    if len(finite) > 1:
        rates = [run["request_rate"] for run in finite]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, label in ((axes[0], "request_throughput", "completed requests/s"),
                               (axes[1], "output_throughput", "output tokens/s")):
            ax.plot(rates, [run[key] for run in finite], "o-")
            ax.set(xlabel="request rate (req/s)", ylabel=label)
            ax.grid(alpha=0.3)
        fig.suptitle(f"throughput against request rate, {report['model']}")
        written.append(save_figure(fig, out / "throughput_vs_rate.png"))
        fig, ax = plt.subplots(figsize=(6, 4))
        p99 = [run["ttft_ms"]["p99"] for run in finite]
        ax.plot(rates, [math.nan if v is None else v for v in p99], "o-")
        ax.set(xlabel="request rate (req/s)", ylabel="p99 TTFT (ms)",
               title="p99 TTFT against request rate")
        ax.grid(alpha=0.3)
        written.append(save_figure(fig, out / "p99_ttft_vs_rate.png"))
    return written


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
