"""One profiling session, as scripts/profile.py runs it: plan, measure, compare, refresh.

1. `plan`: what to run (a sweep file, one ad-hoc configuration, or the default sweep of the
   backend), where (backend, GPU, GPU slug), after the filters (GPU count, predicted fit). A
   given sweep file or configuration is read before CUDA is probed, so bad input fails fast.
2. `open_store` + `invocation`: the run folder, the copy of the sweep, the run.json entry.
3. `work`: the sweep (profiler.runner.run_sweep) or the max-batch / max-seq searches (one per
   distinct base configuration; `merge_boundaries` keeps every search of the run in max_batch.json).
4. Predicted against measured (profiler.compare), then `refresh_calibration` (fitting.refresh).

`run(request)` does all of it and returns an `Outcome` (the summary `--json` prints, the
comparison table, the exit code). Every function takes explicit parameters; lines for the user
go to `log` (stderr by default). Bad input raises InputError before any run folder is made.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from estimator import calibration, tables
from estimator.calibration import TRACE_PREDICTION_GPU
from estimator.errors import InputError
from estimator.files import utc_now
from estimator.limits import check_count, check_number
from estimator.versions import RUN_PACKAGES, library_versions
from profiler import executors
from profiler import runner as runner_mod
from profiler import sweep as sweep_mod
from profiler.case import Case
from profiler.compare import write_comparison
from profiler.env import match_gpu_slug
from profiler.search import SEQ_START, max_value
from profiler.store import RunStore, default_run_dir
from profiler.zero import prepare_ops

DEFAULT_TIMEOUT_S = 600.0
SEARCH_FIELDS = ("batch", "seq")

Log = Callable[[str], None]


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr)


@dataclass(frozen=True)
class Request:
    """What to profile and how. `case` is one ad-hoc configuration instead of a sweep: Workload
    keyword arguments with `model` as the reference string (estimator.flags.given)."""

    sweep: str | None = None
    case: dict | None = None
    warmup: int = 2
    steps: int = 5
    run_dir: str | None = None
    force: bool = False
    retry_errors: bool = False
    search: tuple[str, ...] = ()          # "batch" and/or "seq": max-batch / max-seq searches
    gpus: int = 1                         # GPUs a configuration may use
    timeout_s: float | None = None        # None: the sweep's, else DEFAULT_TIMEOUT_S
    backend: str = "auto"                 # auto, cuda, cpu, trace
    gpu: str | None = None                # GPU slug; None: matched to the device
    calibration: str = "auto"
    refresh: bool = True
    limit: int | None = None
    results_format: str | None = None     # csv (default) or parquet
    progress: bool = True
    command: tuple[str, ...] = ("profile.py",)  # program and arguments, for run.json
    parallel: int = 1                     # GPUs used at once (runner.run_parallel)
    executor: str = "local"               # local or submitit (profiler.executors)
    cluster: executors.ClusterOptions = field(default_factory=executors.ClusterOptions)


@dataclass
class Plan:
    """The configurations to run and where."""

    sweep: sweep_mod.Sweep
    expansion: sweep_mod.Expansion
    backend: str
    gpu: runner_mod.GpuInfo | None
    slug: str | None

    @property
    def cases(self) -> list[Case]:
        return self.expansion.cases


@dataclass
class Outcome:
    """What a session did: `summary` (printed by --json), `text` (the comparison table) and the
    statuses of every child run this time."""

    summary: dict
    text: str
    statuses: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when every configuration run this time ended in an error, else 0."""
        return 1 if self.statuses and all(s == "error" for s in self.statuses) else 0


# ---- inputs ---------------------------------------------------------------------------------------

def check(request: Request) -> None:
    """Refuse bad input with one line (InputError)."""
    if request.sweep and request.case:
        raise InputError("give a sweep file or --model, not both")
    for name in ("gpus", "limit"):
        value = getattr(request, name)
        if value is not None:
            check_count(name, value, f"--{name}")
    if request.timeout_s is not None:
        check_number("timeout_s", request.timeout_s, "--timeout")
    unknown = set(request.search) - set(SEARCH_FIELDS)
    if unknown:
        raise InputError(f"cannot search {', '.join(sorted(unknown))}; only {', '.join(SEARCH_FIELDS)}")
    if request.gpu:
        tables.gpu(request.gpu)  # unknown slug: InputError
    check_count("parallel", request.parallel, "--parallel")
    executors.check_executor(request.executor)
    if request.search and (request.parallel > 1 or request.executor != "local"):
        raise InputError("--max-batch/--max-seq probe one configuration at a time: run them without "
                         "--parallel and --executor")
    if request.parallel > 1 and request.executor != "local":
        raise InputError("--parallel places configurations on this machine's GPUs; with --executor "
                         "submitit the cluster places them")
    if request.calibration not in ("auto", "none") and not Path(request.calibration).is_file():
        raise InputError(f"calibration file not found: {request.calibration}")


def adhoc_sweep(case: dict, warmup: int, steps: int) -> sweep_mod.Sweep:
    """One configuration (Workload keyword arguments, `model` the reference) as a one-entry sweep."""
    entry = {**case, "warmup": warmup, "steps": steps}
    return sweep_mod.Sweep(grid=(entry,), name="adhoc", path=None)


def expand_adhoc(sweep: sweep_mod.Sweep) -> sweep_mod.Expansion:
    """Expand the ad-hoc sweep; an invalid configuration is bad input here, not a dropped case."""
    expansion = sweep_mod.expand(sweep)
    if not expansion.cases:
        raise InputError(expansion.dropped[0][1].removeprefix("invalid: "))
    return expansion


def sweep_dict(sweep: sweep_mod.Sweep) -> dict:
    return {"name": sweep.name, "grid": [dict(e) for e in sweep.grid]}


# ---- the device -----------------------------------------------------------------------------------

def resolve_backend(backend: str, explicit_sweep: bool) -> tuple[str, runner_mod.GpuInfo | None, str]:
    """(backend, GPU info or None, a note for the user or ''). Probes CUDA only for auto/cuda."""
    if backend in ("cpu", "trace"):
        return backend, None, ""
    gpu = runner_mod.detect_gpu()
    if gpu is not None:  # cuda-only
        return "cuda", gpu, ""
    if backend == "cuda":
        raise InputError("--backend cuda: no CUDA GPU found (torch.cuda.is_available() is False)")
    if explicit_sweep:
        return "trace", None, ("no CUDA GPU found: tracing on the CPU instead (fake tensors: traced "
                               "peak_allocated_bytes; no time, reserved or device memory)")
    return "trace", None, (f"no CUDA GPU found: tracing the default sweep "
                           f"{sweep_mod.DEFAULT_SWEEP.relative_to(sweep_mod.ROOT)} on the CPU instead "
                           "(fake tensors: traced peak_allocated_bytes against the estimator)")


def gpu_slug(given: str | None, gpu: runner_mod.GpuInfo | None) -> str | None:
    if given:
        return given
    return match_gpu_slug(gpu.name, gpu.memory_bytes) if gpu else None


def plan(request: Request, log: Log = stderr_line) -> Plan:
    """What to run, where, after the filters (a filtered-out ad-hoc configuration is bad input)."""
    sweep = expansion = None
    if request.case:
        sweep = adhoc_sweep(request.case, request.warmup, request.steps)
        expansion = expand_adhoc(sweep)
    elif request.sweep:
        sweep = sweep_mod.load_sweep(request.sweep)
        expansion = sweep_mod.expand(sweep)
    backend, gpu, note = resolve_backend(request.backend, explicit_sweep=sweep is not None)
    if note:
        log(note)
    if sweep is None:
        sweep = sweep_mod.load_sweep(sweep_mod.DEFAULT_SWEEP if backend in ("cuda", "trace") else sweep_mod.CPU_SWEEP)
        expansion = sweep_mod.expand(sweep)
    slug = gpu_slug(request.gpu, gpu)
    if gpu and not slug:
        log(f"GPU '{gpu.name}' matches no row of estimator/data/gpus.csv: pass --gpu SLUG to compare "
            "and filter by prediction")
    expansion = sweep_mod.keep_if(expansion, sweep_mod.gpu_count_test(request.gpus))
    if backend == "cuda" and slug and sweep.skip_predicted_over and not request.search:
        expansion = sweep_mod.keep_if(expansion, sweep_mod.predicted_fit_test(
            slug, sweep.skip_predicted_over, request.calibration))
    if request.case and not expansion.cases:
        raise InputError(expansion.dropped[-1][1])
    log(f"sweep {sweep.name}: " + "\n".join(expansion.summary_lines()))
    return Plan(sweep, expansion, backend, gpu, slug)


# ---- run folder -----------------------------------------------------------------------------------

def versions() -> dict:
    """Installed versions of the packages a run depends on (None: not installed)."""
    return library_versions(RUN_PACKAGES)


def invocation(command: tuple[str, ...], mode: str, the_plan: Plan, sweep_copy: str) -> dict:
    """The run.json entry of this invocation (finished_at and summary are added at the end)."""
    gpu, slug, sweep = the_plan.gpu, the_plan.slug, the_plan.sweep
    return {"command": shlex.join(command), "argv": list(command[1:]), "started_at": utc_now(),
            "cwd": os.getcwd(), "mode": mode, "backend": the_plan.backend,
            "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "count": gpu.count,
                    "slug": slug} if gpu else {"slug": slug},
            "sweep": sweep_copy, "sweep_source": str(sweep.path) if sweep.path else None,
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "hostname": socket.gethostname(), "packages": versions()}}


def open_store(run_dir: str | None, results_format: str | None, the_plan: Plan):
    """(RunStore, name of the sweep copy kept in the run folder)."""
    store = RunStore(Path(run_dir) if run_dir else default_run_dir(the_plan.slug or the_plan.backend),
                     results_format)
    sweep = the_plan.sweep
    if sweep.path:
        copy = store.keep_sweep_copy(sweep.path)
    else:
        copy = store.keep_sweep_copy(text=json.dumps(sweep_dict(sweep), indent=2) + "\n", suffix=".json")
    return store, copy


# ---- the work -------------------------------------------------------------------------------------

def search_todo(cases: list[Case], names: tuple[str, ...], limit: int | None) -> list[tuple[Case, str]]:
    """(case, field) for every distinct base configuration and searched field, at most `limit`."""
    todo, seen = [], set()
    for case in cases:
        for name in names:
            key = (case.with_(**{name: 1 if name == "batch" else SEQ_START}).id, name)
            if key not in seen:
                seen.add(key)
                todo.append((case, name))
    return todo[:limit] if limit else todo


def searches(todo: list[tuple[Case, str]], runner, store, force: bool = False, progress: bool = True,
             log: Log = stderr_line) -> list[dict]:
    """Run the max-batch / max-seq searches; each boundary goes to max_batch.json."""
    bar = runner_mod.progress_bar(len(todo), progress, desc="searching")
    results = []

    def on_probe(trial: Case, status: str) -> None:
        if progress:
            bar.write(f"{status:<7} {runner_mod.short_id(trial.id)}", file=sys.stderr)

    try:
        for case, name in todo:
            boundary = max_value(case, name, runner, store, force=force, on_probe=on_probe)
            results.append(boundary.to_dict())
            log(boundary.line())
            bar.update(1)
    finally:
        bar.close()
    merge_boundaries(store, results)
    return results


def merge_boundaries(store, results: list[dict]) -> None:
    """max_batch.json keeps every search of the run; a repeated search replaces its entry."""
    path = store.run_dir / "max_batch.json"
    old = json.loads(path.read_text()) if path.exists() else []
    fresh = {(r["id"], r["field"]) for r in results}
    store.write_json("max_batch.json", [r for r in old if (r["id"], r["field"]) not in fresh] + results)


def devices(request: Request, runner) -> list[str] | None:
    """The GPUs a parallel sweep pins its children to (the first --parallel visible ones)."""
    if request.parallel <= 1:
        return None
    gpu = runner_mod.detect_gpu()
    return runner_mod.visible_devices(gpu.count if gpu else 0)[:request.parallel]


def executor_of(request: Request, store):
    """The submitit submission of the sweep's configurations, or None (this machine)."""
    if request.executor != "submitit":
        return None
    folder = store.run_dir / "submitit"
    return lambda todo, runner, record: executors.run_submitit(todo, runner, folder, request.cluster, record)


def work(request: Request, cases: list[Case], runner, store, log: Log = stderr_line) -> tuple[dict, list[str]]:
    """Run the sweep or the searches: (summary entries, statuses of every child run now)."""
    if request.search:
        found = searches(search_todo(cases, request.search, request.limit), runner, store,
                         force=request.force, progress=request.progress, log=log)
        return {"searches": found}, [p["status"] for s in found for p in s["probes"]]
    outcome = runner_mod.run_sweep(cases, runner, store, force=request.force, retry_errors=request.retry_errors,
                                   limit=request.limit, progress=request.progress,
                                   devices=devices(request, runner), executor=executor_of(request, store))
    log(outcome.line())
    return ({"ran": outcome.ran, "already_finished": outcome.already_done, "statuses": dict(outcome.statuses)},
            list(outcome.statuses.elements()))


def refresh_calibration(results_path: Path, gpu_slug: str | None, no_refresh: bool) -> str:
    """HOOK (issue 5, fitting/): refit calibrations/<gpu>.json with this run's measurements and
    return what to tell the user. `fitting.refresh.refresh([results file], gpu, write=...)`
    compares before/after and, unless --no-refresh, writes the table. Skipped without a GPU slug
    (cpu runs, an unmatched GPU without --gpu) or when fitting is not installed; a failure is one
    line, never a traceback after a finished sweep (the rows are already saved)."""
    if not gpu_slug:
        return "calibration refresh: no GPU slug for this run (cpu backend, or pass --gpu); skipped"
    try:
        from fitting.refresh import refresh
    except ImportError:
        return "calibration refresh: fitting is not available (fitting.refresh not found); skipped"
    try:
        result = refresh([Path(results_path)], gpu_slug, write=not no_refresh)
    except Exception as exc:  # noqa: BLE001 - reported, the measurements are safe on disk
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"calibration refresh failed: {type(exc).__name__}: {first}"
    return getattr(result, "text", None) or f"calibration refresh: {result}"


def check_plan(request: Request, the_plan: Plan) -> None:
    """Before anything is written: something is left to run, and every calibration table the run
    reads (--calibration) or would refresh (calibrations/<gpu>.json) is readable and valid."""
    if not the_plan.cases:
        reasons = "; ".join(f"{n} x {why}" for why, n in the_plan.expansion.reasons().most_common(3))
        raise InputError(f"nothing to run: every configuration of sweep {the_plan.sweep.name} was dropped"
                         + (f" ({reasons})" if reasons else ""))
    if request.parallel > 1:
        if the_plan.backend != "cuda":
            raise InputError(f"--parallel {request.parallel} runs configurations on several GPUs: it needs the "
                             f"cuda backend (this run uses {the_plan.backend})")
        have = len(runner_mod.visible_devices(the_plan.gpu.count if the_plan.gpu else 0))
        if request.parallel > have:
            raise InputError(f"--parallel {request.parallel} asks for {request.parallel} GPUs; this machine "
                             f"has {have}")
    slug = the_plan.slug or TRACE_PREDICTION_GPU
    calibration.resolve(request.calibration, slug)      # a corrupt or foreign table: InputError now
    if the_plan.slug and request.refresh:
        from fitting import calibration_table
        calibration_table.read(calibration_table.default_path(the_plan.slug), the_plan.slug)


def run(request: Request, log: Log = stderr_line) -> Outcome:
    """The whole session: plan, run folder, work, compare, refresh. Every input is checked before
    the run folder is made (a refused run leaves the file system as it was)."""
    check(request)
    notes: list[str] = []                   # said once the inputs passed: a refusal is one line
    the_plan = plan(request, notes.append)
    check_plan(request, the_plan)
    store, sweep_copy = open_store(request.run_dir, request.results_format, the_plan)
    for line in notes:
        log(line)
    mode = "search" if request.search else "sweep"
    index = store.log_invocation(invocation(request.command, mode, the_plan, sweep_copy))
    log(f"run folder: {store.run_dir}")
    runner = runner_mod.Runner(backend=the_plan.backend,
                               timeout_s=request.timeout_s or the_plan.sweep.timeout_s or DEFAULT_TIMEOUT_S,
                               log_dir=store.run_dir / "logs", gpu_slug=the_plan.slug)
    summary = {"run_dir": str(store.run_dir), "backend": the_plan.backend, "gpu": the_plan.slug,
               "sweep": the_plan.sweep.name, "configurations": len(the_plan.cases),
               "dropped": dict(the_plan.expansion.reasons())}
    if not os.environ.get(runner_mod.CHILD_ENV):  # DeepSpeed's ops built once, not in each child
        for line in prepare_ops([c.workload() for c in the_plan.cases], the_plan.backend):
            log(line)
    done, statuses = work(request, the_plan.cases, runner, store, log)
    summary.update(done)
    comparison = write_comparison(store.rows(), store.run_dir, gpu=request.gpu, calibration=request.calibration)
    refresh_line = refresh_calibration(store.path, the_plan.slug, not request.refresh)
    log(refresh_line)
    store.finish_invocation(index, finished_at=utc_now(), summary={**summary, "refresh": refresh_line})
    summary.update(compare=comparison["quantities"], refresh=refresh_line)
    return Outcome(summary, comparison["text"], statuses)
