"""`profile`: profile real steps of LLM configurations, compare them with the estimator, refresh calibration.

Examples:
  python scripts/profile.py                                   # default sweep on this GPU (no GPU: traced)
  python scripts/profile.py profiler/sweeps/cpu-tiny.yaml --backend cpu
  python scripts/profile.py my-sweep.yaml --run runs/a100-run1          # resume: finished configs are skipped
  python scripts/profile.py --model llama-3.2-1b --method lora --batch 4 --seq 2048 --grad-ckpt
  python scripts/profile.py --model llama-3.1-8b --method qlora --max-batch --max-seq

This script parses flags (the workload flags are estimator/flags.py's, shared with estimate.py)
and runs one profiler/session.py session: plan, sweep or searches, compare, refresh.
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
import sys

from estimator import flags
from estimator.errors import InputError
from profiler import executors, session

PROG = "profile.py"


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = flags.OneLineParser(prog=prog, description="Measure LLM configurations on this machine and compare with the estimator.")
    p.add_argument("sweep", nargs="?", help="sweep file (.yaml/.json); default: profiler/sweeps/default.yaml "
                                            "(traced on the CPU without a GPU); profiler/sweeps/cpu-tiny.yaml with --backend cpu")
    p.add_argument("--run", help="run folder (resume: finished configurations are skipped); "
                                 "default runs/<gpu-or-cpu>-<UTC time>")
    p.add_argument("--force", action="store_true", help="run finished configurations again (rows replaced)")
    p.add_argument("--retry-errors", action="store_true", help="run configurations that ended in error again")
    p.add_argument("--max-batch", action="store_true", help="search the largest micro-batch that fits")
    p.add_argument("--max-seq", action="store_true", help="search the longest sequence that fits")
    p.add_argument("--timeout", type=flags.bounded("timeout_s"), help="seconds per configuration (default: the sweep's, else 600)")
    p.add_argument("--backend", choices=["auto", "cuda", "cpu", "trace"], default="auto")
    p.add_argument("--gpu", help="GPU slug of estimator/data/gpus.csv (default: matched to the device)")
    p.add_argument("--calibration", default="auto", help="auto, none, or a calibration table path (for compare)")
    p.add_argument("--no-refresh", action="store_true",
                   help="compare with the calibration fit but do not write calibrations/<gpu>.json")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    p.add_argument("--limit", type=flags.bounded("limit", integer=True), help="run at most N configurations (or searches) this time")
    p.add_argument("--format", choices=["csv", "parquet"], help="results file format (default csv; parquet needs pyarrow)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--parallel", type=flags.bounded("parallel", integer=True), default=1,
                   help="GPUs to use at once: one single-GPU configuration per GPU, each child pinned by "
                        "CUDA_VISIBLE_DEVICES; a multi-GPU configuration takes the GPUs it needs (default 1)")
    p.add_argument("--executor", default="local",
                   help="local (this machine; default) or submitit (one SLURM job per configuration)")
    p.add_argument("--slurm-partition", help="with --executor submitit: the SLURM partition")
    p.add_argument("--slurm-time-min", type=flags.bounded("slurm_time_min", integer=True), default=60,
                   help="with --executor submitit: minutes a job may run (default 60)")
    p.add_argument("--submitit-cluster", choices=["slurm", "local"],
                   help="with --executor submitit: force the cluster (default: slurm where sbatch exists; "
                        "local runs the jobs as subprocesses here)")
    case = p.add_argument_group("a single configuration instead of a sweep (the workload flags of estimate.py)")
    flags.add_workload_flags(case, help={
        "gpus": "GPUs per node (default 1); with a sweep: the GPUs a configuration may use (cases needing more are dropped)"})
    case.add_argument("--warmup", type=flags.bounded("warmup", integer=True, low=0, low_open=False), default=2, help="untimed warm-up steps (default 2)")
    case.add_argument("--steps", type=flags.bounded("steps", integer=True), default=5, help="timed steps (default 5)")
    return p


def _request(args, argv: list[str], prog: str = PROG) -> session.Request:
    """The session the flags ask for (workload flags other than --gpus need --model)."""
    given = flags.given(args)
    if "model" not in given and set(given) - {"gpus"}:
        named = ", ".join(flags.BY_FIELD[name].option for name in given if name != "gpus")
        raise InputError(f"{named}: workload flags describe one configuration; give --model too "
                         "(or put them in a sweep file)")
    return session.Request(
        sweep=args.sweep, case=given if "model" in given else None, warmup=args.warmup, steps=args.steps,
        run_dir=args.run, force=args.force, retry_errors=args.retry_errors,
        search=tuple(name for name, on in (("batch", args.max_batch), ("seq", args.max_seq)) if on),
        gpus=given.get("gpus", 1), timeout_s=args.timeout, backend=args.backend, gpu=args.gpu,
        calibration=args.calibration, refresh=not args.no_refresh, limit=args.limit,
        results_format=args.format, progress=not args.no_progress, command=(prog, *argv),
        parallel=args.parallel, executor=args.executor,
        cluster=executors.ClusterOptions(cluster=args.submitit_cluster, partition=args.slurm_partition,
                                         time_min=args.slurm_time_min))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["import"]:                 # profile.py import FILE: profiler/imports.py
        from profiler import imports

        return imports.main(argv[1:], prog=f"{prog} import")
    args = _parser(prog).parse_args(argv)
    try:
        outcome = session.run(_request(args, argv, prog))
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished configurations are saved (rerun with --run to resume)",
              file=sys.stderr)
        return 130
    flags.print_stdout(json.dumps(outcome.summary, indent=2) if args.json else outcome.text)
    return outcome.exit_code

