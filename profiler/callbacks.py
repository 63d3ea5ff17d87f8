"""Measure the user's real job: a Hugging Face `Trainer` callback (and so TRL's trainers).

    from profiler.callbacks import MeasureCallback
    trainer = Trainer(..., callbacks=[MeasureCallback("gpu-budget-measurements.csv")])

After `warmup_steps` optimizer steps it resets the allocator's peaks, then times every step; at the
end of training it writes one measurement row (profiler/record.py's schema, the profiler's own
columns: peak allocated and reserved from the caching allocator, NVML device used where NVML maps
the device, median step time) beside the model's config.json, and prints predicted against
measured; the optimizer step is timed on its own too (`optimizer_s`, between the Trainer's
on_pre_optimizer_step and on_optimizer_step: optimizer.step alone), and so is the host's work
between steps (`overhead_s`: from one step's on_step_end to the next one's on_step_begin, where the
Trainer logs, evaluates and saves when due and fetches the next batches; the median, so the
periodic logging and saving do not weigh). The Workload comes from the trainer itself:
`TrainingArguments.to_dict()` through the one mapping of estimator/sources/training_args.py (batch, accumulation, checkpointing, precision, optim,
DeepSpeed and FSDP settings), the peft adapter config (estimator/sources/peft.py) and the model's
bitsandbytes quantization config (estimator/sources/quantization.py); the sequence length from
`seq=` or the arguments' max_length, else the first batch seen; every field so derived is listed in
the row's `stated`. Off CUDA, memory is "not measured" (empty) and only the step time is recorded.
`gpu-budget estimate --model <the config written> ...` (or `fitting`) can compare the row.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from estimator import sources
from estimator.errors import InputError
from estimator.files import atomic_write_text, utc_now
from estimator.sources import peft as peft_source
from estimator.sources import quantization, training_args
from estimator.workload import Workload, method_defaults
from profiler import record, steps
from profiler.device import cuda



class MeasureCallback(TrainerCallback):
    def __init__(self, out: str | os.PathLike = "gpu-budget-measurements.csv", warmup_steps: int = 2,
                 seq: int | None = None, gpu: str | None = None, source: str = "trainer-callback",
                 compare: bool = True):
        if warmup_steps < 0:
            raise InputError("warmup_steps must be 0 or more")
        self.out, self.warmup, self.seq, self.gpu, self.source, self.compare = (
            Path(out), warmup_steps, seq, gpu, source, compare)
        self.times: list[float] = []
        self.optimizer_times: list[float] = []   # optimizer.step alone (the Trainer's pre/post hooks)
        self._t0: float | None = None
        self._t_opt: float | None = None
        self.between_times: list[float] = []    # a step's end to the next one's begin (host work)
        self._t_end: float | None = None
        self._device = "cpu"
        self._seen_seq: int | None = None
        self.row: dict | None = None

    # ---- the Trainer's events ----

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._device = str(getattr(args, "device", "cpu"))
        self._model = model
        self._hook = None
        if model is not None and self.seq is None:     # the sequence length of the first batch seen
            self._hook = model.register_forward_pre_hook(self._see_batch, with_kwargs=True)

    def _see_batch(self, module, positional, keywords):
        ids = keywords.get("input_ids") if keywords else None
        if ids is None and positional:
            ids = positional[0]
        if self._seen_seq is None and hasattr(ids, "shape") and len(ids.shape) == 2:
            self._seen_seq = int(ids.shape[1])

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            cuda.reset_peaks(self._device)
        if state.global_step >= self.warmup:
            cuda.synchronize(self._device)
            self._t0 = time.perf_counter()
            if self._t_end is not None:   # the host's work since the last step ended
                self.between_times.append(self._t0 - self._t_end)
                self._t_end = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._t0 is not None:
            cuda.synchronize(self._device)
            self._t_opt = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._t0 is not None and self._t_opt is not None:
            cuda.synchronize(self._device)
            self.optimizer_times.append(time.perf_counter() - self._t_opt)
            self._t_opt = None

    def on_step_end(self, args, state, control, **kwargs):
        if self._t0 is not None:
            cuda.synchronize(self._device)
            self._t_end = time.perf_counter()
            self.times.append(self._t_end - self._t0)
            self._t0 = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
        if not self.times:
            print(f"MeasureCallback: no step after the {self.warmup} warm-up steps; nothing recorded",
                  file=sys.stderr)
            return
        try:
            self.row = self._row(args, model or self._model)
        except InputError as exc:                 # a setup the estimator cannot express: say so
            print(f"MeasureCallback: not recorded: {exc}", file=sys.stderr)
            return
        write_row(self.out, self.row)
        if self.compare:
            print(comparison(self.row), file=sys.stderr)

    # ---- the row ----

    def _row(self, args, model) -> dict:
        config = _config_of(model)
        config_path = self.out.with_name(f"{self.out.stem}-config.json")
        atomic_write_text(config_path, json.dumps(config, indent=2, default=str) + "\n")
        w, stated = workload_of(args, model, config_path, self.seq or self._seen_seq)
        peaks = cuda.peaks(self._device)
        on_gpu = cuda.is_cuda(self._device)
        slug = self.gpu or (_gpu_slug(self._device) if on_gpu else None)
        step_s = statistics.median(self.times)
        return record.new_row(
            None, cuda.backend(self._device), workload=w, model=str(config_path), status="ok", warmup=self.warmup,
            steps=len(self.times), peak_allocated_bytes=peaks.allocated_bytes,
            peak_reserved_bytes=peaks.reserved_bytes, step_s=step_s, step_s_min=min(self.times),
            step_s_max=max(self.times), tokens_per_s=w.batch * w.seq * w.grad_accum / step_s,
            optimizer_s=statistics.median(self.optimizer_times) if self.optimizer_times else None,
            overhead_s=statistics.median(self.between_times) if self.between_times else None,
            source=self.source, locator=str(getattr(args, "output_dir", "")), stated=",".join(stated),
            gpu_slug=slug, started_at=utc_now(), message="measured by profiler.callbacks.MeasureCallback")


def _config_of(model) -> dict:
    base = getattr(model, "base_model", model)
    base = getattr(base, "model", base) if hasattr(model, "peft_config") else base
    config = getattr(model, "config", None) or getattr(base, "config", None)
    if config is None:
        raise InputError("the model has no config: MeasureCallback measures Hugging Face models")
    return config.to_dict()


def workload_of(args, model, config_path: Path, seq: int | None) -> tuple[Workload, list[str]]:
    """The Workload of a running Trainer, and the fields it was derived from (stated)."""
    from estimator.configs import load_spec

    readings = [training_args.workload_fields(args.to_dict(), "TrainingArguments")]
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        adapter = next(iter(peft_config.values()))
        readings.append(peft_source.read(_plain(adapter.to_dict()), "peft config"))
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        readings.append(quantization.read(_plain(quant if isinstance(quant, dict) else quant.to_dict()),
                                          "quantization_config"))
    reading = sources.combine(readings)
    fields = dict(reading.fields)
    fields.pop("model", None)
    precision = _precision(model, args)
    if precision:
        fields["precision"] = precision
    if seq is not None:
        fields["seq"] = seq
    if fields.get("method") == "lora" and fields.get("quant") in ("nf4", "fp4"):
        fields["method"] = "qlora"
    world = int(getattr(args, "world_size", 1) or 1)
    if world > 1:
        fields["gpus"] = world
    w = Workload(model=load_spec(str(config_path)), **method_defaults(fields)).validate()
    return w, sorted(set(fields) | {"method"})


_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _precision(model, args) -> str | None:
    """What the Trainer really runs: the weights' dtype, under autocast when bf16/fp16 is set on
    fp32 weights (transformers 5 Trainer: autocast with the model as loaded)."""
    weights = _DTYPES.get(str(getattr(model, "dtype", "")))
    if weights is None:
        return None
    amp = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if weights == "fp32" and amp:
        return f"amp-{amp}"
    return weights


def _plain(value):
    """A config dict with sets and enums as JSON values."""
    return json.loads(json.dumps(value, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def _gpu_slug(device: str) -> str | None:
    from profiler.env import match_gpu_slug

    name, total = cuda.properties(device)
    return match_gpu_slug(name.removesuffix(" (simulated)"), total)


def write_row(path: Path, row: dict) -> Path:
    """Append the row to the measurement file (atomic rewrite; the profiler's columns)."""
    from profiler.imports import to_csv

    rows = []
    if path.exists():
        import csv

        with open(path, newline="") as f:
            rows = [{k: record.parse_value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]
    text = to_csv(rows + [row])
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, text)


def comparison(row: dict) -> str:
    """Predicted (the estimator, uncalibrated) against measured, for the end of training."""
    from estimator.api import estimate

    w = record.workload_from_row(row)
    slug = row.get("gpu_slug") or "h100-80gb"
    e = estimate(w, slug, "auto" if row.get("gpu_slug") else "none")
    lines = [f"gpu-budget: {w.model.name} {w.method} batch {w.batch} x seq {w.seq}  ({row['backend']})"]
    for name, measured in (("peak allocated", row.get("peak_allocated_bytes")),
                           ("peak reserved", row.get("peak_reserved_bytes"))):
        predicted = getattr(e.memory, name.replace(" ", "_") + "_bytes")
        shown = "not measured" if measured is None else f"{measured / 2**30:.2f} GiB ({predicted / measured - 1:+.1%})"
        lines.append(f"  {name:<16} predicted {predicted / 2**30:.2f} GiB   measured {shown}")
    if row["backend"] == "cuda":   # the step between on_step_begin and on_step_end: no data loading or logging
        predicted = steps.loop_step_s(e.time, steps.clipped(row))
        lines.append(f"  {'step time':<16} predicted {predicted:.3f} s   measured {row['step_s']:.3f} s")
    else:
        lines.append(f"  {'step time':<16} measured {row['step_s']:.3f} s on the CPU (no GPU prediction to compare)")
    return "\n".join(lines)
