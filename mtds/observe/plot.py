"""Training curves as one PNG (loss with eval points, learning rate, throughput), from the step records."""
from __future__ import annotations

import os
from typing import Any


def plot_run(records: list[dict[str, Any]], path: str, title: str = "") -> str:
    import matplotlib.pyplot as plt
    fig = run_figure(records, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_figure(records: list[dict[str, Any]], title: str = ""):
    """The figure :func:`plot_run` saves: loss (with eval points), learning rate and throughput against the step."""
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_loss, ax_lr, ax_tput) = plt.subplots(1, 3, figsize=(14, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train])
    ax_lr.set(xlabel="step", ylabel="learning rate", title="schedule")
    ax_tput.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    ax_tput.set(xlabel="step", ylabel="tokens/s", title="throughput")
    from matplotlib.ticker import MaxNLocator
    for ax in (ax_loss, ax_lr, ax_tput):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # steps are whole: no 1.25 on a 3-step run
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
