"""Parity plot of predicted (x) vs measured (y), log-log, with y = x and a +-10 % error band.

Two panels, because bytes and seconds share no axis: memory (GiB) and time (seconds). One marker
per quantity. The band is where |predicted - measured| / measured <= 10 %, i.e. measured between
predicted / 1.1 and predicted / 0.9. Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path

from estimator.files import atomic_write
from estimator.quantities import QUANTITIES

BAND = 0.10
_MARKERS = dict(zip(QUANTITIES, ("o", "s", "^", "h", "D", "v", "P", "X", "*", "p", "<", ">")))  # one per quantity, in order
_PANELS = (("bytes", "memory (GiB)", 2.0**30), ("s", "time (s)", 1.0))


def _panel(ax, points, unit: str, label: str, scale: float) -> None:
    mine = [p for p in points if p.unit == unit and p.error is not None]
    ax.set_title(label)
    ax.set_xlabel("predicted")
    ax.set_ylabel("measured")
    if not mine:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)
        return
    values = [v / scale for p in mine for v in (p.predicted, p.measured)]
    low, high = min(values) / 1.5, max(values) * 1.5
    line = [low, high]
    ax.fill_between(line, [x / (1 + BAND) for x in line], [x / (1 - BAND) for x in line],
                    color="0.85", label=f"±{BAND:.0%} error")
    ax.plot(line, line, color="0.3", linewidth=1, label="predicted = measured")
    for name in dict.fromkeys(p.quantity for p in mine):
        xs = [p.predicted / scale for p in mine if p.quantity == name]
        ys = [p.measured / scale for p in mine if p.quantity == name]
        ax.scatter(xs, ys, marker=_MARKERS.get(name, "x"), label=name, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.legend(fontsize="small")


def parity_plot(points, path: Path) -> Path:
    """Write the parity plot PNG of `points` (compare.Point) to `path` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (unit, label, scale) in zip(axes, _PANELS):
        _panel(ax, points, unit, label, scale)
    fig.suptitle("predicted vs measured")
    fig.tight_layout()
    try:
        atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return Path(path)
