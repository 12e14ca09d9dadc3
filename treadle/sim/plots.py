"""PNG plots of a `treadle sim` run: the trade-off across its runs (a sweep, policies or rates:
latency percentiles and throughput against the setting) and KV cache usage over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402

from treadle.bench.plots import save_figure  # noqa: E402

TRADE_OFF = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"))


def _axis(labels: list[str]) -> tuple[list[float], list[str], str]:
    """Positions and tick labels for the runs: the swept numbers themselves when every label
    ends in `name=number` (a numeric sweep), else one position per run."""
    values, name = [], ""
    for label in labels:
        key, _, value = label.rpartition(" ")[-1].partition("=")
        try:
            values.append(float(value))
            name = key
        except ValueError:
            return list(range(len(labels))), labels, "run"
    return values, [f"{v:g}" for v in values], name


def plot_sim(labels: list[str], reports: list[dict], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if len(reports) > 1:
        xs, ticks, name = _axis(labels)
        fig, axes = plt.subplots(1, len(TRADE_OFF) + 1, figsize=(4.2 * (len(TRADE_OFF) + 1), 4))
        for ax, (metric, key) in zip(axes, TRADE_OFF, strict=False):
            for stat in ("median", "p99"):
                ys = [r[key][stat] for r in reports]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-", label=stat)
            ax.set(xlabel=name, ylabel=f"{metric} (ms)", title=metric)
            ax.legend()
        axes[-1].plot(xs, [r["output_throughput"] for r in reports], "o-")
        axes[-1].set(xlabel=name, ylabel="output tokens/s", title="throughput")
        spread = name != "run" and min(xs) > 0 and max(xs) >= 8 * min(xs)
        for ax in axes:
            if spread:  # budgets and sizes are swept in powers of two
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, ticks, rotation=30 if name == "run" else 0)
            ax.grid(alpha=0.3)
        written.append(save_figure(fig, out / "trade_off.png"))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, report in zip(labels, reports, strict=True):
        points = report["kv_usage"]["over_time"]
        if points:
            ax.plot([t for t, _ in points], [100 * u for _, u in points], label=label)
    ax.set(xlabel="virtual seconds", ylabel="KV cache used (%)", ylim=(0, 102),
           title="KV cache usage (peak per slice)")
    ax.grid(alpha=0.3)
    if ax.has_data() and len(reports) > 1:
        ax.legend(fontsize="small")
    written.append(save_figure(fig, out / "kv_usage.png"))
    return written
