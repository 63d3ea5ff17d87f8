"""DeepSpeed ZeRO 1/2/3 (optimizer and parameter offload) through `deepspeed.initialize`, as a
user runs it: DeepSpeed's own AdamW (FusedAdam on the device, DeepSpeedCPUAdam with offload),
mixed precision from the Workload, the bucket sizes the HF Trainer fills for "auto".

- `ds_config(w)`: the config dict (bf16/fp16 enabled per precision: AMP precisions mean DeepSpeed
  mixed precision, as `--bf16` does under the HF Trainer; zero_optimization stage; offload to
  pinned cpu memory).
- `init_distributed(backend)`: the process group (gloo on cpu, nccl on cuda); a lone process
  without a launcher gets RANK 0, WORLD_SIZE 1 and a free MASTER_PORT.
- `build(case_config, w, device)`: the model as the HF Trainer builds it under ZeRO: for stage 3
  an `HfDeepSpeedConfig` is alive while transformers builds the model, so `from_config` runs
  under `deepspeed.zero.Init` and the parameters are partitioned as they are created (the full
  model never exists on one device); then `deepspeed.initialize` (DeepSpeed partitions anything
  created outside zero.Init, e.g. LoRA adapters).
- `train_phase(engine, batch, w)`: one optimizer step: grad_accum x (forward, engine.backward,
  engine.step); DeepSpeed steps the optimizer at the accumulation boundary.
- `partitions(engine)`: what this rank holds (elements, padding included) and `host_offload_bytes`.

Ops: DeepSpeed compiles its ops on first use into the torch extensions folder (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions/<python>_<accelerator>): DeepSpeedCPUAdam with g++, FusedAdam with
nvcc on cuda (g++ on the CPU accelerator), about 85 s each on 2 cores. `prepare_ops` builds the ops a
sweep needs once, in one process, before the children run (a child killed by its timeout while
compiling would leave torch's `lock` file behind, on which every later build waits forever);
`clear_stale_locks` removes such leftovers. Without a CUDA toolkit FusedAdam cannot be compiled:
`adam_fallback` says so and `build` has DeepSpeed run torch.optim.AdamW (its `torch_adam` option).
On a machine without CUDA DeepSpeed picks its CPU accelerator by itself; `use_cpu_accelerator()`
forces it before deepspeed is imported.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from estimator.workload import Workload
from profiler import build as builder
from profiler.device import cuda as cuda_device

LR = 1e-5
STALE_LOCK_S = 900  # a build lock older than this is a leftover (FusedAdam compiles in ~1-2 min)
OP_BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder"}
_OPTIMIZER_OFFLOAD = ("optimizer", "optimizer+params")


def use_cpu_accelerator() -> None:
    """Make DeepSpeed use its CPU accelerator (call before importing deepspeed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(w: Workload, torch_adam: bool = False) -> dict:
    """DeepSpeed config dict of a ZeRO Workload (stage 1-3, offload per `w.offload`); with
    `torch_adam`, DeepSpeed's AdamW is torch.optim.AdamW instead of FusedAdam."""
    zero: dict = {"stage": w.zero, **hf_auto_buckets(w)}
    if w.offload in _OPTIMIZER_OFFLOAD:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if w.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    half = w.compute_dtype
    return {
        "train_micro_batch_size_per_gpu": w.batch,
        "gradient_accumulation_steps": w.grad_accum,
        "bf16": {"enabled": half == "bf16"},
        "fp16": {"enabled": half == "fp16"},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, **({"torch_adam": True} if torch_adam else {})}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def hf_auto_buckets(w: Workload) -> dict:
    """The bucket sizes the HF Trainer fills for DeepSpeed's "auto" values (the estimator's
    `estimator.states.deepspeed_buckets`): reduce bucket hidden^2, stage 3 prefetch 0.9 hidden^2 and
    parameter persistence threshold 10 hidden (transformers integrations/deepspeed.py)."""
    from estimator.states import deepspeed_buckets

    reduce_bucket, prefetch_bucket = deepspeed_buckets(w.model.hidden_size)
    out = {"reduce_bucket_size": reduce_bucket}
    if w.zero == 3:
        out.update(stage3_prefetch_bucket_size=prefetch_bucket,
                   stage3_param_persistence_threshold=10 * w.model.hidden_size)
    return out


def check_supported(w: Workload) -> None:
    """Refuse what this module does not profile, with one line."""
    if not w.training or not w.zero:
        raise ValueError("profiler.zero runs ZeRO training workloads (zero 1, 2 or 3)")
    if w.optimizer != "adamw":
        raise ValueError(f"ZeRO runs use DeepSpeed's AdamW (FusedAdam/DeepSpeedCPUAdam); "
                         f"optimizer {w.optimizer} is not profiled under ZeRO")
    if w.quant != "none":
        raise ValueError("quantized bases (QLoRA/int8) under ZeRO are not profiled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str) -> None:
    """Initialise DeepSpeed's process group with `backend` (gloo or nccl); outside a launcher,
    as a single process (RANK 0, WORLD_SIZE 1, MASTER_ADDR 127.0.0.1, a free MASTER_PORT).
    Stale build locks are removed first (`clear_stale_locks`)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    clear_stale_locks()  # the CPU accelerator builds its shared-memory comm op right here
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def build(case_config: dict, w: Workload, device: str):
    """(engine, model): the Workload's model built as the HF Trainer does under ZeRO, wrapped by
    `deepspeed.initialize` with DeepSpeed's optimizer. Needs `init_distributed` first."""
    import deepspeed

    check_supported(w)
    config = ds_config(w, torch_adam=adam_fallback(w, device) is not None)
    with _hf_zero3(config, w.zero == 3):
        model = builder.build_model(case_config, w, device)
        params = builder.trainable_parameters(model)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine, model


# ---------------------------------------------------------------- DeepSpeed's compiled ops


def cuda_toolkit() -> str | None:
    """Path of a runnable nvcc where DeepSpeed looks for it (torch's CUDA_HOME: $CUDA_HOME or
    $CUDA_PATH, else nvcc on PATH, else /usr/local/cuda; then <home>/bin/nvcc -V, as
    op_builder.builder.installed_cuda_version runs it); None without a CUDA toolkit."""
    from torch.utils.cpp_extension import _find_cuda_home

    home = _find_cuda_home()
    if not home:
        return None
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        subprocess.run([nvcc, "-V"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):  # a runtime-only install, a broken link
        return None
    return nvcc


def _prebuilt(op: str) -> bool:
    """True when DeepSpeed was installed with `op` compiled (DS_BUILD_OPS=1) for this accelerator."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(op)) and accelerator_name == get_accelerator()._name


def adam_fallback(w: Workload, device: str) -> str | None:
    """Why this ZeRO run steps with torch.optim.AdamW (DeepSpeed's `torch_adam`) instead of
    FusedAdam, or None. FusedAdam serves runs without optimizer offload and is compiled with nvcc on
    cuda; with no CUDA toolkit (and no prebuilt op) DeepSpeed would fail with "CUDA_HOME does not
    exist". DeepSpeedCPUAdam (optimizer offload) and the CPU accelerator compile with g++."""
    if not device.startswith("cuda") or w.offload in _OPTIMIZER_OFFLOAD:
        return None
    if cuda_toolkit() is not None or _prebuilt("fused_adam"):
        return None
    return ("DeepSpeed FusedAdam cannot be compiled (no CUDA toolkit: nvcc not found): "
            "the optimizer is torch.optim.AdamW (torch_adam)")


def extensions_dir() -> Path:
    """Root of torch's extension builds: $TORCH_EXTENSIONS_DIR, else torch's default
    (~/.cache/torch_extensions; builds go in <python>_<accelerator>/<op> under it)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


SHM_DIR = Path("/dev/shm")


def remove_shm_buffer(environ=None, shm_dir: Path = SHM_DIR) -> Path | None:
    """Unlink this rank's shared-memory allreduce buffer, which DeepSpeed's CPU communication op
    creates and never removes (deepspeed/ops/csrc/cpu/comm/shm.cpp `shm_initialize`:
    `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`, 64 MiB and more each):
    without this every ZeRO run on the CPU backend leaves its ranks' buffers in /dev/shm. Unlinking
    a name leaves the other ranks' mappings of it valid. Returns the file removed, or None."""
    env = os.environ if environ is None else environ
    if "MASTER_PORT" not in env or "RANK" not in env:
        return None
    path = shm_dir / (f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
                      f"{env['MASTER_PORT']}_{env['RANK']}")
    try:
        path.unlink()
    except OSError:   # none made (GPU runs, no CPU comm op) or already gone
        return None
    return path


def clear_stale_locks(root: str | Path | None = None, older_than_s: float = STALE_LOCK_S,
                      ops: tuple = ()) -> list[Path]:
    """Remove torch's build lock files (`<root>/<op>/lock`, `<root>/<python>_<accel>/<op>/lock`)
    older than `older_than_s` (of the ops named in `ops` only, if given): a build killed midway
    leaves its lock, and torch's FileBaton waits for it to disappear with no time limit. Returns
    the files removed."""
    root = Path(root) if root is not None else extensions_dir()
    if not root.is_dir():
        return []
    removed, now = [], time.time()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        if ops and lock.parent.name not in ops:
            continue
        try:
            if lock.is_file() and now - lock.stat().st_mtime > older_than_s:
                lock.unlink()
                removed.append(lock)
        except OSError:  # removed meanwhile by its builder, or not ours to remove
            continue
    return removed


def ops_needed(workloads) -> list[str]:
    """DeepSpeed ops the ZeRO workloads load: cpu_adam with optimizer offload, else fused_adam."""
    ops = {("cpu_adam" if w.offload in _OPTIMIZER_OFFLOAD else "fused_adam") for w in workloads if w.zero}
    return sorted(ops)


def prepare_ops(workloads, backend: str, timeout_s: float = 1800,
                older_than_s: float = STALE_LOCK_S) -> list[str]:
    """Before a sweep (profiler.session): remove stale build locks, then compile the DeepSpeed ops
    its ZeRO workloads need, each once, in a subprocess of this process (cuda or cpu accelerator
    as `backend`; the CPU accelerator's on a simulated device), so that no child compiles and none is killed mid-build by its timeout. FusedAdam
    is not built on cuda without a CUDA toolkit (the children use torch_adam). A build that fails
    or times out is reported, never raised (the children then report it in their rows); one killed
    for its timeout has its lock removed. Returns one line per thing done."""
    ops = ops_needed(workloads) if backend in ("cuda", "cpu") else []
    if not ops:
        return []
    if cuda_device.on_host(backend):  # cpu, and cuda on the simulated device: the CPU accelerator's ops
        backend = "cpu"
    lines = [f"removed a stale DeepSpeed build lock: {p}" for p in clear_stale_locks(older_than_s=older_than_s)]
    if backend == "cuda" and "fused_adam" in ops and cuda_toolkit() is None:
        ops.remove("fused_adam")
        lines.append("DeepSpeed FusedAdam: no CUDA toolkit (nvcc); ZeRO runs without optimizer offload "
                     "use torch.optim.AdamW (torch_adam)")
    return lines + [_build_op(op, backend, timeout_s) for op in ops]


def _build_op(op: str, backend: str, timeout_s: float) -> str:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(cuda_device.deepspeed_environment(backend))
    code = "import sys; from profiler.zero import load_op; load_op(sys.argv[1])"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code, op], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the compiler processes go too
        proc.communicate()
        clear_stale_locks(older_than_s=0, ops=(op,))  # the lock of the build just killed
        return f"DeepSpeed {op}: build timed out after {timeout_s:.0f} s; ZeRO runs will try again"
    if proc.returncode != 0:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        return f"DeepSpeed {op}: build failed: {lines[-1] if lines else f'exit {proc.returncode}'}"
    return f"DeepSpeed {op}: ready ({time.monotonic() - start:.0f} s)"


def load_op(op: str):
    """Load (compiling if needed) DeepSpeed op `op` for the current accelerator."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(OP_BUILDERS[op]).load(verbose=False)


@contextmanager
def _hf_zero3(config: dict, enabled: bool):
    """While inside, transformers (and peft) see ZeRO-3 enabled: `from_config` builds under
    `deepspeed.zero.Init` and peft gathers partitioned weights when adding adapters. On the way
    out the setting is cleared, so a later build in the same process is not partitioned (the HF
    Trainer keeps it for its whole run; the training step itself does not consult it)."""
    if not enabled:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(config)  # transformers holds only a weak reference
    try:
        yield keep_alive
    finally:
        unset_hf_deepspeed_config()


def train_phase(engine, batch: builder.Batch, w: Workload):
    """The callable running one optimizer step of `engine` on `batch`. Only the loss outlives
    the forward, as in the HF Trainer and steps.train_step (the logits are freed before backward)."""

    def step() -> None:
        for _ in range(w.grad_accum):
            loss = engine(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask,
                          use_cache=False).loss
            engine.backward(loss)
            engine.step()
            del loss

    return step


# ---------------------------------------------------------------- what each rank holds


@dataclass(frozen=True)
class Partitions:
    """Elements this rank holds (DeepSpeed's padding included). `master_numel`: fp32 master
    weights; `state_numel`: each optimizer state (exp_avg, exp_avg_sq); `param_numel`: parameter
    elements stored (stage 3: this rank's partitions; stages 1/2: every parameter)."""

    stage: int
    world_size: int
    master_numel: int
    state_numel: dict
    param_numel: int


def master_partitions(optimizer) -> list:
    """The fp32 master-weight partitions of this rank (one flat tensor per group)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # stage 3
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)  # stages 1 and 2


def optimizer_states(optimizer) -> dict:
    """{state name: [tensors]} of the inner (Adam) optimizer, scalars such as `step` left out."""
    out: dict = {}
    for state in optimizer.optimizer.state.values():
        for name, value in state.items():
            if hasattr(value, "numel") and value.dim() > 0:
                out.setdefault(name, []).append(value)
    return out


def partitions(engine) -> Partitions:
    """What this rank of `engine` holds, read off DeepSpeed's optimizer (after a step, so the
    Adam states exist)."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    stage = engine.zero_optimization_stage()
    param_numel = sum(p.ds_tensor.numel() for p in params) if stage == 3 else sum(p.numel() for p in params)
    return Partitions(stage, engine.world_size, sum(t.numel() for t in master_partitions(opt)),
                      {name: sum(t.numel() for t in ts) for name, ts in optimizer_states(opt).items()},
                      param_numel)


def _offloaded_tensors(engine, offload: str) -> list:
    """Tensors DeepSpeed keeps on the host for this offload mode: fp32 master partitions, their
    gradient buffers and the Adam states (optimizer), plus the half-precision parameter
    partitions (optimizer+params, stage 3)."""
    opt = engine.optimizer
    masters = master_partitions(opt)
    out = masters + [m.grad for m in masters if m.grad is not None]
    out += [t for ts in optimizer_states(opt).values() for t in ts]
    out.append(getattr(opt, "grad_partitions_flat_buffer", None))  # stage 3 gradient partitions
    if offload == "optimizer+params":
        out += list(getattr(opt, "fp16_partitioned_groups_flat", []))
    return [t for t in out if t is not None and t.numel() > 0]


def host_offload_bytes(engine, offload: str) -> int | None:
    """Bytes of offloaded tensors (each storage once); None without offload. Tensors are counted
    by role, so a cpu run reports what a GPU run would keep on the host."""
    if offload == "none":
        return None
    seen, total = set(), 0
    for t in _offloaded_tensors(engine, offload):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total or None
