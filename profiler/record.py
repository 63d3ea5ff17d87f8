"""The measurement record: one row per configuration (and per rank for multi-GPU runs).

Every column is named here with its unit and meaning; README's column table is generated from
`COLUMNS`. A quantity that was not measured is absent (None in Python, empty in CSV, NaN in
pandas), never 0. Pure Python: no torch import here.
"""

from __future__ import annotations

from dataclasses import fields

from estimator.workload import Workload

STATUSES = ("ok", "oom", "error", "skipped")
BACKENDS = ("cuda", "cpu", "trace")

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
    ("message", "error or skip message, one line; empty when ok"),
    ("backend", "cuda (measured on a GPU), cpu (real step on CPU: time only), trace (fake-tensor trace)"),
    ("rank", "process rank for multi-GPU runs (0 for single-process runs)"),
    ("world_size", "number of processes in the run"),
    ("warmup", "untimed warm-up steps before the peaks were reset"),
    ("steps", "timed steps"),
    ("peak_allocated_bytes", "torch.cuda.max_memory_allocated() over the timed steps (bytes); on trace: "
                             "peak of live fake-tensor bytes rounded to 512 B per tensor"),
    ("peak_reserved_bytes", "torch.cuda.max_memory_reserved() over the timed steps (bytes)"),
    ("device_used_bytes", "peak of NVML used memory of the device sampled in a background thread (bytes); "
                          "includes the CUDA context and everything outside PyTorch"),
    ("device_used_source", "nvml-process (this process's usage) or nvml-device (whole-device used memory)"),
    ("context_bytes", "NVML device used after CUDA initialisation minus before it (bytes)"),
    ("host_rss_bytes", "peak resident set size of the process during the timed steps (bytes)"),
    ("host_offload_bytes", "bytes of optimizer states/parameters DeepSpeed keeps on the host (bytes)"),
    ("weights_bytes", "bytes of parameter storage on the device after building (bytes)"),
    ("step_s", "median seconds per step (training: forward+backward+optimizer step over grad_accum "
               "micro-batches; inference: prefill plus new_tokens decode steps)"),
    ("step_s_min", "fastest timed step (s)"),
    ("step_s_max", "slowest timed step (s)"),
    ("step_spread", "(step_s_max - step_s_min) / step_s"),
    ("prefill_s", "inference: median seconds of the prefill forward"),
    ("decode_token_s", "inference: median seconds per generated token after the prefill"),
    ("tokens_per_s", "tokens processed per second per process (batch x seq x grad_accum / step_s; "
                     "inference: batch x (seq + new_tokens) / step_s)"),
    ("mfu", "model FLOPs per second (estimator.flops) / dense peak FLOP/s of the GPU table row"),
    ("wall_s", "seconds the child process ran, build included"),
    ("started_at", "UTC time the configuration started (ISO 8601)"),
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

COLUMNS: list[tuple[str, str]] = _IDENTITY + _WORKLOAD + _RUN + _ENV
COLUMN_NAMES: list[str] = [name for name, _ in COLUMNS]
WORKLOAD_COLUMNS: list[str] = [name for name, _ in _WORKLOAD]
MEASURED_BYTES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "context_bytes",
                  "host_rss_bytes")


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


def check_row(row: dict) -> dict:
    """Refuse rows that would lie: unknown columns, unknown status/backend, or a measured 0."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise ValueError(f"unknown record columns: {', '.join(sorted(unknown))}")
    if row.get("status") not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}; got {row.get('status')!r}")
    if row.get("backend") not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {row.get('backend')!r}")
    for name in MEASURED_BYTES:
        value = row.get(name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None (not measured); got {value!r}")
    return row
