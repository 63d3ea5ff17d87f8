"""Measurement rows -> Workloads + the estimator's uncalibrated predictions, as one DataFrame.

Input: CSV files of profiler records (profiler/record.py columns; unmeasured = empty). Which rows
a table of `gpu` uses:
- a GPU slug: rows with backend `cuda` and that `gpu_slug` (memory, context, step time);
- `trace` (estimator.calibration.TRACE_GPU): rows with backend `trace` (peak allocated only);
- rows with status other than `ok`, `cpu` rows (a CPU step time says nothing about a GPU) and
  rows of other GPUs are left out and counted in `Dataset.skipped`.
Multi-process runs (world_size > 1) keep one point per configuration and file: the largest
memory quantity over ranks (what runs out first) and the slowest rank's step time
(profiler.record.merge_ranks).

Columns of `Dataset.frame` (bytes int-valued floats, seconds float, NaN = not measured):
`group` (architecture fingerprint: the leave-one-model-out unit), `model`, `family`
(model_type), `attn`, `method`, `training`, `params_total`, `params_active`, `tokens`
(batch x seq), `world_size`, `grad_accum`, `new_tokens`; measured `m_<quantity>`; raw
predictions `raw_<quantity>`; components `acts`, `logits`, `temps` (unrounded), `persistent`,
`fwd`, `step` (the persistent states and the two working sets from estimator.memory.working_sets,
the function the estimator's assembly uses: training forward/backward and optimizer step,
inference prefill and dequantized weight), `paged`; time inputs `hw_flops`
(hardware FLOPs per optimizer step), `peak_flops` (FLOP/s), `exposed_comm_s`, `prefill_flops`,
`decode_bytes` (bytes read per generated token), `bandwidth` (bytes/s), `optimizer_s` and `clip_s`
(the step's parts outside compute the profiler's loop runs; `clipped`: the row's loop clipped the
gradients, profiler.steps.clipped), `decode_floor_s`, `decode_extra_s`, `decode_attention_s`,
`decode_layers` (eager: the layers of the launch floor; 0 compiled), `decode_default_fraction` and
`decode_slowdown` (estimator.timing.DecodeParts), `launch_ops` (training: operators dispatched per
step, estimator.ops; 0 compiled); versions.
"""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from estimator import tables
from estimator.api import estimate
from estimator.calibration import TRACE_GPU, TRACE_PREDICTION_GPU
from estimator.errors import InputError
from estimator.compute_time import hfu_terms
from estimator.memory import scaled_activations, working_sets
from estimator.api import DEFAULT_INTER_NODE
from estimator.timing import backward_share, communication, decode_floor_seconds, decode_parts, launch_floor_seconds
from estimator.params import count_params
from estimator.quantities import FITTED_QUANTITIES as QUANTITIES
from estimator.quantities import QUANTITIES as _MEASURED
from estimator.timing import peak_flops
from estimator.versions import VERSION_COLUMNS
from estimator.workload import Workload
from profiler import record, steps

REPO_ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS_DIR = REPO_ROOT / "calibrations" / "measurements"
# rows measured under a regime the estimator and the profiler no longer run (file, id, regime, reason)
SUPERSEDED_FILE = MEASUREMENTS_DIR / "superseded.csv"


@dataclass(frozen=True)
class SourceFile:
    """One measurement file: where, its content hash, how many rows and how many were used."""

    path: str          # relative to the repository root when inside it
    sha256: str
    rows: int
    used: int = 0
    first: str = ""    # earliest started_at of its rows (ISO 8601)
    last: str = ""

    def to_dict(self) -> dict:
        return {"file": self.path, "sha256": self.sha256, "rows": self.rows, "used": self.used,
                "first": self.first, "last": self.last}


@dataclass
class Dataset:
    """The points one table is fitted on, aligned with their Workloads."""

    gpu: str
    frame: pd.DataFrame
    workloads: list
    files: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # reason -> count

    @property
    def slug(self) -> str:
        """The GPU row the estimator is asked about for these points."""
        return TRACE_PREDICTION_GPU if self.gpu == TRACE_GPU else self.gpu

    def subset(self, mask) -> "Dataset":
        mask = np.asarray(mask, dtype=bool)
        return Dataset(self.gpu, self.frame[mask].reset_index(drop=True),
                       [w for w, keep in zip(self.workloads, mask) if keep], self.files, self.skipped)

    def points(self, quantity: str) -> int:
        return int(self.frame[f"m_{quantity}"].notna().sum()) if len(self.frame) else 0


def display_path(path: Path) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def csv_files(paths) -> list[Path]:
    """Files given, and the *.csv (and *.parquet) directly inside folders given, in order,
    without duplicates."""
    out = []
    for p in map(Path, paths):
        found = sorted([*p.glob("*.csv"), *p.glob("*.parquet")]) if p.is_dir() else [p]
        for f in found:
            if f.resolve() not in [o.resolve() for o in out]:
                out.append(f)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def superseded() -> dict[tuple[str, str], str]:
    """{(the file's folder/name, row id): regime} of the rows calibrations/measurements/superseded.csv
    lists: measured under a regime the estimator and the profiler no longer run (each with its
    reason there), so never fitted; profiler.trace.measured traces them in that regime."""
    return dict(_superseded(SUPERSEDED_FILE))


@lru_cache(maxsize=4)
def _superseded(path: Path) -> tuple:
    with Path(path).open(newline="") as f:
        return tuple(((r["file"], r["id"]), r["regime"]) for r in csv.DictReader(f))


def superseded_regime(path, row_id: str) -> str | None:
    """The regime a row of the measurement file `path` ran if superseded.csv lists it, else None."""
    path = Path(path)
    return superseded().get((f"{path.parent.name}/{path.name}", row_id))


def read_table_file(path: Path) -> pd.DataFrame:
    """One measurement file as strings (empty = not measured): CSV, or Parquet (needs pyarrow)."""
    if Path(path).suffix == ".parquet":
        frame = pd.read_parquet(path)
        return frame.astype(object).where(frame.notna(), "").astype(str).replace({"nan": "", "None": ""})
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def read_rows(paths) -> tuple[pd.DataFrame, list[SourceFile]]:
    """All rows of the CSV files (strings; empty = not measured), with a `source_file` column.
    Files with identical content are read once."""
    frames, files, seen = [], [], set()
    for f in csv_files(paths):
        if not f.is_file():
            raise FileNotFoundError(f"measurement file not found: {f}")
        digest = sha256(f)
        if digest in seen:
            continue
        seen.add(digest)
        df = read_table_file(f)
        df["source_file"] = display_path(f)
        df["_csv_dir"] = str(f.resolve().parent)
        started = sorted(s for s in df.get("started_at", pd.Series([], dtype=str)) if s)
        files.append(SourceFile(display_path(f), digest, len(df), 0, started[0] if started else "",
                                started[-1] if started else ""))
        frames.append(df)
    if not frames:
        return pd.DataFrame(), files
    frame = pd.concat(frames, ignore_index=True).fillna("")
    # the same record in two files (a resumed run's grown results.csv next to its earlier copy)
    # is one measurement
    duplicate = frame.duplicated(subset=[c for c in frame.columns if c not in ("source_file", "_csv_dir")])
    frame = frame[~duplicate].reset_index(drop=True)
    frame.attrs["duplicates"] = int(duplicate.sum())
    return frame, files


def rows_frame(records: list[dict], source: str = "<memory>") -> pd.DataFrame:
    """Record dicts (Python values) as `read_rows` would give them from a CSV: strings, empty
    for None, with `source_file` set."""
    frame = pd.DataFrame([{k: "" if v is None else str(v) for k, v in r.items()} for r in records])
    frame["source_file"] = source
    frame["_csv_dir"] = ""
    return frame.fillna("")


def workload_from_row(row) -> Workload:
    """The validated Workload of a record row (profiler.record's reading of a row; a config path
    is resolved against the repository, then the CSV's folder)."""
    csv_dir = str(row.get("_csv_dir", "") or "")
    return record.workload_from_row(row, base_dirs=[REPO_ROOT] + ([Path(csv_dir)] if csv_dir else []))


def _num(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) and value > 0 else math.nan


def _select(rows: pd.DataFrame, gpu: str, skipped: dict) -> pd.DataFrame:
    def skip(mask, reason):
        n = int(mask.sum())
        if n:
            skipped[reason] = skipped.get(reason, 0) + n
        return rows[~mask]

    for col in ("status", "backend", "gpu_slug", "world_size", "rank", "id"):
        if col not in rows:
            rows[col] = ""
    rows = skip(rows["status"] != "ok", "status not ok (oom/error/skipped)")
    old = [superseded_regime(Path(d or ".") / Path(f).name, i) is not None
           for d, f, i in zip(rows["_csv_dir"], rows["source_file"], rows["id"])]
    rows = skip(pd.Series(old, index=rows.index, dtype=bool),
                "ran a regime no longer modelled (calibrations/measurements/superseded.csv)")
    if gpu == TRACE_GPU:
        rows = skip(rows["backend"] != "trace", "not a trace row")
    else:
        rows = skip(rows["backend"] == "cpu", "cpu row (time on CPU says nothing about a GPU)")
        rows = skip(rows["backend"] == "trace", "trace row (fitted into the trace table, not a GPU table)")
        rows = skip(rows["backend"] == "simulated", "simulated device row (tests the code, not hardware)")
        rows = skip(rows["backend"] == "published", "published row (imported measurements are not fitted yet: each needs a fit of what it measured)")
        rows = skip(rows["backend"] != "cuda", "unknown backend")
        rows = skip(rows["gpu_slug"] != gpu, "measured on another GPU")
    return rows


def _merge_ranks(rows: pd.DataFrame) -> pd.DataFrame:
    """One point per multi-process configuration and file, by profiler.record's rule (the slowest
    rank's step time, the largest of each memory quantity)."""
    world = pd.to_numeric(rows["world_size"], errors="coerce").fillna(1)
    single, multi = rows[world <= 1], rows[world > 1]
    if multi.empty:
        return rows
    merged = record.merge_ranks(multi.to_dict("records"), key=("source_file", "id"))
    frame = pd.DataFrame(merged).fillna("").astype(str).replace("None", "")
    return pd.concat([single, frame], ignore_index=True)


def _features(w: Workload, gpu_slug: str, row, cpu_trace: bool = False) -> dict:
    """The estimator's uncalibrated predictions and the components the factor models use
    (`cpu_trace`: of a CPU trace, which takes no cuBLAS workspace)."""
    est = estimate(w, gpu_slug, "none", cpu_trace=cpu_trace)
    m, t, gpu, parts = est.raw_memory, est.time, est.gpu, est.components
    p = count_params(w.model)
    persistent, first, second = working_sets(parts)   # as estimator.memory.assemble adds them up
    out = {
        "group": w.model.fingerprint, "model": w.model.name, "family": w.model.model_type,
        "attn": w.attn, "method": w.method, "training": w.training, "params_total": float(p.total),
        "params_active": float(p.active), "tokens": float(w.batch * w.seq), "world_size": w.world_size,
        "grad_accum": w.grad_accum, "new_tokens": w.new_tokens, "batch": w.batch, "seq": w.seq,
        "source_file": row["source_file"], "started_at": row.get("started_at", ""),
        "device_used_source": str(row.get("device_used_source", "") or ""),
        "raw_peak_allocated_bytes": float(m.peak_allocated_bytes),
        "raw_peak_reserved_bytes": float(m.peak_reserved_bytes),
        "raw_device_used_bytes": float(m.device_used_bytes),
        "raw_context_bytes": float(m.cuda_context_bytes), "raw_step_s": t.step_s,
        "acts": float(scaled_activations(parts)), "logits": float(parts.logits_and_loss),
        "temps": float(parts.optimizer_temporaries), "paged": float(m.paged_optimizer_bytes),
        "persistent": float(persistent), "fwd": float(first), "step": float(second),
        "peak_flops": peak_flops(gpu, w), "exposed_comm_s": t.exposed_comm_s,
        "optimizer_s": t.optimizer_s, "clip_s": t.clip_s,
        "clipped": bool(w.training and steps.clipped(row)),
        "decode_floor_s": 0.0 if w.training else decode_floor_seconds(w), "decode_extra_s": 0.0,
        "decode_attention_s": 0.0, "decode_slowdown": 1.0, "decode_layers": 0.0,
        "decode_default_fraction": 0.0,
        "bandwidth": float(gpu.memory_bandwidth_bytes_per_s),
        "decode_bytes": 0.0,
    }
    # compute = work / (peak x HFU) + fixed (estimator.compute_time.hfu_terms): the fit inverts it
    work, fixed = hfu_terms(w, gpu)
    if w.training:
        out.update(hw_flops=w.grad_accum * work, compute_fixed_s=w.grad_accum * fixed, prefill_flops=0.0,
                   launch_ops=w.grad_accum * launch_floor_seconds(w, host_s_per_op=1.0))
    else:
        out.update(hw_flops=0.0, compute_fixed_s=fixed, prefill_flops=work, launch_ops=0.0)
    if not w.training and w.new_tokens:
        d = decode_parts(w, gpu, m, w.seq + w.new_tokens // 2)
        out.update(decode_bytes=float(d.moved_bytes), decode_floor_s=d.floor_s, decode_extra_s=d.extra_s,
                   decode_attention_s=d.attention_s, decode_slowdown=d.slowdown,
                   decode_layers=0.0 if w.compiled else float(math.ceil(w.model.num_layers / w.pp)),
                   decode_default_fraction=float(est.corrections["decode_bandwidth_fraction"]["value"]))
    out.update(_reduction_features(w, gpu))
    for q in _MEASURED:
        out[f"m_{q}"] = _num(row.get(q, ""))
    if not w.training and w.new_tokens == 0 and math.isnan(out["m_prefill_s"]):
        out["m_prefill_s"] = out["m_step_s"]  # a prompt-only run is all prefill
    for lib in VERSION_COLUMNS:
        out[lib] = str(row.get(lib, "") or "")
    return out


def _reduction_features(w: Workload, gpu) -> dict:
    """One gradient reduction of `w` as estimator.timing.communication costs it at the links' full
    bandwidth: `reduce_bw_s` (its bytes over the link) and `reduce_lat_s` (its hops), the share
    `reduce_keep` that can hide in the backward (the rest is its tail), and `backward_share` (the
    window: that share of a micro-batch). With a fraction f of the bandwidth the reduction takes
    reduce_bw_s / f + reduce_lat_s; two evaluations give both terms."""
    if not w.training or w.dp == 1:
        return {"reduce_bw_s": 0.0, "reduce_lat_s": 0.0, "reduce_keep": 0.0, "backward_share": 0.0,
                "gathers_s": 0.0}
    full = communication(w, gpu, DEFAULT_INTER_NODE)
    half = communication(w, gpu, DEFAULT_INTER_NODE, link_fraction=0.5)
    one, one_half = full.reduce_s + full.reduce_tail_s, half.reduce_s + half.reduce_tail_s
    return {"reduce_bw_s": one_half - one, "reduce_lat_s": 2.0 * one - one_half,
            "reduce_keep": full.reduce_s / one if one > 0 else 0.0, "backward_share": backward_share(w),
            # the rest of the step's traffic (FSDP's and ZeRO-3's gathers, ZeRO's weight all-gather)
            "gathers_s": max(0.0, full.total_s - full.reduces * one)}


def build_dataset(rows: pd.DataFrame, gpu: str, files: list | None = None) -> Dataset:
    """Select the rows of `gpu`, rebuild their Workloads and attach the raw predictions."""
    if gpu != TRACE_GPU:
        tables.gpu(gpu)  # unknown slugs fail here with the estimator's message
    skipped: dict = {}
    if rows.attrs.get("duplicates"):
        skipped["duplicate of a row in another file"] = rows.attrs["duplicates"]
    if rows.empty:
        return Dataset(gpu, pd.DataFrame(), [], list(files or []), skipped)
    rows = rows.copy()
    for col in ("source_file", "_csv_dir"):
        if col not in rows:
            rows[col] = "<memory>" if col == "source_file" else ""
    rows = _merge_ranks(_select(rows, gpu, skipped))
    slug = TRACE_PREDICTION_GPU if gpu == TRACE_GPU else gpu
    records, workloads, used = [], [], {}
    for _, row in rows.iterrows():
        try:
            w = workload_from_row(row)
            feats = _features(w, slug, row, cpu_trace=gpu == TRACE_GPU)
        except (InputError, ValueError) as exc:
            reason = f"cannot rebuild the workload: {str(exc)[:80]}"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        if not any(not math.isnan(feats[f"m_{q}"]) for q in QUANTITIES):
            skipped["no quantity measured"] = skipped.get("no quantity measured", 0) + 1
            continue
        records.append(feats)
        workloads.append(w)
        used[feats["source_file"]] = used.get(feats["source_file"], 0) + 1
    files = [SourceFile(f.path, f.sha256, f.rows, used.get(f.path, 0), f.first, f.last) for f in (files or [])]
    return Dataset(gpu, pd.DataFrame.from_records(records), workloads, files, skipped)


def load(paths, gpu: str) -> Dataset:
    """Read measurement files (or folders of them) and build the Dataset of `gpu`."""
    rows, files = read_rows(paths)
    return build_dataset(rows, gpu, files)


def committed_files(gpu: str, measurements_dir: Path | None = None) -> list[Path]:
    """The committed measurement files of `gpu`: calibrations/measurements/<gpu>/*.csv."""
    folder = Path(measurements_dir or MEASUREMENTS_DIR) / gpu
    return sorted(folder.glob("*.csv")) if folder.is_dir() else []
