"""Plots for the serving benchmarks (matplotlib, Agg backend: files only, no display).

- `cdf_plot`: empirical CDFs of TTFT (top row) and of every inter-token gap (bottom
  row, log x so stalls show), one column per offered rate, one line per system.
- `goodput_plot`: SLO attainment against offered rate per system, with the target
  and each system's goodput marked (left), and p99 TBT against rate (right, log y).
- `autoscale_plot`: pool sizes, offered load and SLO attainment over time
  (`tandem bench autoscale`).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.serving_metrics import cdf


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_plot(path: Path, rates: list[float], samples: dict[str, dict[float, dict[str, list[float]]]],
             ttft_slo_s: float, tbt_slo_s: float, title: str) -> Path:
    """samples[system][rate] = {"ttft_s": [...], "gaps_s": [...]}."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(rates), figsize=(4.2 * len(rates), 7), squeeze=False)
    for col, rate in enumerate(rates):
        panels = [("ttft_s", "TTFT (s)", ttft_slo_s), ("gaps_s", "TBT gap (s)", tbt_slo_s)]
        for row, (key, label, slo) in enumerate(panels):
            ax = axes[row][col]
            for system, by_rate in samples.items():
                values = [v for v in by_rate.get(rate, {}).get(key, []) if v is not None]
                if values:
                    xs, ys = cdf([max(v, 1e-5) for v in values])
                    ax.step(xs, ys, where="post", label=system)
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label="SLO")
            if key == "gaps_s":
                ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction")
            ax.set_title(f"{rate:.3g} req/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goodput_plot(path: Path, curves: dict[str, list[tuple[float, float, float | None]]],
                 goodputs: dict[str, float], target: float, title: str) -> Path:
    """curves[system] = [(rate, attainment, p99 TBT s), ...]; goodputs[system] = req/s."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, points in curves.items():
        points = sorted(points)
        line, = left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
        if goodputs.get(system):
            left.axvline(goodputs[system], color=line.get_color(), linestyle=":", linewidth=1)
        tbt = [(p[0], p[2]) for p in points if p[2]]
        right.plot([p[0] for p in tbt], [p[1] for p in tbt], marker="o", label=system, color=line.get_color())
    left.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("SLO attainment")
    left.set_ylim(-0.02, 1.02)
    left.set_title("attainment (dotted: goodput)")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("p99 TBT (s)")
    right.set_yscale("log")
    right.set_title("p99 inter-token gap")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def autoscale_plot(path: Path, sizes: dict[str, list[tuple[float, int, int, int]]], rows: list[dict],
                   decisions: list[tuple[float, str, str]], target: float, end_s: float, title: str) -> Path:
    """Three panels on one time axis: workers per pool (serving solid, serving +
    starting dashed; decisions as vertical lines), offered load per bin, and SLO
    attainment per bin with the target.

    sizes[pool] = [(t_s, serving, starting, draining), ...]; rows: per-bin dicts
    with t_s, offered_req_s, attainment; decisions: (t_s, pool, "up" | "down")."""
    plt = _pyplot()
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for pool, steps in sizes.items():
        if not steps:
            continue
        xs = [s[0] for s in steps] + [end_s]  # events before the workload have t < 0: cut by xlim
        serving = [s[1] for s in steps]
        total = [s[1] + s[2] for s in steps]
        top.step(xs, serving + serving[-1:], where="post", color=colors.get(pool), label=f"{pool} serving",
                 linewidth=3.5 if pool == "prefill" else 1.5, alpha=0.6 if pool == "prefill" else 1.0)
        top.step(xs, total + total[-1:], where="post", color=colors.get(pool), linestyle="--", linewidth=1,
                 label=f"{pool} serving + starting")
    top.set_xlim(0, end_s)
    for t_s, pool, action in decisions:
        top.axvline(t_s, color=colors.get(pool, "grey"), linestyle=":" if action == "down" else "-", alpha=0.5)
    top.set_ylabel("workers")
    top.set_title("pool sizes (vertical lines: scale-up solid, scale-down dotted)")
    width = rows[1]["t_s"] - rows[0]["t_s"] if len(rows) > 1 else 1.0
    mid.bar([r["t_s"] for r in rows], [r["offered_req_s"] for r in rows], width=width, align="edge",
            color="tab:grey", alpha=0.6)
    mid.set_ylabel("offered req/s")
    mid.set_title("offered load (requests sent per bin)")
    points = [(r["t_s"] + width / 2, r["attainment"]) for r in rows if r["attainment"] is not None]
    low.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:green", label="attainment")
    low.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    low.set_ylim(-0.02, 1.02)
    low.set_ylabel("SLO attainment")
    low.set_xlabel("time since the workload started (s)")
    low.set_title("attainment of the requests sent in each bin")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")
    low.legend(fontsize=8, loc="lower left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
