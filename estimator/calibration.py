"""Calibration tables: correction factors per GPU kind, fitted from measurements.

A table is `calibrations/<gpu-slug>.json`:
```
{"schema": "gpu-budget-calibration/1", "gpu": "h100-80gb", "created": "YYYY-MM-DD",
 "versions": {"torch": ..., "transformers": ..., "driver": ..., "cuda": ...},
 "provenance": {"runs": [...], "points": N},
 "factors": {"cuda_context_bytes": int, "reserve_fraction": {method: f},
             "activation_scale": {model_type or "*": s}, "mfu": {method: m},
             "decode_bandwidth_fraction": f},
 "cv_error": {quantity: {"median_abs": e, "p90_abs": e, "under_rate": r, "points": n}}}
```
Every factor is optional; a missing one falls back to the uncalibrated default, and the result
says which values came from where.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from estimator import tables
from estimator.defaults import overhead
from estimator.errors import EstimatorError

SCHEMA = "gpu-budget-calibration/1"
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibrations"
_FACTOR_KEYS = {"cuda_context_bytes", "reserve_fraction", "activation_scale", "mfu",
                "decode_bandwidth_fraction"}


@dataclass(frozen=True)
class Calibration:
    """The factors in force for one estimate, and where each came from."""

    path: str | None
    gpu: str | None
    factors: dict = field(default_factory=dict)
    cv_error: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)

    def context_bytes(self) -> tuple[int, str]:
        if "cuda_context_bytes" in self.factors:
            return int(self.factors["cuda_context_bytes"]), "calibration"
        return int(overhead("cuda_context_bytes")), "default"

    def reserve_fraction(self, method: str) -> tuple[float, str]:
        table = self.factors.get("reserve_fraction", {})
        if method in table:
            return float(table[method]), "calibration"
        return float(overhead(f"reserve_fraction_{method}")), "default"

    def activation_scale(self, model_type: str) -> tuple[float, str]:
        table = self.factors.get("activation_scale", {})
        for key in (model_type, "*"):
            if key in table:
                return float(table[key]), "calibration"
        return 1.0, "default"

    def mfu(self, method: str, gpu_slug: str) -> tuple[float, str]:
        key = "inference-prefill" if method == "inference" else method
        table = self.factors.get("mfu", {})
        if key in table:
            return float(table[key]), "calibration"
        row = tables.mfu_default(key, gpu_slug)
        return row.mfu, "default"

    def decode_bandwidth_fraction(self, gpu_slug: str) -> tuple[float, str]:
        if "decode_bandwidth_fraction" in self.factors:
            return float(self.factors["decode_bandwidth_fraction"]), "calibration"
        return tables.mfu_default("decode-bandwidth", gpu_slug).mfu, "default"


NONE = Calibration(path=None, gpu=None)


def _check_fraction(name: str, value, low: float, high: float, path: Path) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise EstimatorError(f"calibration {path}: {name} must be a number in [{low}, {high}], got {value!r}")


def validate_table(data: dict, path: Path) -> None:
    """Refuse a corrupt or foreign table with a one-line reason."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise EstimatorError(f"calibration {path} is not a {SCHEMA} table")
    factors = data.get("factors")
    if not isinstance(factors, dict) or set(factors) - _FACTOR_KEYS:
        raise EstimatorError(f"calibration {path}: unknown factors {sorted(set(factors or {}) - _FACTOR_KEYS)}")
    if "cuda_context_bytes" in factors:
        value = factors["cuda_context_bytes"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise EstimatorError(f"calibration {path}: cuda_context_bytes must be a non-negative int")
    for name, low, high in (("reserve_fraction", 0.0, 2.0), ("activation_scale", 0.2, 5.0), ("mfu", 0.01, 0.99)):
        table = factors.get(name, {})
        if not isinstance(table, dict):
            raise EstimatorError(f"calibration {path}: {name} must be an object")
        for key, value in table.items():
            _check_fraction(f"{name}[{key}]", value, low, high, path)
    if "decode_bandwidth_fraction" in factors:
        _check_fraction("decode_bandwidth_fraction", factors["decode_bandwidth_fraction"], 0.05, 1.0, path)


@lru_cache(maxsize=64)
def _load(path_str: str) -> Calibration:
    path = Path(path_str)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise EstimatorError(f"cannot read calibration {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise EstimatorError(f"calibration {path} is corrupt: {exc.msg} at line {exc.lineno}") from None
    validate_table(data, path)
    return Calibration(str(path), data.get("gpu"), data["factors"], data.get("cv_error", {}),
                       data.get("versions", {}))


def resolve(choice: str, gpu_slug: str) -> Calibration:
    """`none`, `auto` (calibrations/<gpu>.json when it exists) or a path to a table."""
    if choice == "none":
        return NONE
    if choice == "auto":
        path = CALIBRATION_DIR / f"{gpu_slug}.json"
        return _load(str(path)) if path.is_file() else NONE
    path = Path(choice)
    if not path.is_file():
        raise EstimatorError(f"calibration file not found: {choice}")
    return _load(str(path.resolve()))
