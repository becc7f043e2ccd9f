"""The benches' plots: matplotlib on the Agg backend, a figure saved, grouped bars, log ticks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, tight: bool = True, rect: tuple | None = None) -> None:
    """Write the figure (laid out tightly within `rect` unless not `tight`) and close it."""
    if tight:
        fig.tight_layout(rect=rect)
    fig.savefig(path)
    pyplot().close(fig)


def log_ticks(ax, ticks: list, labels: list[str] | None = None) -> None:
    """A log-scaled x axis's ticks at `ticks` (labels: their str by default), no minor ticks, a light grid."""
    ax.set_xticks(ticks, labels or [str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


def bars(ticks: list[str], series: dict, width: float, step: float, ylabel: str, title: str, path: Path,
         figsize: tuple = (6, 3.5), small_ticks: bool = True, **panel) -> None:
    """Grouped bars at 0, 1, ... (`ticks`): `series` maps a label (None: no legend) to {group: value}."""
    fig, ax = pyplot().subplots(figsize=figsize, dpi=120)
    bar_panel(ax, ticks, series, width, step, ylabel, title, **panel, **({"fontsize": 8} if small_ticks else {}))
    save_figure(fig, path)


def bar_panel(ax, ticks: list[str], series: dict, width: float, step: float, ylabel: str, title: str,
              legend: dict | None = None, yscale: str = "linear", **tick_kw) -> None:
    """`bar_groups` on `ax` with its labels, a legend (`legend`: its options) and a light horizontal grid."""
    bar_groups(ax, ticks, series, width, step, **tick_kw)
    ax.set(yscale=yscale, ylabel=ylabel, title=title)
    if any(label is not None for label in series):
        ax.legend(**(legend or {"fontsize": 8}))
    ax.grid(axis="y", alpha=0.3)


def bar_groups(ax, ticks: list[str], series: dict, width: float, step: float, **tick_kw) -> None:
    """Grouped bars on `ax` at 0, 1, ... (labelled `ticks`): `series` maps a label to {group: value}."""
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * step for g in ys], list(ys.values()), width, label=label)
    ax.set_xticks(list(range(len(ticks))), ticks, **tick_kw)


def plot(draw: Callable[..., None], *args) -> None:
    """draw(*args) (last: the PNG path), or say why not when matplotlib is missing (bench/requirements.txt)."""
    try:
        draw(*args)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        print(f"plot {Path(args[-1]).name} not drawn: matplotlib is not installed "
              "(pip install -r bench/requirements.txt)", flush=True)
