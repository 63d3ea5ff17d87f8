"""What the tracer (profiler/trace) reproduces, told without importing torch, so a command line
refuses an untraceable request at once, before it loads torch (estimator/cli.py --trace)."""

from __future__ import annotations

from estimator.workload import Workload


def check_traceable(w: Workload) -> None:
    """Raise NotImplementedError for what the tracer does not reproduce (one process, torch
    optimizers, 4-bit quantization)."""
    if w.world_size > 1 or w.zero or w.tp > 1 or w.pp > 1:
        raise NotImplementedError("multi-GPU, ZeRO, tensor and pipeline parallel runs are not traced")
    if w.fsdp != "none":
        raise NotImplementedError("FSDP runs are not traced (fully_shard needs a process group; the profiler runs them)")
    if w.optimizer not in ("adamw", "sgd", "adafactor"):
        raise NotImplementedError(f"bitsandbytes optimizer {w.optimizer} does not run on fake tensors")
    if w.quant == "mxfp4":
        raise NotImplementedError("MXFP4 experts (triton matmul_ogs from the `kernels` package) do not run on "
                                  "fake CPU tensors")
    if w.quant == "int8":
        raise NotImplementedError("int8 (LLM.int8) layers have no stand-in; 4-bit ones do")
