"""Pictures of the planners' answers (`estimate.py --plot FILE.png`), drawn with matplotlib (imported
here only, so the estimator's cold start does not pay for it):

- with --fit-gpus: per GPU kind, the memory one GPU holds at the count needed, as stacked bars of the
  largest components against the card's capacity, with the safe bound marked;
- with --max-batch / --max-seq: device used memory (and its safe bound) against the batch or the
  sequence length, with the card's capacity as a line and the answer marked.
"""

from __future__ import annotations

from pathlib import Path

from estimator import tables
from estimator.api import _COMPONENTS, estimate
from estimator.errors import InputError
from estimator.units import GiB
from estimator.workload import Workload

WIDTH_IN, HEIGHT_IN, DPI = 10.0, 5.5, 100          # 1000 x 550 pixels
_OTHER = "other components"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib installed") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_path(path: str) -> Path:
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise InputError(f"--plot writes a PNG: give a file name ending in .png, not {out.name!r}")
    if not out.parent.exists():
        raise InputError(f"--plot: folder {out.parent} does not exist")
    return out


def _save(fig, out: Path) -> Path:
    from estimator.files import atomic_write

    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    return out


def fit_gpus(w: Workload, rows, calibration: str, path: str) -> Path:
    """Stacked memory per GPU at the count each kind needs, against capacity and the safe bound."""
    from estimator.planner import _spread

    out = _check_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
    labels, stacks = [], []
    for r in rows:
        if not r.gpus_needed:
            continue
        e = estimate(_spread(w, r.gpus_needed), r.gpu, calibration)
        parts = {k[:-6]: getattr(e.memory, k) for k in _COMPONENTS if getattr(e.memory, k) > 0}
        top = dict(sorted(parts.items(), key=lambda kv: -kv[1])[:5])
        top[_OTHER] = e.memory.device_used_bytes - sum(top.values())
        labels.append(f"{r.gpu}\nx{r.gpus_needed}")
        stacks.append((top, e.safe["device_used_bytes"], tables.gpu(r.gpu).memory_bytes))
    if not stacks:
        raise InputError("--plot: no GPU of the table fits this workload, nothing to draw")
    names = list(dict.fromkeys(k for top, _, _ in stacks for k in top))
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    for i, (top, safe, capacity) in enumerate(stacks):
        bottom = 0.0
        for j, name in enumerate(names):
            value = top.get(name, 0) / GiB
            ax.bar(i, value, bottom=bottom, color=f"C{j % 10}", width=0.6)
            bottom += value
        ax.plot([i - 0.35, i + 0.35], [capacity / GiB] * 2, color="black", linewidth=2)
        ax.plot([i - 0.3, i + 0.3], [safe / GiB] * 2, color="red", linestyle="--", linewidth=1.5)
    handles = [Patch(color=f"C{j % 10}", label=name) for j, name in enumerate(names)]
    handles += [Line2D([], [], color="black", linewidth=2, label="card capacity"),
                Line2D([], [], color="red", linestyle="--", label="safe bound")]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{w.model.name} {w.method}: memory per GPU at the count needed", fontsize=10)
    fig.tight_layout()
    saved = _save(fig, out)
    plt.close(fig)
    return saved


def largest(w: Workload, gpu: str, field: str, value: int, calibration: str, path: str) -> Path:
    """Device used memory and its safe bound against batch or sequence, the card's line, the answer."""
    out = _check_path(path)
    plt = _pyplot()
    top = max(2 * value, 8 if field == "batch" else 1024)
    xs = sorted({max(1, round(top * k / 24)) for k in range(1, 25)} | ({value} if value else set()))
    used, safe = [], []
    for x in xs:
        e = estimate(w.with_(**{field: x}), gpu, calibration)
        used.append(e.memory.device_used_bytes / GiB)
        safe.append(e.safe["device_used_bytes"] / GiB)
    capacity = tables.gpu(gpu).memory_bytes / GiB
    fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
    ax.plot(xs, used, marker="o", markersize=3, label="device used (estimate)")
    ax.plot(xs, safe, linestyle="--", color="red", label="safe bound")
    ax.axhline(capacity, color="black", linewidth=2, label=f"{tables.gpu(gpu).name} capacity")
    if value:
        ax.axvline(value, color="green", linestyle=":", label=f"largest {field} that fits: {value}")
    ax.set_xlabel("micro-batch" if field == "batch" else "sequence length (tokens)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{w.model.name} {w.method}: memory against {field}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    saved = _save(fig, out)
    plt.close(fig)
    return saved
