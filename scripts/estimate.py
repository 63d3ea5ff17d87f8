#!/usr/bin/env python3
"""Predict GPU memory, time and cost of a Hugging Face LLM job (no torch import).

Examples:
  python scripts/estimate.py --model llama-3.1-8b --method qlora --batch 4 --seq 4096 --gpu a10g-24gb
  python scripts/estimate.py --model llama-2-70b --method full --zero 3 --fit-gpus
  python scripts/estimate.py --model llama-3.1-8b --method lora --max-batch --gpu a100-80gb
  python scripts/estimate.py --model mistral-7b --method qlora --samples 10000 --epochs 3 --cheapest --deadline-hours 24
  python scripts/estimate.py --chinchilla --gpu a100-80gb --gpus 1 --hours 72
  python scripts/estimate.py --model llama-3.2-1b --method lora --batch 4 --seq 2048 --trace

Bad input prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimator.errors import InputError  # noqa: E402
from estimator import report  # noqa: E402
from estimator.report import OneLineParser  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="estimate.py", description="Predict GPU memory, time and cost of an LLM job.")
    p.add_argument("--model", help="config.json path, catalog name (llama-3.1-8b) or Hub id")
    p.add_argument("--method", choices=["full", "lora", "qlora", "inference"], default="full")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16", "amp-fp16", "amp-bf16"], default="bf16")
    p.add_argument("--optimizer", choices=["adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit",
                                           "sgd", "adafactor"], default="adamw")
    p.add_argument("--adamw-impl", choices=["fused", "foreach", "single"], default="fused",
                   help="torch AdamW implementation (HF Trainer default: fused)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    p.add_argument("--seq", type=int, default=512, help="tokens per sample (the prompt for inference)")
    p.add_argument("--new-tokens", type=int, default=0, help="generated tokens (inference)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="comma list of roles, or all-linear")
    p.add_argument("--quant", choices=["none", "int8", "nf4", "fp4"], default=None,
                   help="bitsandbytes weights (qlora default nf4)")
    p.add_argument("--no-double-quant", action="store_true", help="QLoRA without double quantization")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--attn", choices=["eager", "sdpa", "flash"], default="sdpa")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--offload", choices=["none", "optimizer", "optimizer+params"], default="none")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree")
    p.add_argument("--gpu", default="h100-80gb", help="GPU slug, e.g. a100-80gb, h100-80gb, rtx4090-24gb")
    p.add_argument("--inter-node", default="ib-hdr", help="inter-node interconnect (interconnects.csv)")
    p.add_argument("--calibration", default="auto", help="auto, none, or a calibration table path")
    p.add_argument("--samples", type=int, help="training samples per epoch (adds job time and cost)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--retry-factor", type=float, default=1.0, help="multiplies job time (restarts, evals)")
    p.add_argument("--price-table", help="CSV overriding the shipped price table (same columns)")
    p.add_argument("--provider", help="price from this provider only")
    ask = p.add_mutually_exclusive_group()
    ask.add_argument("--fit-gpus", action="store_true", help="which GPUs fit, and how many are needed")
    ask.add_argument("--max-batch", action="store_true", help="largest micro-batch that fits --gpu")
    ask.add_argument("--max-seq", action="store_true", help="longest sequence that fits --gpu")
    ask.add_argument("--cheapest", action="store_true", help="cheapest setup meeting --deadline-hours")
    ask.add_argument("--chinchilla", action="store_true",
                     help="compute-optimal params/tokens for --gpus x --gpu over --hours")
    p.add_argument("--deadline-hours", type=float, help="with --cheapest")
    p.add_argument("--hours", type=float, help="with --chinchilla: wall-clock budget")
    p.add_argument("--mfu", type=float, help="with --chinchilla: achieved fraction (default: table)")
    p.add_argument("--json", action="store_true", help="print the result object as JSON")
    p.add_argument("--trace", action="store_true",
                   help="also trace the real step on fake tensors (needs torch; profiler.trace) and show it beside")
    return p


def _trace(args) -> dict:
    """profiler.trace on the same Workload (imported here only: the estimator never imports torch)."""
    scripts = os.path.dirname(os.path.abspath(__file__))  # scripts/profile.py would shadow stdlib profile
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != scripts]
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        from profiler.trace import trace
    except ImportError as exc:
        raise InputError(f"--trace needs torch and transformers installed ({exc})") from None
    from estimator.configs import load_config

    try:
        return trace(report.workload_from_args(args), load_config(args.model)[0]).to_dict()
    except NotImplementedError as exc:
        raise InputError(f"--trace: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.trace and report.trace_request_error(args):
            raise InputError(report.trace_request_error(args))
        result = report.run(args)
        if args.trace:
            result = report.with_trace(result, _trace(args))
    except InputError as exc:
        print(f"estimate.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(result.data, indent=2) if args.json else result.text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
