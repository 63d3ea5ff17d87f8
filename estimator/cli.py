"""`estimate`: predict GPU memory, time and cost of a Hugging Face LLM job (no torch import).
Run as `python scripts/estimate.py ...` or `gpu-budget estimate ...` (an installed console command).

Examples:
  python scripts/estimate.py --model llama-3.1-8b --method qlora --batch 4 --seq 4096 --gpu a10g-24gb
  python scripts/estimate.py --model llama-2-70b --method full --zero 3 --fit-gpus
  python scripts/estimate.py --model llama-3.1-8b --method lora --max-batch --gpu a100-80gb
  python scripts/estimate.py --model mistral-7b --method qlora --samples 10000 --epochs 3 --cheapest --deadline-hours 24
  python scripts/estimate.py --chinchilla --gpu a100-80gb --gpus 1 --hours 72
  python scripts/estimate.py --model llama-3.2-1b --method lora --batch 4 --seq 2048 --trace

The workload flags come from estimator/flags.py (shared with profile.py); the answers from
estimator.api and estimator.planner; the tables from estimator/report.py (--json prints the same
object). Bad input prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from estimator import flags, planner, report, tables
from estimator.api import JobSpec, estimate
from estimator.configs import load_config
from estimator.errors import InputError
from estimator.progress import PATIENCE_S, after, quiet_libraries

_QUESTIONS = ("fit_gpus", "max_batch", "max_seq", "cheapest", "chinchilla")


PROG = "estimate.py"


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = flags.OneLineParser(prog=prog, description="Predict GPU memory, time and cost of an LLM job.")
    flags.add_workload_flags(p)
    flags.add_file_flags(p)
    p.add_argument("--gpu", default="h100-80gb", help="GPU slug, e.g. a100-80gb, h100-80gb, rtx4090-24gb")
    p.add_argument("--inter-node", default="ib-hdr", help="inter-node interconnect (interconnects.csv)")
    p.add_argument("--calibration", default="auto", help="auto, none, or a calibration table path")
    p.add_argument("--samples", type=flags.bounded("samples", integer=True), help="training samples per epoch (adds job time and cost)")
    p.add_argument("--epochs", type=flags.bounded("epochs"), help="epochs (default: the files' number, else 1)")
    p.add_argument("--retry-factor", type=flags.bounded("retry_factor", low=1.0, low_open=False), default=1.0, help="multiplies job time (restarts, evals)")
    p.add_argument("--price-table", help="CSV overriding the shipped price table (same columns)")
    p.add_argument("--provider", help="price from this provider only")
    p.add_argument("--price-kind", choices=tables.TIERS,
                   help="price from this tier only (community, secure, serverless, cloud); default: cheapest")
    ask = p.add_mutually_exclusive_group()
    ask.add_argument("--fit-gpus", action="store_true", help="which GPUs fit, and how many are needed")
    ask.add_argument("--max-batch", action="store_true", help="largest micro-batch that fits --gpu")
    ask.add_argument("--max-seq", action="store_true", help="longest sequence that fits --gpu")
    ask.add_argument("--cheapest", action="store_true", help="cheapest setup meeting --deadline-hours")
    ask.add_argument("--chinchilla", action="store_true",
                     help="compute-optimal params/tokens for --gpus x --gpu over --hours")
    p.add_argument("--deadline-hours", type=flags.bounded("deadline_hours"), help="with --cheapest")
    p.add_argument("--hours", type=flags.bounded("hours"), help="with --chinchilla: wall-clock budget")
    p.add_argument("--mfu", type=flags.bounded("mfu"), help="with --chinchilla: achieved fraction (default: table)")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="with --fit-gpus: memory per GPU against capacity; with --max-batch/--max-seq: memory curve")
    p.add_argument("--verbose", action="store_true", help="let the libraries' warnings and log lines through")
    p.add_argument("--trace", action="store_true",
                   help="also trace the real step on fake tensors (needs torch; profiler.trace) and show it beside")
    return p


def _job(args, resolved: flags.Resolved | None = None) -> JobSpec | None:
    if args.samples is None:
        return None
    epochs = args.epochs if args.epochs is not None else (resolved.job or {}).get("epochs", 1.0) if resolved else 1.0
    return JobSpec(args.samples, epochs, args.retry_factor, args.price_table, args.provider, args.price_kind)


def _answer(args) -> report.Result:
    """The question the flags ask, answered by the library and rendered by estimator/report.py."""
    if args.chinchilla:
        given = flags.given(args)
        gpus = given.get("gpus", 1) * given.get("nodes", 1)
        return report.chinchilla(planner.chinchilla(args.gpu, gpus, args.hours, args.mfu))
    resolved = flags.resolve(args)
    w = resolved.workload
    if args.plot and not (args.fit_gpus or args.max_batch or args.max_seq):
        raise InputError("--plot draws the answer of --fit-gpus, --max-batch or --max-seq")
    if args.fit_gpus:
        rows = planner.fit_table(w, args.calibration, args.price_table, args.provider, args.price_kind)
        return _plotted(report.fit_gpus(w, rows), args, lambda plots: plots.fit_gpus(w, rows, args.calibration,
                                                                                   args.plot))
    if args.max_batch or args.max_seq:
        field, search = ("batch", planner.max_batch) if args.max_batch else ("seq", planner.max_seq)
        value = search(w, args.gpu, args.calibration)
        tips = [] if value else planner.advice(estimate(w.with_(**{field: 1}), args.gpu, args.calibration),
                                               args.calibration)
        return _plotted(report.largest(w, args.gpu, field, value, tips), args,
                        lambda plots: plots.largest(w, args.gpu, field, value, args.calibration, args.plot))
    job = _job(args, resolved)
    if args.cheapest:
        if job is None or args.deadline_hours is None or args.deadline_hours <= 0:
            raise InputError("--cheapest needs --samples and a positive --deadline-hours")
        found = planner.cheapest(w, job, args.deadline_hours * 3600.0, args.calibration)
        return report.cheapest(w, args.deadline_hours, found)
    result = estimate(w, args.gpu, args.calibration, job, args.inter_node)
    return report.estimate(result, planner.advice(result, args.calibration))


def _plotted(result: report.Result, args, draw) -> report.Result:
    """The answer, and its picture written to --plot (estimator/plots.py, imported only then)."""
    if not args.plot:
        return result
    from estimator import plots

    with quiet_libraries(args.verbose):
        path = draw(plots)
    return report.Result({**result.data, "plot": str(path)}, result.text + f"\nplot: {path}")


def _with_sources(result: report.Result, args) -> report.Result:
    """Where each setting came from, when files were read (flags alone: the answer as it is)."""
    if not any(getattr(args, o[2:].replace("-", "_"), None) for o in flags.FILE_FLAGS) or args.chinchilla:
        return result
    resolved = flags.resolve(args)
    data = {**result.data, "sources": resolved.to_dict()}
    return report.Result(data, result.text + "\n" + "\n".join(resolved.lines()))


def _check_traceable(args) -> None:
    """Refuse an untraceable request at once, before torch loads (profiler/trace_scope.py is torch-free)."""
    from profiler.trace_scope import check_traceable

    try:
        check_traceable(flags.workload_from_args(args))
    except NotImplementedError as exc:
        raise InputError(f"--trace: {exc}") from None


def _trace(args) -> dict:
    """profiler.trace on the same Workload (imported here only: the estimator never imports torch)."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != scripts]  # scripts/profile.py shadows stdlib
    try:
        with quiet_libraries(args.verbose):   # bitsandbytes logs a missing-kernel notice on import
            import torch  # noqa: F401
            import transformers  # noqa: F401

            from profiler.trace import trace
    except ImportError as exc:
        raise InputError(f"--trace needs torch and transformers installed ({exc})") from None
    w = flags.workload_from_args(args)
    try:
        with quiet_libraries(args.verbose):
            return trace(w, load_config(args.model or w.model.name)[0]).to_dict()
    except NotImplementedError as exc:
        raise InputError(f"--trace: {exc}") from None


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = _parser(prog).parse_args(argv)
    try:
        if args.trace and any(getattr(args, q) for q in _QUESTIONS):
            raise InputError("--trace applies to a single estimate (not --fit-gpus, --max-batch, --max-seq, "
                             "--cheapest, --chinchilla)")
        result = _answer(args)
        result = _with_sources(result, args)
        if args.trace:
            _check_traceable(args)
            with after(PATIENCE_S, "tracing the real step on fake tensors (profiler.trace; seconds to a minute)..."):
                result = report.with_trace(result, _trace(args))
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    flags.print_stdout(json.dumps(result.data, indent=2) if args.json else result.text)
    return 0

