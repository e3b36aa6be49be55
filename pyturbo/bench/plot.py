"""The benches' picture: mean KLD against bits per value, mainline types and turboq apart, with the
Pareto front drawn (`bench quality` and `bench matrix`). matplotlib comes with the [bench] extra."""
from __future__ import annotations

from pathlib import Path


def pareto_front(points: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The points that no other point beats on both bits and KLD (lower is better for both), by bits."""
    front, best = [], float("inf")
    for p in sorted(points, key=lambda p: (p[1], p[2])):
        if p[2] < best:
            front.append(p)
            best = p[2]
    return front


def plot_kld_per_bit(points: list[tuple[str, float, float]], path: Path, title: str) -> None:
    """KLD against bits per value, mainline types blue, turboq configurations red, the Pareto front a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, bpw, kld in points:
        turbo = "turboq" in label
        ax.scatter(bpw, max(kld, 1e-6), c="tab:red" if turbo else "tab:blue", s=36, zorder=3,
                   label="turboq" if turbo else "mainline")
        ax.annotate(label, (bpw, max(kld, 1e-6)), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = pareto_front(points)
    ax.plot([p[1] for p in front], [max(p[2], 1e-6) for p in front], "k--", lw=1, zorder=2, label="Pareto front")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("bits per cached value (mean of K and V)")
    ax.set_ylabel("mean KLD vs f16 cache (log scale)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
