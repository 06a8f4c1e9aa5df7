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
    fig = loss_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_figure(rows: list[dict]):
    """The figure :func:`loss_curves` saves."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for i, r in enumerate(rows):
        ax.plot(r["steps"], r["losses"], styles[i % len(styles)], marker="o", markersize=3, label=r["scheme"])
    ax.set(xlabel="step", ylabel="training loss", title="loss vs step")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # steps are whole: no 1.25 on a 3-step run
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


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


def crossover(rows: list[dict], links: list[str], path: str) -> str:
    """tokens/s against inter-node bandwidth, one colour per scheme: measured (solid, dots) and
    predicted by the planner (dashed): where the lines cross, the winner changes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    for i, s in enumerate(schemes):
        color = f"C{i}"
        mine = sorted((r for r in rows if r["scheme"] == s), key=lambda r: r["link_bits_per_s"])
        ok = [r for r in mine if r["status"] == "ok"]
        if ok:
            ax.plot([r["link_bits_per_s"] / 1e6 for r in ok], [r["tokens_per_s"] for r in ok], "-o", color=color,
                    label=f"{s} measured")
        pred = [r for r in mine if "tokens_per_s" in r.get("predicted", {})]
        if pred:
            ax.plot([r["link_bits_per_s"] / 1e6 for r in pred], [r["predicted"]["tokens_per_s"] for r in pred], "--x",
                    color=color, alpha=0.7, label=f"{s} predicted")
    ax.set(xscale="log", yscale="log", xlabel="inter-node link (Mbit/s per node and direction)", ylabel="tokens/s",
           title="throughput vs inter-node bandwidth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def link_bytes(rows: list[dict], path: str) -> str:
    """Bytes each node's link sends per step, per scheme (measured at the first link speed), beside what
    the tracer says the node's ranks sent to other nodes, and the formula."""
    plt = _pyplot()
    first = rows[0]["link"] if rows else ""
    mine = [r for r in rows if r["link"] == first and r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(mine))
    ax.bar([i - 0.27 for i in x], [(r.get("link_bytes_per_step_per_node") or 0) / 1e6 for r in mine], 0.27,
           label="measured (veth counters)")
    ax.bar(list(x), [(r.get("traced_inter_bytes_per_step_per_node") or 0) / 1e6 for r in mine], 0.27,
           label="traced, to other nodes")
    ax.bar([i + 0.27 for i in x], [(r.get("link_formula_bytes") or 0) / 1e6 for r in mine], 0.27, label="formula")
    ax.set_xticks(list(x), [r["scheme"] for r in mine], rotation=20)
    ax.set(ylabel="MB per step per node", title=f"bytes crossing the inter-node link ({first})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_sweep_plots(rows: list[dict], links: list[str], out_dir: str) -> list[str]:
    first = [r for r in rows if r["link"] == links[0] and r["status"] == "ok"]
    paths = [crossover(rows, links, os.path.join(out_dir, "tokens_vs_bandwidth.png")),
             link_bytes(rows, os.path.join(out_dir, "link_bytes.png"))]
    if first:
        paths.append(loss_curves(first, os.path.join(out_dir, "loss.png")))
    return paths
