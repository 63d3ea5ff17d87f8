"""The child process: run ONE configuration and write its record rows.

    python -m profiler.child --case CASE.json --out RESULT.json [--backend auto|cuda|cpu]

CASE.json is `profiler.case.Case.to_json()`. The output is a JSON list of record rows (dicts with
exactly the columns of profiler.record, each passed through `record.check_row`), written
atomically (a temporary file in the same folder, then `os.replace`): a reader never sees half a file.

Backends: `auto` is cuda when `torch.cuda.is_available()`, else cpu. On cpu the CUDA memory
columns are None (not measured), step times are real and host_rss_bytes is measured. `trace`
hands the case to `profiler.trace.trace_row` (one process, fake tensors; the parent's backend).

Status of a row: `ok`; `oom` (torch.OutOfMemoryError, or a RuntimeError/MemoryError whose text
says the memory ran out: CUDA, cuBLAS, DeepSpeed and bitsandbytes variants), message = the
error's first line; `skipped` (build.MissingPackage: the message names the package and the
configuration); `error` (anything else, including a malformed case), message
"ExceptionType: first line".

Processes and files (what the parent reads):
- One process (no launcher, or WORLD_SIZE 1): RESULT.json holds one row (rank 0, world_size 1).
- Under torchrun or the deepspeed launcher (WORLD_SIZE > 1, RANK, LOCAL_RANK set): rank r runs
  the case on cuda:LOCAL_RANK (or cpu), joins the process group (nccl on cuda, gloo on cpu) and
  writes RESULT.rank<r>.json (next to RESULT.json, e.g. out/R.json -> out/R.rank1.json) holding its
  one row. RESULT.json itself is not written. So the parent's rule is: rows = RESULT.json if present
  plus every RESULT.rank*.json; a rank whose file is missing died before writing (killed by the
  launcher or the OS). The parent should delete stale RESULT*.json before launching.
- The case's gpus x nodes must equal WORLD_SIZE (a 2-GPU ZeRO case measured in 1 process would
  report the wrong partitions): a mismatch is an `error` row.

Exit status: 0 whenever the file was written, except in a multi-process run, where a rank whose
row is not `ok` exits 3 after writing its file so that the launcher stops the other ranks (they
would otherwise wait in a collective for it). 2 when the file cannot be written (one line on
stderr). The parent must read the files whatever the exit status.

ZeRO cases (Workload.zero 1-3) go through profiler.zero (deepspeed.initialize); other training
cases use build.make_optimizer and steps.train_step (wrapped in DistributedDataParallel when
WORLD_SIZE > 1); inference cases time steps.prefill and steps.decode separately.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from estimator.files import atomic_write_text, utc_now
from estimator.workload import Workload
from profiler import build, measure, record, steps, zero
from profiler.build import MissingPackage
from profiler.case import Case
from profiler.device import cuda as cuda_device
from profiler.device import nvml, simulated
from profiler.env import environment, host_environment
from profiler.trace import trace_row

PARENT_ENV = "PROFILER_PARENT_PID"  # set by profiler.runner: the process this child must not outlive
PR_SET_PDEATHSIG = 1                # linux/prctl.h
PARENT_POLL_S = 0.5
EXIT_OK = 0
EXIT_UNWRITABLE = 2
EXIT_RANK_FAILED = 3
_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation",
             "failed to allocate", "not enough memory", "can't allocate memory",
             "cannot allocate memory")


# ---------------------------------------------------------------- processes and files


def rank_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment; (0, 0, 1) without one."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def out_path(out: str | Path, rank: int, world_size: int) -> Path:
    """RESULT.json for one process; RESULT.rank<r>.json for rank r of several."""
    out = Path(out)
    return out if world_size == 1 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write rows as JSON atomically (estimator.files.atomic_write_text)."""
    atomic_write_text(path, json.dumps([record.check_row(r) for r in rows], indent=1, sort_keys=True))


def die_with_parent() -> None:
    """Make this process end with its parent: the kernel's parent-death signal (Linux prctl
    PR_SET_PDEATHSIG = SIGKILL) and a watch thread that, every PARENT_POLL_S, checks that the
    parent is still the one it started under and that the runner named by $PROFILER_PARENT_PID
    (the grandparent under torchrun or DeepSpeed's launcher) still runs; when either is gone it
    SIGKILLs its own process group (this process alone when it leads none). Without this a
    SIGKILLed parent leaves the child holding the GPU beside the next measurements."""
    parent = os.getppid()
    runner = _runner_pid()
    _set_parent_death_signal(signal.SIGKILL)
    if _orphaned(parent, runner):  # the parent died before the signal was set
        _kill_own_group()
    threading.Thread(target=_watch_parent, args=(parent, runner), name="parent-watch", daemon=True).start()


def _runner_pid() -> int | None:
    try:
        pid = int(os.environ.get(PARENT_ENV, ""))
    except ValueError:
        return None
    return pid if pid > 1 else None


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) through libc; False where it is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """True while `pid` runs and started before this process (a recycled pid is not the runner)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return (proc.status() != psutil.STATUS_ZOMBIE
                and proc.create_time() <= psutil.Process().create_time() + 1.0)
    except psutil.Error:
        return False


def _orphaned(parent: int, runner: int | None) -> bool:
    return os.getppid() != parent or parent <= 1 or (runner is not None and not _alive(runner))


def _watch_parent(parent: int, runner: int | None) -> None:
    while not _orphaned(parent, runner):
        time.sleep(PARENT_POLL_S)
    _kill_own_group()


def _kill_own_group() -> None:
    sys.stderr.write("profiler.child: the parent process is gone; stopping\n")
    sys.stderr.flush()
    if os.getpgrp() == os.getpid():  # the runner (or a launcher) made this process a group leader
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- status of an exception


def first_line(text) -> str:
    """The first non-blank line of `text`; a line ending in ':' takes the next one with it
    (wrapped errors such as "Class validation error for validator 'validate_rope':")."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return ""
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def is_oom(exc: BaseException) -> bool:
    """True for the ways running out of memory surfaces: torch.OutOfMemoryError, MemoryError,
    and RuntimeErrors of CUDA/cuBLAS/DeepSpeed/bitsandbytes saying so."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, message) of an exception raised while running a case."""
    if isinstance(exc, MissingPackage):
        return "skipped", first_line(exc)
    if is_oom(exc):
        text = first_line(exc)
        return "oom", text if not isinstance(exc, MemoryError) else f"MemoryError: {text or 'host'}"
    return "error", f"{type(exc).__name__}: {first_line(exc)}"


# ---------------------------------------------------------------- the row


def new_row(case: Case | None, raw: dict | None, backend: str, **columns) -> dict:
    """record.new_row of the case, as far as the case can be read: with an unreadable case or an
    invalid Workload only the model (and warmup, steps) are known; the error row says why."""
    if case is not None:
        try:
            return record.new_row(case, backend, **columns)
        except Exception:  # an invalid workload: run_case raises it again, for the error row
            known = {"model": case.model, "warmup": case.warmup, "steps": case.steps}
    else:
        model = (raw or {}).get("model")
        known = {"model": model if isinstance(model, str) else None}
    return record.new_row(None, backend, **known, **columns)


_GPU_FIELDS = ("gpu_name", "gpu_slug", "gpu_memory_bytes")
_device_fields: dict[str, dict] = {}  # device -> its GPU fields, read while the device was healthy


def safe_environment(device: str) -> dict:
    """profiler.env.environment; if the device cannot be read any more (a sticky CUDA error), the
    library and host fields with the GPU fields read before the error, or None (not the CPU's
    name: the row was measured on a GPU)."""
    try:
        fields = environment(device)
    except Exception:  # e.g. a sticky CUDA error: still name the libraries and the host
        fields = host_environment()
        if cuda_device.is_cuda(device):  # cuda-only
            fields.update(dict.fromkeys(_GPU_FIELDS), **_device_fields.get(device, {}))
        return fields
    if cuda_device.is_cuda(device):  # cuda-only
        _device_fields[device] = {k: fields[k] for k in _GPU_FIELDS}
    return fields


def process_wall_s() -> float:
    """Seconds since this process started (interpreter start and imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


# ---------------------------------------------------------------- running the case


def resolve_backend(choice: str) -> str:
    """cuda or cpu; `auto` is cuda when torch sees a GPU. An unavailable cuda is checked later
    (`check_backend`), so that it becomes an error row rather than no row."""
    if choice != "auto":
        return choice
    return "cuda" if cuda_device.available() else "cpu"


def check_backend(backend: str) -> None:
    if backend == "cuda" and not cuda_device.available():
        raise RuntimeError("backend cuda asked for, but torch.cuda.is_available() is False")


def device_name(backend: str, local_rank: int) -> str:
    """Where this rank's tensors go: cuda:LOCAL_RANK (the CPU under a simulated device), or cpu."""
    return cuda_device.placement(f"cuda:{local_rank}") if backend == "cuda" else "cpu"


class DeviceBusy(RuntimeError):
    """Another process holds the GPU (a run left behind, another user): measuring beside it would
    mix its memory and time into this row."""


def launcher_family() -> set[int]:  # cuda-only
    """This process's parent and the parent's descendants (the other ranks under a launcher, the
    runner itself): processes whose presence on the device is expected."""
    import psutil

    try:
        parent = psutil.Process(os.getppid())
        return {parent.pid} | {p.pid for p in parent.children(recursive=True)}
    except psutil.Error:
        return set()


def check_idle(handle, wait_s: float = nvml.IDLE_WAIT_S) -> None:  # cuda-only
    """Raise DeviceBusy when other processes still hold the device after `wait_s` (NVML's process
    list; nothing is checked when NVML cannot say)."""
    busy = nvml.wait_until_idle(handle, launcher_family(), timeout_s=wait_s)
    if busy:
        raise DeviceBusy(f"GPU not idle before measuring: {nvml.describe_busy(busy)} still hold it "
                         f"after {wait_s:g} s")


def setup_device(backend: str, local_rank: int):
    """(device, nvml device or None, NVML reading around CUDA init): on cuda, check that no other
    process holds the GPU, select cuda:LOCAL_RANK and measure the device's used memory before
    CUDA started (the baseline) and the CUDA context (NVML delta around torch.cuda.init() and a
    one-element tensor)."""
    if backend != "cuda":
        return "cpu", None, nvml.InitReading(None, None)
    return _setup_cuda(device_name(backend, local_rank), local_rank)


def _setup_cuda(device: str, local_rank: int):  # cuda-only
    handle = nvml.open_device(local_rank)
    check_idle(handle)
    reading = nvml.init_reading(handle, lambda: cuda_device.init(device), lambda: cuda_device.reserved_now(device))
    safe_environment(device)  # the GPU fields, while the device is healthy (kept for error rows)
    return device, handle, reading


def check_world(w: Workload, world_size: int) -> None:
    if w.world_size != world_size:
        raise ValueError(f"the case needs {w.world_size} processes (gpus x nodes) but runs in "
                         f"{world_size}: launch it with torchrun/deepspeed --nproc_per_node {w.world_size}")
    if w.tp > 1 or w.pp > 1 or w.ep > 1:
        raise ValueError("tensor, pipeline and expert parallel are not profiled (tp = pp = ep = 1 only)")


def _vocab_size(model) -> int:
    return getattr(model, "module", model).config.vocab_size


def prepare(case: Case, w: Workload, device: str, world_size: int) -> tuple[list, int | None, object]:
    """(phases, weights_bytes, host offload reader or None): the model built on `device` and
    the step's phases (training: one; inference: prefill and decode)."""
    if w.zero:
        return _prepare_zero(case, w, device)
    model = build.build_model(case.config(), w, device)
    if w.fsdp != "none" and w.training:   # sharded before the weights are read and the optimizer made
        from profiler import fsdp

        model = fsdp.shard(model, w, device)
    weights = measure.weights_bytes(model, device)
    batch = build.make_batch(w, _vocab_size(model), device)
    if not w.training:
        return _inference_phases(model, batch, w, device), weights, None
    optimizer = build.make_optimizer(model, w)
    if world_size > 1 and w.fsdp == "none":
        model = _ddp(model, device)
    host = None
    if w.fsdp != "none" and w.offload != "none":   # read after the run: Adam's states exist after a step
        from profiler import fsdp

        host = lambda: fsdp.host_offload_bytes(model, optimizer)  # noqa: E731
    return _train_phases(model, optimizer, batch, w, device), weights, host


def _prepare_zero(case: Case, w: Workload, device: str):
    engine, model = zero.build(case.config(), w, device)
    batch = build.make_batch(w, _vocab_size(model), device)
    # host_offload_bytes is read after the run: the Adam states exist only after a step
    return ([zero.train_phase(engine, batch, w)], measure.weights_bytes(model, device),
            lambda: zero.host_offload_bytes(engine, w.offload))


def _ddp(model, device: str):
    import torch

    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _train_phases(model, optimizer, batch, w: Workload, device: str) -> list:
    """[forward and backward of every micro-batch, gradient clipping, optimizer step]: the HF
    Trainer's step in three timed phases, so that the clipping and the optimizer step are measured
    on their own (`clip_s`, `optimizer_s`). Where the model reduces gradients across ranks and
    accumulates (`steps.reduction_timed_apart`), four: the micro-batches in no_sync, the last one
    (whose backward reduces), the clipping, the optimizer step, so that the exposed reduction is
    measured (`nosync_microbatch_s`, `sync_microbatch_s`); the same work in the same order either way."""
    device_type = device.split(":")[0]
    k = w.grad_accum
    clip = lambda: steps.clip_gradients(model)  # noqa: E731
    step = lambda: steps.optimizer_step(optimizer)  # noqa: E731
    if steps.reduction_timed_apart(w):
        return [lambda: steps.micro_batches(model, batch, w, device_type, range(k - 1)),
                lambda: steps.micro_batches(model, batch, w, device_type, [k - 1]), clip, step]
    return [lambda: steps.forward_backward(model, batch, w, device_type), clip, step]


def _inference_phases(model, batch, w: Workload, device: str) -> list:
    """[prefill] or [prefill, decode of new_tokens - 1 tokens]; the cache passes between them."""
    device_type = device.split(":")[0]
    carried: dict = {}

    def prefill() -> None:
        carried["token"], carried["cache"] = steps.prefill(model, batch, w, device_type)

    def decode() -> None:
        steps.decode(model, carried.pop("token"), carried.pop("cache"), w, device_type, w.new_tokens - 1)

    def prefill_only() -> None:
        prefill()
        carried.clear()

    return [prefill, decode] if w.new_tokens > 1 else [prefill_only]


_owned_group = False  # True once this module created the process group (main tears it down)


def init_process_group(w: Workload, backend: str, world_size: int) -> None:
    """DeepSpeed's process group for ZeRO (also for one process), torch's for DDP."""
    global _owned_group
    import torch.distributed as dist

    dist_backend = cuda_device.dist_backend(backend)   # gloo on the host and the simulated device
    already = dist.is_initialized()
    if w.zero:
        if cuda_device.on_host(backend):
            zero.use_cpu_accelerator()
        zero.init_distributed(dist_backend)
    elif world_size > 1 and not already:
        dist.init_process_group(dist_backend)
    _owned_group = _owned_group or (not already and dist.is_initialized())


def run_case(case: Case, backend: str, local_rank: int, world_size: int) -> dict:
    """Measure the case; the row's measured columns (and gpu environment)."""
    w = case.workload()
    build.check_packages(w)
    check_world(w, world_size)
    check_backend(backend)
    device, handle, reading = setup_device(backend, local_rank)
    init_process_group(w, backend, world_size)
    phases, weights, offload = prepare(case, w, device, world_size)
    probe, source = nvml.used_probe(handle, baseline_bytes=reading.baseline_bytes)
    measured = measure.run(phases, case.warmup, case.steps, device, probe, reading.context_bytes)
    env = safe_environment(device)
    row = {**measured.columns(), **env, "weights_bytes": weights,
           "device_used_source": source if measured.device_used_bytes else None,
           "device_baseline_bytes": reading.baseline_bytes,
           "host_offload_bytes": offload() if offload else None}
    if not w.training:
        row.update(measure.inference_split(w, measured.phase_s))
    elif len(measured.phase_s) >= 3:            # forward/backward, clipping, optimizer step (not DeepSpeed's)
        row["optimizer_s"] = float(measured.phase_s[-1])
        row["clip_s"] = float(measured.phase_s[-2])
        if len(measured.phase_s) == 4:          # no_sync micro-batches, the reducing one (_train_phases)
            row["nosync_microbatch_s"] = float(measured.phase_s[0]) / (w.grad_accum - 1)
            row["sync_microbatch_s"] = float(measured.phase_s[1])
    row.update(measure.rates(w, measured.step_s, env["gpu_slug"]))
    # an ok row says when the allocator retried and when DeepSpeed's FusedAdam was replaced by AdamW
    notes = [measured.retry_warning(), zero.adam_fallback(w, device) if w.zero else None]
    row["message"] = "; ".join(n for n in notes if n)
    return row


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m profiler.child", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", required=True, help="Case JSON file (profiler.case.Case.to_json())")
    p.add_argument("--out", required=True, help="result file; rank files go next to it")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu", "trace"), default="auto",
                   help="auto: cuda if available, else cpu; trace: profiler.trace's fake-tensor trace")
    return p.parse_args(argv)


def read_case(path: str) -> tuple[Case | None, dict | None, Exception | None]:
    """(case, raw dict, error): the parsed case, or what could be read and why it failed."""
    raw = None
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError(f"a case is a JSON object (Case.to_json()); got a {type(raw).__name__}")
        return Case.from_dict(raw), raw, None
    except Exception as e:  # unreadable, not JSON, unknown keys, bad counts
        return None, raw if isinstance(raw, dict) else None, e


def build_row(args: argparse.Namespace, rank: int, local_rank: int, world_size: int) -> dict:
    """The complete row of this process (never raises for a problem of the case)."""
    started = utc_now()
    case, raw, problem = read_case(args.case)
    backend = resolve_backend(args.backend)
    row = new_row(case, raw, backend, rank=rank, world_size=world_size, started_at=started, status="ok",
                  message="")
    try:
        if problem is not None:
            raise problem
        if backend == "trace":
            return _trace_row(case, row)
        row.update(run_case(case, backend, local_rank, world_size))
    except Exception as e:  # every failure of a case is data: oom, skipped or error
        row["status"], row["message"] = classify(e)
        row.update(safe_environment(device_name(backend, local_rank)))
    row["wall_s"] = process_wall_s()
    if backend == "cuda" and simulated.active():  # cuda-only
        row["backend"] = "simulated"          # never mistaken for (or fitted as) a hardware row
    return row


def _trace_row(case: Case, row: dict) -> dict:
    """backend trace: profiler.trace's row (a fake-tensor trace on cpu, one process)."""
    return {**row, **trace_row(case), "wall_s": process_wall_s()}


def _finish_distributed() -> None:
    """Destroy the process group this module created (one made by a caller stays)."""
    global _owned_group
    if not _owned_group:
        return
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # tearing down after a failure must not hide the row
        pass
    zero.remove_shm_buffer()   # DeepSpeed's CPU allreduce buffer outlives the process otherwise
    _owned_group = False


def write_checked(path: Path, row: dict) -> dict:
    """Write the row; one that `record.check_row` refuses (a reading of 0 bytes, say) is written
    as an error row without its byte readings instead. Returns the row written."""
    try:
        write_rows(path, [row])
        return row
    except ValueError as e:
        row = {**row, **dict.fromkeys(record.MEASURED_BYTES), "status": "error",
               "message": f"invalid measurement: {first_line(e)}"}
        write_rows(path, [row])
        return row


def _exit_rank(code: int) -> None:
    """A rank of several ends without interpreter teardown once its row is written and its group
    destroyed: DeepSpeed's CPU-side threads (offload, gloo) can be destroyed still joinable at
    teardown, and the C++ runtime then aborts ('terminate called without an active exception',
    rc -6) after a good step, which the launcher reports as a failed run."""
    try:  # a rank measured by coverage (scripts/check_gpu_paths.py) keeps its data
        import coverage

        current = coverage.Coverage.current()
        if current is not None:
            current.stop()
            current.save()
    except Exception:  # coverage absent or not measuring
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rank, local_rank, world_size = rank_info()
    path = out_path(args.out, rank, world_size)
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        print(f"profiler.child: cannot write {path}: folder missing or not writable", file=sys.stderr)
        return EXIT_UNWRITABLE
    row = build_row(args, rank, local_rank, world_size)
    try:
        row = write_checked(path, row)
    except OSError as e:
        print(f"profiler.child: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return EXIT_UNWRITABLE
    if world_size > 1 and row["status"] != "ok":
        _exit_rank(EXIT_RANK_FAILED)  # skip interpreter teardown: it may wait on the other ranks
    _finish_distributed()
    return EXIT_OK


if __name__ == "__main__":
    die_with_parent()  # here, not in main(): main() also runs inside test processes
    _code = main()
    if rank_info()[2] > 1:
        _exit_rank(_code)
    sys.exit(_code)
