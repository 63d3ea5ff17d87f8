#!/usr/bin/env python3
"""Profile real steps of LLM configurations, compare them with the estimator, refresh calibration.

Examples:
  python scripts/profile.py                                   # default sweep on this GPU (CPU: tiny sweep)
  python scripts/profile.py profiler/sweeps/cpu-tiny.yaml --backend cpu
  python scripts/profile.py my-sweep.yaml --run runs/a100-run1          # resume: finished configs are skipped
  python scripts/profile.py --model llama-3.2-1b --method lora --batch 4 --seq 2048 --grad-ckpt
  python scripts/profile.py --model llama-3.1-8b --method qlora --max-batch --max-seq

Each configuration runs in its own process (profiler/runner.py); rows go atomically to
<run>/results.csv (profiler/store.py); then predicted vs measured goes to <run>/compare.* and
<run>/parity.png (profiler/compare.py). Without a CUDA GPU the default sweep is traced
on the CPU instead (fake tensors: traced peak_allocated_bytes against the estimator).

Exit codes: 0 done (oom and error rows are results); 1 every configuration run this time ended in
an error (e.g. the child cannot start); 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import sys
from pathlib import Path

# This file's folder would shadow the standard library's `profile` (imported by cProfile, which
# torch._dynamo imports): replace it on the path by the repository root.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from estimator.errors import InputError  # noqa: E402
from estimator.report import OneLineParser  # noqa: E402
from profiler import runner as runner_mod  # noqa: E402
from profiler import sweep as sweep_mod  # noqa: E402
from profiler.case import Case  # noqa: E402
from profiler.env import package_version  # noqa: E402

PROG = "profile.py"
DEFAULT_TIMEOUT_S = 600.0
_PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "pandas", "nvidia-ml-py")
# ad-hoc case flags -> Workload fields (only flags given on the command line become settings)
_CASE_FLAGS = ("method", "precision", "optimizer", "adamw_impl", "batch", "seq", "new_tokens", "grad_accum",
               "lora_rank", "lora_targets", "quant", "attn", "zero", "offload")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="profile.py", description="Measure LLM configurations on this machine and compare with the estimator.")
    p.add_argument("sweep", nargs="?", help="sweep file (.yaml/.json); default: profiler/sweeps/default.yaml "
                                            "(traced on the CPU without a GPU); profiler/sweeps/cpu-tiny.yaml with --backend cpu")
    p.add_argument("--run", help="run folder (resume: finished configurations are skipped); "
                                 "default runs/<gpu-or-cpu>-<UTC time>")
    p.add_argument("--force", action="store_true", help="run finished configurations again (rows replaced)")
    p.add_argument("--retry-errors", action="store_true", help="run configurations that ended in error again")
    p.add_argument("--max-batch", action="store_true", help="search the largest micro-batch that fits")
    p.add_argument("--max-seq", action="store_true", help="search the longest sequence that fits")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs a configuration may use (ad-hoc case: its GPU count; sweep: cases needing more are dropped)")
    p.add_argument("--timeout", type=float, help="seconds per configuration (default: the sweep's, else 600)")
    p.add_argument("--backend", choices=["auto", "cuda", "cpu", "trace"], default="auto")
    p.add_argument("--gpu", help="GPU slug of estimator/data/gpus.csv (default: matched to the device)")
    p.add_argument("--calibration", default="auto", help="auto, none, or a calibration table path (for compare)")
    p.add_argument("--no-refresh", action="store_true",
                   help="compare with the calibration fit but do not write calibrations/<gpu>.json")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    p.add_argument("--limit", type=int, help="run at most N configurations (or searches) this time")
    p.add_argument("--format", choices=["csv", "parquet"], help="results file format (default csv; parquet needs pyarrow)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    case = p.add_argument_group("a single configuration instead of a sweep")
    case.add_argument("--model", help="config.json path, catalog name or Hub id")
    case.add_argument("--method", choices=["full", "lora", "qlora", "inference"])
    case.add_argument("--precision", choices=["fp32", "fp16", "bf16", "amp-fp16", "amp-bf16"])
    case.add_argument("--optimizer", choices=["adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "sgd", "adafactor"])
    case.add_argument("--adamw-impl", choices=["fused", "foreach", "single"])
    case.add_argument("--batch", type=int)
    case.add_argument("--seq", type=int)
    case.add_argument("--new-tokens", type=int)
    case.add_argument("--grad-accum", type=int)
    case.add_argument("--lora-rank", type=int)
    case.add_argument("--lora-targets", help="comma list of roles, or all-linear")
    case.add_argument("--quant", choices=["none", "int8", "nf4", "fp4"])
    case.add_argument("--no-double-quant", action="store_true")
    case.add_argument("--grad-ckpt", action="store_true")
    case.add_argument("--attn", choices=["eager", "sdpa", "flash"])
    case.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    case.add_argument("--offload", choices=["none", "optimizer", "optimizer+params"])
    case.add_argument("--warmup", type=int, default=2)
    case.add_argument("--steps", type=int, default=5)
    return p


# ---- inputs -------------------------------------------------------------------------------------

def _check_args(args) -> None:
    if args.sweep and args.model:
        raise InputError("give a sweep file or --model, not both")
    for name in ("gpus", "limit"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InputError(f"--{name} must be a positive integer; got {value}")
    if args.timeout is not None and args.timeout <= 0:
        raise InputError(f"--timeout must be positive seconds; got {args.timeout:g}")
    if args.gpu:
        from estimator import tables
        tables.gpu(args.gpu)  # unknown slug: InputError
    if args.calibration not in ("auto", "none") and not Path(args.calibration).is_file():
        raise InputError(f"calibration file not found: {args.calibration}")


def _adhoc_sweep(args) -> sweep_mod.Sweep:
    """The single configuration of the --model flags, as a one-entry sweep."""
    entry = {"model": args.model}
    entry.update({k: getattr(args, k) for k in _CASE_FLAGS if getattr(args, k) is not None})
    if args.grad_ckpt:
        entry["grad_ckpt"] = True
    if args.no_double_quant:
        entry["double_quant"] = False
    if args.gpus > 1:
        entry["gpus"] = args.gpus
    entry.update(warmup=args.warmup, steps=args.steps)
    return sweep_mod.Sweep(grid=(entry,), name="adhoc", path=None)


def _expand_adhoc(sweep: sweep_mod.Sweep) -> sweep_mod.Expansion:
    """Expand the ad-hoc sweep; an invalid configuration is bad input here, not a dropped case."""
    expansion = sweep_mod.expand(sweep)
    if not expansion.cases:
        raise InputError(expansion.dropped[0][1].removeprefix("invalid: "))
    return expansion


def _sweep_dict(sweep: sweep_mod.Sweep) -> dict:
    return {"name": sweep.name, "grid": [dict(e) for e in sweep.grid]}


# ---- the device -----------------------------------------------------------------------------------

def _resolve_backend(args, explicit_sweep: bool) -> tuple[str, runner_mod.GpuInfo | None, str]:
    """(backend, GPU info or None, a note for the user or ''). Probes CUDA only for auto/cuda."""
    if args.backend in ("cpu", "trace"):
        return args.backend, None, ""
    gpu = runner_mod.detect_gpu()
    if gpu is not None:
        return "cuda", gpu, ""
    if args.backend == "cuda":
        raise InputError("--backend cuda: no CUDA GPU found (torch.cuda.is_available() is False)")
    if explicit_sweep:
        return "trace", None, ("no CUDA GPU found: tracing on the CPU instead (fake tensors: traced "
                               "peak_allocated_bytes; no time, reserved or device memory)")
    return "trace", None, (f"no CUDA GPU found: tracing the default sweep "
                           f"{sweep_mod.DEFAULT_SWEEP.relative_to(sweep_mod.ROOT)} on the CPU instead "
                           "(fake tensors: traced peak_allocated_bytes against the estimator)")


def _gpu_slug(args, gpu: runner_mod.GpuInfo | None) -> str | None:
    if args.gpu:
        return args.gpu
    return runner_mod.match_gpu_slug(gpu.name, gpu.memory_bytes) if gpu else None


# ---- run folder -----------------------------------------------------------------------------------

def _versions() -> dict:
    """Installed versions of the packages a run depends on (None: not installed)."""
    return {name: package_version(name) or None for name in _PACKAGES}


def _invocation(argv, mode, backend, gpu, slug, sweep_copy, sweep) -> dict:
    from profiler.store import utc_now

    return {"command": shlex.join([PROG, *argv]), "argv": list(argv), "started_at": utc_now(),
            "cwd": os.getcwd(), "mode": mode, "backend": backend,
            "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "count": gpu.count,
                    "slug": slug} if gpu else {"slug": slug},
            "sweep": sweep_copy, "sweep_source": str(sweep.path) if sweep.path else None,
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "hostname": socket.gethostname(), "packages": _versions()}}


def _open_store(args, slug: str | None, backend: str, sweep: sweep_mod.Sweep):
    from profiler.store import RunStore, default_run_dir

    run_dir = Path(args.run) if args.run else default_run_dir(slug or backend)
    store = RunStore(run_dir, args.format)
    if sweep.path:
        copy = store.keep_sweep_copy(sweep.path)
    else:
        copy = store.keep_sweep_copy(text=json.dumps(_sweep_dict(sweep), indent=2) + "\n", suffix=".json")
    return store, copy


# ---- the work -------------------------------------------------------------------------------------

def _searches(args, cases: list[Case], runner, store) -> list[dict]:
    """Max-batch / max-seq searches, one per distinct base configuration; writes max_batch.json."""
    from profiler.search import SEQ_START, max_value

    fields = [f for f, on in (("batch", args.max_batch), ("seq", args.max_seq)) if on]
    todo, seen = [], set()
    for case in cases:
        for name in fields:
            key = (case.with_(**{name: 1 if name == "batch" else SEQ_START}).id, name)
            if key not in seen:
                seen.add(key)
                todo.append((case, name))
    todo = todo[:args.limit] if args.limit else todo
    bar = runner_mod.progress_bar(len(todo), not args.no_progress, desc="searching")
    results = []

    def on_probe(trial: Case, status: str) -> None:
        if not args.no_progress:
            bar.write(f"{status:<7} {runner_mod.short_id(trial.id)}", file=sys.stderr)

    try:
        for case, name in todo:
            boundary = max_value(case, name, runner, store, force=args.force, on_probe=on_probe)
            results.append(boundary.to_dict())
            print(boundary.line(), file=sys.stderr)
            bar.update(1)
    finally:
        bar.close()
    _merge_boundaries(store, results)
    return results


def _merge_boundaries(store, results: list[dict]) -> None:
    """max_batch.json keeps every search of the run; a repeated search replaces its entry."""
    path = store.run_dir / "max_batch.json"
    old = json.loads(path.read_text()) if path.exists() else []
    fresh = {(r["id"], r["field"]) for r in results}
    store.write_json("max_batch.json", [r for r in old if (r["id"], r["field"]) not in fresh] + results)


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


def _plan(args):
    """(sweep, expansion, backend, GPU info, GPU slug): what to run, where, after the filters.
    A given sweep file or --model is read before CUDA is probed, so bad input fails fast."""
    sweep = expansion = None
    if args.model:
        sweep = _adhoc_sweep(args)
        expansion = _expand_adhoc(sweep)
    elif args.sweep:
        sweep = sweep_mod.load_sweep(args.sweep)
        expansion = sweep_mod.expand(sweep)
    backend, gpu, note = _resolve_backend(args, explicit_sweep=sweep is not None)
    if note:
        print(note, file=sys.stderr)
    if sweep is None:
        sweep = sweep_mod.load_sweep(sweep_mod.DEFAULT_SWEEP if backend in ("cuda", "trace") else sweep_mod.CPU_SWEEP)
        expansion = sweep_mod.expand(sweep)
    slug = _gpu_slug(args, gpu)
    if gpu and not slug:
        print(f"GPU '{gpu.name}' matches no row of estimator/data/gpus.csv: pass --gpu SLUG to compare "
              "and filter by prediction", file=sys.stderr)
    expansion = sweep_mod.keep_if(expansion, sweep_mod.gpu_count_test(args.gpus))
    if backend == "cuda" and slug and sweep.skip_predicted_over and not (args.max_batch or args.max_seq):
        expansion = sweep_mod.keep_if(expansion, sweep_mod.predicted_fit_test(
            slug, sweep.skip_predicted_over, args.calibration))
    print(f"sweep {sweep.name}: " + "\n".join(expansion.summary_lines()), file=sys.stderr)
    return sweep, expansion, backend, gpu, slug


def _work(args, cases: list[Case], runner, store) -> tuple[dict, list[str]]:
    """Run the sweep or the searches: (summary entries, statuses of every child run now)."""
    if args.max_batch or args.max_seq:
        searches = _searches(args, cases, runner, store)
        return {"searches": searches}, [p["status"] for s in searches for p in s["probes"]]
    outcome = runner_mod.run_sweep(cases, runner, store, force=args.force, retry_errors=args.retry_errors,
                                   limit=args.limit, progress=not args.no_progress)
    print(outcome.line(), file=sys.stderr)
    return ({"ran": outcome.ran, "already_finished": outcome.already_done, "statuses": dict(outcome.statuses)},
            list(outcome.statuses.elements()))


def _run(args, argv) -> int:
    _check_args(args)
    sweep, expansion, backend, gpu, slug = _plan(args)
    store, sweep_copy = _open_store(args, slug, backend, sweep)
    mode = "search" if (args.max_batch or args.max_seq) else "sweep"
    index = store.log_invocation(_invocation(argv, mode, backend, gpu, slug, sweep_copy, sweep))
    print(f"run folder: {store.run_dir}", file=sys.stderr)
    runner = runner_mod.Runner(backend=backend, timeout_s=args.timeout or sweep.timeout_s or DEFAULT_TIMEOUT_S,
                               log_dir=store.run_dir / "logs", gpu_slug=slug)
    summary = {"run_dir": str(store.run_dir), "backend": backend, "gpu": slug, "sweep": sweep.name,
               "configurations": len(expansion.cases), "dropped": dict(expansion.reasons())}
    done, statuses = _work(args, expansion.cases, runner, store)
    summary.update(done)

    from profiler.compare import write_comparison

    comparison = write_comparison(store.rows(), store.run_dir, gpu=args.gpu, calibration=args.calibration)
    refresh_line = refresh_calibration(store.path, slug, args.no_refresh)
    print(refresh_line, file=sys.stderr)
    store.finish_invocation(index, finished_at=_now(), summary={**summary, "refresh": refresh_line})
    summary.update(compare=comparison["quantities"], refresh=refresh_line)
    _print(json.dumps(summary, indent=2) if args.json else comparison["text"])
    return 1 if statuses and all(s == "error" for s in statuses) else 0


def _now() -> str:
    from profiler.store import utc_now
    return utc_now()


def _print(text: str) -> None:
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        return _run(args, argv)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; finished configurations are saved (rerun with --run to resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
