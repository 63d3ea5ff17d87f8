"""Fitting: measurements + predictions -> calibration factors with cross-validated error (no torch).

Modules (numpy, scipy, pandas and the estimator only; profiler.case/record are pure Python):
- `data`: measurement CSV rows -> Workloads + the estimator's uncalibrated predictions (a Dataset);
- `models`: the factor models and their robust, bounded fits (`fit_all`);
- `cv`: leave-one-model-out cross-validation, error statistics, the safe upper bound;
- `table`: build, validate, read and atomically write calibrations/<gpu>.json;
- `pipeline`: files -> fitted table in one call; `refresh`: what scripts/profile.py calls after a run;
- `render`: text tables; `synthetic`: rows from known factors plus noise (tests, demonstrations).
The table schema and the meaning of every factor: estimator/calibration.py.
"""
