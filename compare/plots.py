"""PNG plots of a compare run (matplotlib, Agg: no display needed)."""
from __future__ import annotations

import os


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def loss_curves(rows: list[dict], path: str) -> str:
    """Loss vs step per scheme: identical init and data, so the curves should lie on top of each other."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for i, r in enumerate(rows):
        ax.plot(r["steps"], r["losses"], styles[i % len(styles)], marker="o", markersize=3, label=r["scheme"])
    ax.set(xlabel="step", ylabel="training loss", title="loss vs step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_bars(rows: list[dict], path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["scheme"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(rows)])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.set(ylabel="tokens/s (median after warm-up)", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(rows: list[dict], out_dir: str) -> list[str]:
    return [loss_curves(rows, os.path.join(out_dir, "loss.png")),
            throughput_bars(rows, os.path.join(out_dir, "throughput.png"))]
