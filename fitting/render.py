"""Text renderings of error tables and factors (used by fitting.refresh and the bench script)."""

from __future__ import annotations

from estimator.quantities import FITTED_QUANTITIES as QUANTITIES
from estimator.units import GiB


def _cell(m: dict | None) -> str:
    if not m:
        return f"{'-':>7}{'-':>7}{'-':>7}"
    return f"{m['median_abs'] * 100:6.1f}%{m['p90_abs'] * 100:6.1f}%{m['under_rate'] * 100:6.0f}%"


def errors(columns: list[tuple[str, dict]], targets: dict | None = None) -> str:
    """One line per quantity: points, then median |error|, p90 |error| and under-estimate rate
    of each column (label, {quantity: metrics}); a target column when given."""
    width = 22
    head1 = f"{'quantity':<{width}}{'points':>7}" + "".join(f" | {label[:21]:<21}" for label, _ in columns)
    head2 = f"{'':<{width}}{'':>7}" + "".join(f" | {'med':>7}{'p90':>7}{'under':>7}" for _ in columns)
    if targets:
        head1 += " | target"
    lines = [head1, head2]
    for q in QUANTITIES:
        found = [errs.get(q) for _, errs in columns]
        if not any(found):
            continue
        points = max(m["points"] for m in found if m)
        line = f"{q:<{width}}{points:>7}" + "".join(f" | {_cell(m)}" for m in found)
        if targets and q in targets:
            line += f" | {targets[q]}"
        lines.append(line)
    if len(lines) == 2:
        lines.append("(no measured quantity)")
    return "\n".join(lines)


def _value(name: str, value) -> str:
    if isinstance(value, int) and name.endswith("bytes"):
        return f"{value / GiB:.3f} GiB ({value} B)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def factors(table: dict) -> str:
    """The factors of a table, one per line, with the points each rests on."""
    lines, points = [], table.get("factor_points", {})
    for name, value in table.get("factors", {}).items():
        if isinstance(value, dict):
            for key, v in value.items():
                shown = (f"fraction {v['fraction']:g} + {v['bytes'] / GiB:.3f} GiB"
                         if isinstance(v, dict) else _value(name, v))
                n = points.get(name, {}).get(key) if isinstance(points.get(name), dict) else None
                lines.append(f"  {name}[{key}] = {shown}" + (f"   ({n} points)" if n else "   (median of entries)"))
        else:
            n = points.get(name)
            lines.append(f"  {name} = {_value(name, value)}" + (f"   ({n} points)" if n else ""))
    return "\n".join(lines) if lines else "  (no factor: too few points)"


def upper_bounds(table: dict) -> str:
    lines = []
    for q, row in table.get("upper_bound", {}).items():
        form = (f"prediction + {row['uncertain_scale']:.4f} x uncertain part" if row.get("uncertain_scale") is not None
                else f"prediction x {row['factor']:.4f}")
        lines.append(f"  {q}: {form} covered {row['coverage'] * 100:.0f}% of "
                     f"held-out points ({row['points']} points, {row['models']} models)")
    return "\n".join(lines) if lines else "  (none: fewer than 2 models)"
