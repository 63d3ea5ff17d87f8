"""One call from measurement files to a validated table: load -> fit -> leave-one-model-out -> build."""

from __future__ import annotations

from dataclasses import dataclass

from fitting import calibration_table
from fitting.cv import CvResult, fit_and_validate
from fitting.data import Dataset, load
from fitting.models import Fit


@dataclass
class Fitted:
    data: Dataset
    fit: Fit
    cv: CvResult
    table: dict


def fit_dataset(data: Dataset, file_paths: dict | None = None) -> Fitted:
    """Fit every factor the points support and judge it by leaving one model out."""
    fit, cv = fit_and_validate(data)
    table = calibration_table.validate(calibration_table.build(data, fit, cv, file_paths=file_paths))
    return Fitted(data, fit, cv, table)


def fit_files(paths, gpu: str) -> Fitted:
    """Measurement CSV files (or folders of them) -> the fitted table of `gpu` ("trace" for traces)."""
    return fit_dataset(load(paths, gpu))
