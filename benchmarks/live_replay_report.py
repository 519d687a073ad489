"""What benchmarks/live_replay.py prints and saves of its runs: one table, and TTFT and TBT
CDF plots (PNG) per rate, one line per configuration."""
from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = [("config", "config", "{}"), ("rate", "rate", "{:g}"),
           ("ttft_p50_s", "TTFT p50", "{:.2f}"), ("ttft_p90_s", "p90", "{:.2f}"),
           ("ttft_p99_s", "p99", "{:.2f}"), ("itl_mean_s", "ITL ms", "{:.0f}"),
           ("itl_p50_s", "ITL p50", "{:.0f}"), ("output_tokens_per_s", "out tok/s", "{:.1f}"),
           ("generated_tokens_per_s", "gen tok/s", "{:.1f}"),
           ("tbt_p90_s", "TBT p90", "{:.2f}"), ("e2e_p50_s", "E2E p50", "{:.2f}"),
           ("e2e_p90_s", "p90", "{:.2f}"), ("e2e_p99_s", "p99", "{:.2f}"),
           ("goodput", "goodput", "{}"), ("rejected_429", "429", "{}"),
           ("errors", "err", "{}"), ("prefix_hit", "hit", "{:.0%}"),
           ("pred_median_rel_err", "pred err p50", "{:+.0%}"),
           ("pred_median_abs_rel_err", "|err| p50", "{:.0%}"),
           ("pred_p90_abs_rel_err", "|err| p90", "{:.0%}")]


def table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        return fmt.format(v * 1000 if key in ("itl_mean_s", "itl_p50_s") else v)
    body = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        body.append([cell(row, k, f) for k, _, f in COLUMNS] if "error" not in row
                    else [row["config"], f"{row['rate']:g}", f"FAILED: {row['error'][:90]}"])
    widths = [max(len(r[i]) for r in body if i < len(r) and len(r) == len(COLUMNS))
              for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) if len(r) == len(COLUMNS) else c
                               for c, w in zip(r, widths)) for r in body)


def plot(rows: list[dict[str, Any]], rates: list[float], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (("_ttft", "TTFT (s)"), ("_tbt", "TBT: mean of longest 10% gaps (s)")):
        fig, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            for row in rows:
                xs = row.get(key) or []
                if row["rate"] == rate and xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=row["config"])
            ax.set_title(f"{rate:g} req/s")
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("CDF of completed requests")
        fig.tight_layout()
        path = out / f"live_replay{key}_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
