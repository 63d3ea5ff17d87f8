"""The measurement record: one row per configuration (and per rank for multi-GPU runs).

Every column is named here with its unit and meaning (`COLUMNS`); README's column table is
written by hand and tests/test_readme.py checks that it names every column. A quantity that was
not measured is absent (None in Python, empty in CSV, NaN in pandas), never 0. Pure Python: no
torch import here.

This module owns the row: its columns and their types (`COLUMN_TYPES`, `parse_value`), building
one (`new_row`), reading the Workload back (`case_from_row`, `workload_from_row`), the spelling
of `lora_targets` (`parse_lora_targets`), one status per configuration (`case_status`) and one
row per configuration from its ranks (`merge_ranks`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import fields
from pathlib import Path

from estimator.errors import InputError
from estimator.quantities import MEMORY_QUANTITIES
from estimator.workload import Workload, lora_targets_from_text

STATUSES = ("ok", "oom", "error", "skipped")
BACKENDS = ("cuda", "cpu", "trace", "published", "simulated")
# what an imported row measured (profiler/imports.py): the record column its value goes to
METRICS = {"allocated": "peak_allocated_bytes", "reserved": "peak_reserved_bytes", "active": "peak_active_bytes",
           "device": "device_used_bytes", "capacity": "capacity_bytes", "oom": None}
# the part of a run an imported row's peak covers, when not the whole step or generate (profiler/imports.py)
WINDOWS = ("decode",)

# (column, meaning). Workload fields come first (one column each, see Workload's docstring).
_IDENTITY = [
    ("id", "Workload id: model name#architecture fingerprint|non-default fields; the resume key"),
    ("model", "model reference as given: catalog alias, hub id or config path"),
    ("model_type", "HF model_type of the config"),
]
_WORKLOAD = [(f.name, f"Workload field `{f.name}`") for f in fields(Workload) if f.name != "model"]
_RUN = [
    ("status", "ok, oom (the device ran out of memory: does not fit), error (message says why), "
               "skipped (a package it needs is missing; message names it)"),
    ("message", "one line: why an error or skip; on ok rows a note on how it was measured (DeepSpeed torch_adam fallback, allocator retries), else empty"),
    ("backend", "cuda (measured on a GPU), cpu (real step on CPU: time only), trace (fake-tensor trace), "
                "published (a measurement someone published or a user's own job, imported by profile.py import), "
                "simulated (the CUDA code path run on a simulated device: tests, not hardware)"),
    ("rank", "process rank for multi-GPU runs (0 for single-process runs)"),
    ("world_size", "number of processes in the run"),
    ("warmup", "untimed warm-up steps before the peaks were reset"),
    ("steps", "timed steps"),
    ("peak_allocated_bytes", "torch.cuda.max_memory_allocated() over the timed steps (bytes); on trace: "
                             "peak of live fake-tensor bytes rounded to 512 B per tensor"),
    ("peak_reserved_bytes", "torch.cuda.max_memory_reserved() over the timed steps (bytes)"),
    ("device_used_bytes", "peak of NVML used memory of this process sampled in a background thread "
                          "(bytes; device_used_source says how it was read); includes the CUDA context "
                          "and everything outside PyTorch"),
    ("device_used_source", "nvml-process (this process's usage as NVML lists it) or nvml-device-delta "
                           "(whole-device used memory minus device_baseline_bytes, where NVML lists no "
                           "per-process memory, e.g. in containers); nvml-device: older rows, "
                           "whole-device used memory (driver reserve and other processes included)"),
    ("device_baseline_bytes", "NVML whole-device used memory before this process initialised CUDA "
                              "(bytes): other processes and the driver's share"),
    ("context_bytes", "NVML device used after CUDA initialisation minus before it (bytes)"),
    ("host_rss_bytes", "peak resident set size of the process during the timed steps (bytes)"),
    ("alloc_retries", "cudaMalloc retries of the caching allocator (num_alloc_retries) during the "
                      "timed steps; above 0 the step times are slowed (the message says so)"),
    ("host_offload_bytes", "bytes of optimizer states/parameters DeepSpeed keeps on the host (bytes)"),
    ("weights_bytes", "bytes of parameter storage on the device after building (bytes)"),
    ("step_s", "median seconds per step (training: forward+backward+optimizer step over grad_accum "
               "micro-batches; inference: prefill plus new_tokens decode steps)"),
    ("step_s_min", "fastest timed step (s)"),
    ("step_s_max", "slowest timed step (s)"),
    ("step_spread", "(step_s_max - step_s_min) / step_s"),
    ("prefill_s", "inference: median seconds of the prefill forward"),
    ("decode_token_s", "inference: median seconds per generated token after the prefill"),
    ("optimizer_s", "training: median seconds of the optimizer step (optimizer.step and zero_grad, after "
                    "the forward and backward of every micro-batch and the clipping; not split under DeepSpeed)"),
    ("clip_s", "training: median seconds of the gradient clipping before the optimizer step (the HF "
               "Trainer's max_grad_norm 1.0: torch.nn.utils.clip_grad_norm_; not under DeepSpeed)"),
    ("overhead_s", "training, a real job (the Trainer callback): median seconds between one step's end "
                   "and the next one's begin (data loading, logging and saving when due); the profiler's "
                   "loop has none"),
    ("nosync_microbatch_s", "training with gradient accumulation under DDP or FSDP: median seconds of "
                            "one micro-batch's forward and backward inside no_sync (no gradient reduction)"),
    ("sync_microbatch_s", "the same run: median seconds of the last micro-batch, whose backward reduces the "
                          "gradients across ranks (minus nosync_microbatch_s: the exposed reduction)"),
    ("tokens_per_s", "tokens processed per second per process (batch x seq x grad_accum / step_s; "
                     "inference: batch x (seq + new_tokens) / step_s)"),
    ("mfu", "model FLOPs per second (estimator.flops) / dense peak FLOP/s of the GPU table row"),
    ("wall_s", "seconds the child process ran, build included"),
    ("started_at", "UTC time the configuration started (ISO 8601)"),
]
# where a measurement came from (profile.py import; empty on the profiler's own rows, which measured
# every column they fill and stated every Workload field)
_SOURCE = [
    ("source", "name of the source of an imported row (its folder under calibrations/measurements/)"),
    ("locator", "where in the source: repository, path, commit and line or table, or a URL"),
    ("metric", "what the source measured: allocated, reserved, active, device (whole GPU), capacity "
               "(\"fits within\"), oom"),
    ("window", "the part of the run the measured peak covers when not all of it: `decode` (a generate's "
               "decode alone, the prefill's working set not in it; inference, allocated or active); empty: the "
               "whole step or generate"),
    ("value_as_printed", "the measured value as the source printed it"),
    ("unit_as_printed", "its unit as printed (GiB, GB, MiB, MB, B)"),
    ("conversion", "how the printed value became bytes (GiB = 2^30 B, GB = 1e9 B)"),
    ("stated", "the Workload fields the source stated (comma list); the others are guessed defaults"),
    ("peak_active_bytes", "peak of torch.cuda memory_stats active bytes, as a source measured it (bytes)"),
    ("capacity_bytes", "the run fitted within this much memory (a capacity statement: an upper bound, bytes)"),
]
_ENV = [
    ("gpu_name", "device name as torch reports it (or the CPU model for cpu/trace)"),
    ("gpu_slug", "row of estimator/data/gpus.csv matched to the device, empty if none"),
    ("gpu_memory_bytes", "total device memory from torch/NVML (bytes)"),
    ("driver", "NVIDIA driver version (NVML)"),
    ("cuda", "CUDA runtime version torch was built with"),
    ("torch", "torch version"),
    ("transformers", "transformers version"),
    ("peft", "peft version"),
    ("bitsandbytes", "bitsandbytes version, empty if not installed"),
    ("deepspeed", "deepspeed version, empty if not installed"),
    ("hostname", "machine name"),
]

COLUMNS: list[tuple[str, str]] = _IDENTITY + _WORKLOAD + _RUN + _SOURCE + _ENV
COLUMN_NAMES: list[str] = [name for name, _ in COLUMNS]
WORKLOAD_COLUMNS: list[str] = [name for name, _ in _WORKLOAD]
MEASURED_BYTES = MEMORY_QUANTITIES + ("host_rss_bytes",)
# merge_ranks: each of these is the largest over the ranks, on its own (never one from another)
RANK_MAX_BYTES = MEASURED_BYTES + ("host_offload_bytes", "weights_bytes")
# merge_ranks: these come together from the slowest rank (largest step_s)
STEP_TIME_COLUMNS = ("step_s", "step_s_min", "step_s_max", "step_spread", "prefill_s", "decode_token_s",
                     "optimizer_s", "clip_s", "overhead_s", "nosync_microbatch_s", "sync_microbatch_s",
                     "tokens_per_s", "mfu")
STATUS_PRIORITY = ("oom", "error", "skipped", "ok")  # a configuration's status: the first any rank has
_FLOAT_COLUMNS = {"step_spread", "mfu"}
_INT_COLUMNS = {"rank", "world_size", "warmup", "steps", "alloc_retries"}


def _column_types() -> dict[str, type]:
    """Python type of every column (str unless the name or Workload field says otherwise)."""
    types = {name: str for name in COLUMN_NAMES}
    for f in fields(Workload):
        if f.name in types and isinstance(f.default, (bool, int)):
            types[f.name] = type(f.default)
    for name in COLUMN_NAMES:
        if name.endswith("_bytes") or name in _INT_COLUMNS:
            types[name] = int
        elif name.endswith("_s") or name in _FLOAT_COLUMNS:
            types[name] = float
    return types


COLUMN_TYPES: dict[str, type] = _column_types()


# ---- values -------------------------------------------------------------------------------------

def parse_lora_targets(value) -> tuple[str, ...]:
    """LoRA target roles from a comma string ("q_proj,v_proj" or all-linear), or a list or tuple
    of such strings (a case file's JSON list). The spelling itself is
    estimator.workload.lora_targets_from_text's (the estimator cannot import the profiler);
    whether the roles exist is Workload.validate's rule."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str):
        raise InputError(f"lora_targets must be a comma list of module roles or all-linear; got {value!r}")
    return lora_targets_from_text(value)


def _is_missing(value) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip() == "" or value.strip().lower() == "nan"
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value)


def parse_value(name: str, value):
    """A column's value in its Python type (COLUMN_TYPES; unknown columns are text), from a stored
    cell (CSV text) or a value already typed. Empty, NaN and None are None (not measured). Text
    that is not of the column's type raises InputError naming the column."""
    if _is_missing(value):
        return None
    kind = COLUMN_TYPES.get(name, str)
    if kind is str:
        if isinstance(value, (list, tuple)):
            return ",".join(map(str, value))
        return value if isinstance(value, str) else str(value)
    if kind is bool:
        return _parse_bool(name, value)
    if isinstance(value, bool):
        raise InputError(f"{name}: a number, not a boolean: {value!r}")
    if kind is int:
        return _parse_int(name, value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: not a number: {value!r}") from None


def _parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
    elif isinstance(value, numbers.Real) and value in (0, 1):
        return bool(value)
    raise InputError(f"{name}: not a boolean: {value!r}")


def _parse_int(name: str, value) -> int:
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: not an integer: {value!r}") from None
    if not number.is_integer():
        raise InputError(f"{name}: not an integer: {value!r}")
    return int(number)


# ---- building a row ------------------------------------------------------------------------------

def workload_columns(w: Workload) -> dict:
    """One column per Workload field (tuples joined by commas, as in the Workload id)."""
    out = {}
    for name in WORKLOAD_COLUMNS:
        value = getattr(w, name)
        out[name] = ",".join(value) if isinstance(value, tuple) else value
    return out


def empty_row() -> dict:
    """A row with every column present and unmeasured (None)."""
    return {name: None for name in COLUMN_NAMES}


def new_row(case, backend: str, *, workload: Workload | None = None, **columns) -> dict:
    """A row with every column: what the case says (model, warmup, steps; from its Workload:
    id, model_type, world_size and the Workload columns), rank 0, `backend`, then `columns`
    (whatever the caller knows: status, rank, started_at, measured values...); every other
    column None (not measured). `case` is a profiler.case.Case, or None when none could be read
    (then pass model=... in `columns`); `workload`, when given, is used instead of
    case.workload(). An invalid Workload raises InputError; an unknown column ValueError."""
    row = empty_row()
    if case is not None:
        row.update(model=case.model, warmup=case.warmup, steps=case.steps)
    w = workload if workload is not None else (case.workload() if case is not None else None)
    if w is not None:
        row.update(id=w.id, model_type=w.model.model_type, world_size=w.world_size, **workload_columns(w))
    row.update(backend=backend, rank=0)
    unknown = set(columns) - set(COLUMN_NAMES)
    if unknown:
        raise ValueError(f"unknown record columns: {', '.join(sorted(unknown))}")
    row.update(columns)
    return row


def check_row(row: dict) -> dict:
    """Refuse rows that would lie: unknown columns, unknown status/backend, or a measured 0."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise ValueError(f"unknown record columns: {', '.join(sorted(unknown))}")
    if row.get("status") not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}; got {row.get('status')!r}")
    if row.get("backend") not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {row.get('backend')!r}")
    for name in MEASURED_BYTES + ("peak_active_bytes", "capacity_bytes"):
        value = row.get(name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None (not measured); got {value!r}")
    return row


# ---- reading a row back -------------------------------------------------------------------------

def case_from_row(row, base_dirs: list[Path] | None = None):
    """The profiler.case.Case a row was measured for: its model reference (a config path is
    resolved as a sweep resolves it, against `base_dirs`: by default the working folder, then the
    repository root) and its Workload columns, typed (store rows) or text (CSV cells); an empty
    column takes the Workload default (an empty `attn`, the attention transformers builds the model
    with: `Case.workload`). Raises InputError for a row that names no valid Workload."""
    from profiler.case import Case
    from profiler.sweep import ROOT, resolve_model

    ref = parse_value("model", row.get("model"))
    if ref is None:
        raise InputError("row has no model")
    settings = {}
    for name in WORKLOAD_COLUMNS:
        value = parse_value(name, row.get(name))
        if value is not None:
            settings[name] = parse_lora_targets(value) if name == "lora_targets" else value
    counts = {name: parse_value(name, row.get(name)) for name in ("warmup", "steps")}
    return Case(resolve_model(ref, list(base_dirs) if base_dirs else [Path.cwd(), ROOT]), settings,
                **{k: v for k, v in counts.items() if v is not None})


def workload_from_row(row, base_dirs: list[Path] | None = None) -> Workload:
    """The validated Workload of a row (see `case_from_row`)."""
    return case_from_row(row, base_dirs).workload()


# ---- several rows of one configuration ----------------------------------------------------------

def case_status(rows: list[dict]) -> str:
    """One status for a configuration's rows: oom if any rank ran out of memory, else error,
    skipped, ok (error when no row has a known status)."""
    statuses = {r.get("status") for r in rows}
    return next((s for s in STATUS_PRIORITY if s in statuses), "error")


def measured_value(value) -> float | None:
    """A measured number (typed or text), or None when absent, NaN, not a number or not positive."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _largest(rows: list[dict], name: str) -> dict | None:
    """The first row with the largest measured value of `name`; None when no row measured it."""
    best, best_value = None, None
    for row in rows:
        value = measured_value(row.get(name))
        if value is not None and (best_value is None or value > best_value):
            best, best_value = row, value
    return best


def _rank_order(row: dict) -> int:
    try:
        return int(float(row.get("rank")))
    except (TypeError, ValueError):
        return 1 << 30


def _merge(rows: list[dict]) -> dict:
    if len(rows) == 1:
        return dict(rows[0])
    rows = sorted(rows, key=_rank_order)
    merged = dict(rows[0])  # identity, Workload and environment columns: the lowest rank's
    status = case_status(rows)
    merged.update(rank=None, status=status,
                  message=next((r.get("message") for r in rows if r.get("status") == status and r.get("message")),
                               rows[0].get("message") if status == rows[0].get("status") else ""))
    for name in RANK_MAX_BYTES:
        top = _largest(rows, name)
        merged[name] = top[name] if top else None
        if name == "device_used_bytes":
            merged["device_used_source"] = top.get("device_used_source") if top else None
    slowest = _largest(rows, "step_s")
    if slowest is not None:
        merged.update({name: slowest.get(name) for name in STEP_TIME_COLUMNS})
    top = _largest(rows, "wall_s")
    merged["wall_s"] = top["wall_s"] if top else None
    return merged


def merge_ranks(rows: list[dict], key: tuple[str, ...] = ("id",)) -> list[dict]:
    """One row per configuration (rows with equal `key` columns), in order of first appearance.

    A configuration with one row keeps it as it is. Of several (its ranks): status by
    `case_status` (oom if any rank ran out) and the message of a rank with that status; each
    memory quantity (RANK_MAX_BYTES) the largest over the ranks, each on its own (the peak
    reserved bytes may come from another rank than the peak allocated bytes), and
    device_used_source with device_used_bytes; the step-time columns (STEP_TIME_COLUMNS) all from
    the slowest rank (largest step_s); wall_s the largest; rank None (the row stands for every
    rank); every other column from the lowest rank. Values keep their form (typed or text)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in key), []).append(row)
    return [_merge(group) for group in groups.values()]
