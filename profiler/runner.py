"""Run each configuration in its own process and collect its record rows; run a whole sweep.

An OOM or a sticky CUDA error dies with its process and cannot touch the next configuration.

Child contract (profiler/child.py)::

    <child> --case CASE.json --out RESULT.json --backend {cuda,cpu,trace}

- `<child>` is `sys.executable -m profiler.child`, replaced by the `child_cmd` argument or the
  PROFILER_CHILD_CMD environment variable (shell words, e.g. "python /tmp/fake_child.py");
- CASE.json holds `Case.to_json()`;
- RESULT.json: a JSON list of record rows (profiler/record.py columns), one per rank; columns the
  child leaves out or sets to null are filled here where the parent knows them (id, model,
  Workload fields, warmup, steps, rank 0, world size, backend, started_at, wall_s, hostname,
  gpu_slug); unknown keys are dropped. The child exits 0 whenever it wrote the file, oom and
  error rows included;
- world size N > 1 (Workload gpus): the child runs under DeepSpeed's launcher when ZeRO > 0,
  else torchrun, with RANK/LOCAL_RANK/WORLD_SIZE in the environment (no --local_rank argument).
  A ZeRO child whose tensors live on the host (backend cpu; cuda on the simulated device of
  profiler.device.simulated) gets DS_ACCELERATOR=cpu, its launcher included.
  Rank r writes `RESULT.rank<r>.json` (same stem as --out; e.g. result.rank1.json); rank 0 may
  write RESULT.json instead or as well (it may also hold every rank's row). The parent reads
  RESULT.json, then every RESULT.rank*.json, keeps the first row it sees per rank, and adds an
  `error` row for every rank 0..N-1 with no row;
- no file at all (segfault, kill, timeout, import error): one `error` row per rank whose message
  says why (exit code, signal, or "timeout after S s") followed by the last lines of the child's
  stderr. On timeout the whole process group is terminated (SIGTERM, then SIGKILL after 10 s),
  and with it every descendant in another session (torchrun starts its workers in their own);
- children die with their parent: while a child runs, SIGTERM and SIGHUP (a `timeout`, a closed
  SSH session) and Ctrl-C take the same path (the child's group and descendants are killed, then
  the parent exits with 128 + the signal's number); a SIGKILLed parent cannot do anything, so the
  child itself watches it ($PROFILER_PARENT_PID, profiler.child.die_with_parent).

The child's stdout and stderr go to `<log_dir>/<model>-<hash>.stdout|.stderr` (log_dir is the
run folder's logs/; a temporary folder when none is given). Children run with the repository
root as working directory and on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from estimator.files import utc_now
from profiler.case import Case
from profiler.device import cuda as cuda_device
from profiler.record import BACKENDS, COLUMN_NAMES, case_status, check_row, new_row
from profiler.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
CHILD_MODULE = "profiler.child"
CHILD_ENV = "PROFILER_CHILD_CMD"
KILL_GRACE_S = 10.0
KILL_WAIT_S = 5.0   # after SIGKILL: a process stuck in the driver (D state) is left, not waited on
PARENT_ENV = "PROFILER_PARENT_PID"  # profiler.child.PARENT_ENV
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
MESSAGE_LINES = 3
MESSAGE_CHARS = 500


# ---- commands ---------------------------------------------------------------------------------

def child_base_command(child_cmd: list[str] | None = None) -> list[str]:
    """The command that runs one child: the argument, else $PROFILER_CHILD_CMD, else
    `python -m profiler.child` with this interpreter."""
    if child_cmd:
        return list(child_cmd)
    if os.environ.get(CHILD_ENV):
        return shlex.split(os.environ[CHILD_ENV])
    return [sys.executable, "-m", CHILD_MODULE]


def _program(base: list[str]) -> list[str]:
    """What a launcher runs, from a `python -m MOD` or `python SCRIPT` command."""
    if len(base) >= 3 and base[1] == "-m":
        return ["-m", base[2], *base[3:]]
    if len(base) >= 2:
        return base[1:]
    raise ValueError(f"cannot launch {base!r} on several processes: expected 'python -m MOD' or "
                     "'python SCRIPT'")


def launch_command(base: list[str], world_size: int, zero: int, port: int) -> list[str]:
    """`base` itself for one process; for N > 1 DeepSpeed's launcher (ZeRO > 0) or torchrun."""
    if world_size <= 1:
        return list(base)
    program = _program(base)
    if zero > 0:
        target = ["--module", program[1], *program[2:]] if program[0] == "-m" else program
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size),
                "--master_port", str(port), "--no_local_rank", *target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(world_size), *program]


def free_port() -> int:
    """A TCP port nothing listens on now (for the launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_slug(case: Case) -> str:
    """A file-name-safe, stable name for a case: model stem + 10 hex digits of its id's hash."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(case.model).stem.split("/")[-1])[:40]
    return f"{stem}-{hashlib.sha1(case.id.encode()).hexdigest()[:10]}"


# ---- running one process ------------------------------------------------------------------------

# Set by torchrun/DeepSpeed for their workers; inherited from the user's shell they would make a
# one-process child join a process group that does not exist (zero.init_distributed trusts them).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _child_env() -> dict:
    """The child's environment: the parent's without launcher variables (the launcher sets its
    workers' own), the repository on PYTHONPATH, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())
    return env


def _descendants(pid: int) -> list:
    """psutil.Process of every descendant of `pid` (empty when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group and its descendants in other sessions (torchrun's
    workers), SIGKILL what is still alive after the grace period; the wait after SIGKILL is
    bounded too (KILL_WAIT_S)."""
    family: dict[int, object] = {}
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        family.update({p.pid: p for p in _descendants(proc.pid)})  # before the leader dies
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in family.values():
            try:
                p.send_signal(sig)  # psutil refuses a pid that was reused meanwhile
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        _, alive = psutil.wait_procs(list(family.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not alive:
            return
        family = {p.pid: p for p in alive}


def _kill_uninterrupted(proc: subprocess.Popen) -> None:
    """`_kill_group` with SIGTERM and SIGHUP held back until it is done (a second signal must not
    stop the kill halfway); a signal held back is delivered afterwards."""
    block = hasattr(signal, "pthread_sigmask")
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        _kill_group(proc)
    finally:
        if block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)


class ParentSignalled(SystemExit):
    """SIGTERM or SIGHUP reached the parent while a child ran: the child was killed, the parent
    exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _raise_signalled(signum, frame) -> None:
    raise ParentSignalled(signum)


def _install_handlers() -> dict:
    """Handlers raising ParentSignalled for SIGTERM and SIGHUP (not for a signal ignored on
    purpose, e.g. SIGHUP under nohup); the previous handlers, to restore. Nothing outside the
    main thread (where Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in FORWARDED_SIGNALS:
        old = signal.getsignal(sig)
        if old is signal.SIG_IGN:
            continue
        previous[sig] = old
        signal.signal(sig, _raise_signalled)
    return previous


def _restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_RUNNING: set = set()            # children started by execute() and not yet reaped (any thread)
_RUNNING_LOCK = threading.Lock()


def kill_running() -> None:
    """Kill every child execute() started that still runs (the parallel sweep's way out when the
    parent is interrupted: the threads waiting on them then return)."""
    with _RUNNING_LOCK:
        procs = list(_RUNNING)
    for proc in procs:
        _kill_uninterrupted(proc)


def execute(cmd: list[str], stdout_path: Path, stderr_path: Path, timeout_s: float,
            extra_env: dict | None = None) -> tuple[int | None, bool]:
    """Run `cmd` in its own session; (exit code, timed out). The exit code is negative when a
    signal ended the process, None when it had to be killed on timeout. Ctrl-C, SIGTERM or
    SIGHUP in the parent meanwhile kill the child (group and descendants) and are raised again
    (KeyboardInterrupt, ParentSignalled). `extra_env` is added to the child's environment
    (CUDA_VISIBLE_DEVICES of a parallel sweep)."""
    previous = _install_handlers()
    try:
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env={**_child_env(), **(extra_env or {})}, start_new_session=True)
            with _RUNNING_LOCK:
                _RUNNING.add(proc)
            try:
                return proc.wait(timeout=timeout_s), False
            except subprocess.TimeoutExpired:
                _kill_uninterrupted(proc)
                return None, True
            except BaseException:  # Ctrl-C, SIGTERM, SIGHUP in the parent: take the child down with it
                _kill_uninterrupted(proc)
                raise
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(proc)
    finally:
        _restore_handlers(previous)


def tail_message(path: Path, lines: int = MESSAGE_LINES, limit: int = MESSAGE_CHARS) -> str:
    """The last non-empty lines of a log, joined on one line with ' | ' and cut to `limit` chars."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()][-lines:]
    message = " | ".join(kept)
    return message if len(message) <= limit else "..." + message[-(limit - 3):]


def failure_reason(returncode: int | None, timed_out: bool, timeout_s: float) -> str:
    """Why a child left no (complete) result, in words."""
    if timed_out:
        return f"timeout after {timeout_s:g} s"
    if returncode is not None and returncode < 0:
        try:
            return f"child killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"child killed by signal {-returncode}"
    return f"child exited with code {returncode} without writing a result"


def failure_message(returncode: int | None, timed_out: bool, timeout_s: float, problem: str | None,
                    stderr_path: Path) -> str:
    """The message of the error rows the parent writes for ranks without a row: how the child
    ended (when that was abnormal), what was wrong with its result file, then its stderr tail."""
    reasons = [failure_reason(returncode, timed_out, timeout_s)] if (timed_out or returncode != 0) else []
    reasons += [problem] if problem else []
    reason = "; ".join(reasons) or failure_reason(returncode, False, timeout_s)
    tail = tail_message(stderr_path)
    return f"{reason}: {tail}" if tail else reason


# ---- reading results ----------------------------------------------------------------------------

def result_files(out_path: Path) -> list[Path]:
    """RESULT.json first, then RESULT.rank<r>.json in rank order (the multi-process convention)."""
    def rank_of(p: Path) -> int:
        digits = p.name[len(out_path.stem) + len(".rank"):-len(".json")]
        return int(digits) if digits.isdigit() else 1 << 30
    ranked = sorted(out_path.parent.glob(f"{out_path.stem}.rank*.json"), key=rank_of)
    return ([out_path] if out_path.exists() else []) + ranked


def read_result_rows(out_path: Path) -> tuple[list[dict], str | None]:
    """Every row the child wrote, and a problem description when a file was unreadable."""
    rows, problem = [], None
    for path in result_files(out_path):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            problem = f"unreadable result {path.name}: {exc}"
            continue
        data = [data] if isinstance(data, dict) else data
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            problem = f"result {path.name} is not a list of rows"
            continue
        rows += data
    return rows, problem


def _complete(raw: dict, known: dict) -> dict:
    """A child's row over the parent's `known` row (record.new_row): unknown keys dropped, None
    values leave the parent's; the id (the resume key) is the parent's."""
    row = dict(known)
    row.update({k: v for k, v in raw.items() if k in COLUMN_NAMES and v is not None})
    row["id"] = known["id"]
    row["rank"] = row.get("rank") if row.get("rank") is not None else 0
    try:
        return check_row(row)
    except ValueError as exc:
        return _error_row(known, row["rank"], f"child wrote an invalid row: {exc}")


def _error_row(known: dict, rank: int, message: str) -> dict:
    return check_row({**known, "status": "error", "message": message, "rank": rank})


def collect_rows(case: Case, raw_rows: list[dict], known: dict, failure: str) -> list[dict]:
    """One row per rank 0..world_size-1 (first row seen per rank; extra ranks kept), error rows
    with `failure` for ranks the child left without a row. `known` is the parent's row of the
    case (record.new_row, no status)."""
    by_rank: dict[int, dict] = {}
    for raw in raw_rows:
        row = _complete(raw, known)
        by_rank.setdefault(row["rank"], row)
    for rank in range(case.workload().world_size):
        if rank not in by_rank:
            by_rank[rank] = _error_row(known, rank, failure)
    return [by_rank[r] for r in sorted(by_rank)]


# ---- the runner ---------------------------------------------------------------------------------

@dataclass
class Runner:
    """Runs Cases one process each. `backend` is passed to the child (cuda, cpu or trace) and
    written on rows the parent makes; `timeout_s` is the wall-clock limit per configuration."""

    backend: str = "cpu"
    timeout_s: float = 600.0
    child_cmd: list[str] | None = None
    log_dir: Path | None = None
    gpu_slug: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (resolve 'auto' first); got {self.backend!r}")

    def command(self, case: Case, case_path: Path, out_path: Path) -> list[str]:
        w = case.workload()
        base = launch_command(child_base_command(self.child_cmd), w.world_size, w.zero,
                              free_port() if w.world_size > 1 else 0)
        return [*base, "--case", str(case_path), "--out", str(out_path), "--backend", self.backend]

    def _known(self, case: Case, started_at: str, wall_s: float) -> dict:
        """The parent's row of the case: what it knows before reading the child's (no status)."""
        return new_row(case, self.backend, started_at=started_at, wall_s=wall_s,
                       hostname=socket.gethostname(), gpu_slug=self.gpu_slug, message="")

    def run(self, case: Case, devices: tuple[str, ...] | None = None) -> list[dict]:
        """Run one case in a fresh process; its rows (one per rank), never raising for what the
        child did. `devices` pins the child to those GPUs (CUDA_VISIBLE_DEVICES: indices or UUIDs
        as the user's own CUDA_VISIBLE_DEVICES names them)."""
        started_at, t0 = utc_now(), time.monotonic()
        remove_stale_case_folders()
        with tempfile.TemporaryDirectory(prefix=f"{CASE_FOLDER_PREFIX}{os.getpid()}-") as tmp:
            work = Path(tmp)
            logs = Path(self.log_dir) if self.log_dir else work
            logs.mkdir(parents=True, exist_ok=True)
            case_path, out_path = work / "case.json", work / "result.json"
            case_path.write_text(case.to_json())
            stdout_path, stderr_path = logs / f"{case_slug(case)}.stdout", logs / f"{case_slug(case)}.stderr"
            extra = {"CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else {}
            if case.workload().zero:  # DeepSpeed's launcher and ranks: its CPU accelerator on the host
                extra.update(cuda_device.deepspeed_environment(self.backend))
            rc, timed_out = execute(self.command(case, case_path, out_path), stdout_path, stderr_path,
                                    self.timeout_s, extra)
            raw_rows, problem = read_result_rows(out_path)
            failure = failure_message(rc, timed_out, self.timeout_s, problem, stderr_path)
            known = self._known(case, started_at, time.monotonic() - t0)
            return collect_rows(case, raw_rows, known, failure)


CASE_FOLDER_PREFIX = "gpu-budget-case-"


def remove_stale_case_folders(parent: str | None = None) -> list[Path]:
    """Remove the case folders (tempdir/gpu-budget-case-<pid>-*) of profiler processes that no
    longer run: a parent killed with SIGKILL cannot clean its own. Folders of living processes
    are left alone. Returns what was removed."""
    import shutil

    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{CASE_FOLDER_PREFIX}*-*"):
        pid_text = folder.name[len(CASE_FOLDER_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or not folder.is_dir() or psutil.pid_exists(int(pid_text)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


# ---- a sweep ------------------------------------------------------------------------------------

@dataclass
class SweepOutcome:
    """What one invocation did: cases run, cases already finished, statuses of those run."""

    ran: int = 0
    already_done: int = 0
    statuses: Counter = field(default_factory=Counter)

    def line(self) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items()))
        return f"ran {self.ran} configurations ({counts or 'none'}); {self.already_done} already finished"


def short_id(case_id: str, width: int = 90) -> str:
    return case_id if len(case_id) <= width else case_id[:width - 3] + "..."


def progress_bar(total: int, enabled: bool, desc: str = "profiling"):
    """A tqdm bar on stderr counting configurations, with elapsed and remaining time."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="config", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


def run_sweep(cases: list[Case], runner: Runner, store: RunStore, force: bool = False,
              retry_errors: bool = False, limit: int | None = None, progress: bool = True,
              devices: list[str] | None = None, executor=None) -> SweepOutcome:
    """Run the cases the store has not finished (see store.py), at most `limit` of them, storing
    each case's rows atomically as soon as it ends. With `devices` (--parallel: several GPUs),
    one configuration per GPU runs at once (`run_parallel`); `executor(todo, runner, record)`
    runs them elsewhere (profiler.executors: submitit).""" 
    todo = store.pending(cases, force=force, retry_errors=retry_errors)
    outcome = SweepOutcome(already_done=len(cases) - len(todo))
    if limit is not None:
        todo = todo[:limit]
    bar = progress_bar(len(todo), progress)

    def record_case(case: Case, rows: list[dict]) -> None:
        store.put(case.id, rows)
        status = case_status(rows)
        outcome.ran += 1
        outcome.statuses[status] += 1
        # one line per configuration, with the bar or without it (a log of a run cut short then
        # still says which configurations finished: the first GPU call's log had none)
        wall_s = max((r.get("wall_s") or 0.0) for r in rows)
        note = next((r["message"] for r in rows if r.get("status") != "ok" and r.get("message")), "")
        line = f"{status:<7} {wall_s:6.1f} s  {short_id(case.id)}" + (f"  ({note[:120]})" if note else "")
        if progress:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        bar.update(1)

    try:
        if executor is not None:           # profiler.executors: submitted to a cluster
            executor(todo, runner, record_case)
        elif devices and len(devices) > 1:
            run_parallel(todo, runner, devices, record_case)
        else:
            for case in todo:
                bar.set_postfix_str(short_id(case.id, 60))
                record_case(case, runner.run(case, tuple(devices) if devices else None))
    finally:
        bar.close()
    return outcome


def visible_devices(count: int) -> list[str]:
    """The GPUs a child may be pinned to, as CUDA_VISIBLE_DEVICES names them: the user's own list
    when set (indices, GPU-... UUIDs or MIG-... names, kept as given), else 0..count-1."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def run_parallel(todo: list[Case], runner: Runner, devices: list[str], record_case) -> None:
    """Several configurations at once, each child pinned to its GPUs by CUDA_VISIBLE_DEVICES: a
    single-GPU configuration takes one free GPU, one of N processes takes N (the next in order
    waits until that many are free; one asking more than there are runs alone on all of them
    and fails there, as it would on this node). Results are recorded in the sweep's order,
    whatever order they end in; on Ctrl-C, SIGTERM or SIGHUP every running child is killed, what
    had finished is recorded, and the signal is raised again (the killed ones run on resume)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    free = list(devices)
    pending = list(enumerate(todo))
    running: dict = {}
    finished: dict[int, tuple[Case, list[dict]]] = {}
    next_index = 0

    def flush(upto_gaps: bool) -> None:
        nonlocal next_index
        while next_index in finished:
            record_case(*finished.pop(next_index))
            next_index += 1
        if upto_gaps:           # interrupted: what ended after a case still running, in order
            for index in sorted(finished):
                record_case(*finished.pop(index))

    previous = _install_handlers()
    pool = ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="profiler-gpu")
    try:
        while pending or running:
            while pending:
                index, case = pending[0]
                need = min(case.workload().world_size, len(devices))
                if need > len(free):
                    break
                pending.pop(0)
                taken = sorted(free, key=devices.index)[:need]
                free = [d for d in free if d not in taken]
                running[pool.submit(runner.run, case, tuple(taken))] = (index, case, taken)
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                index, case, taken = running.pop(future)
                free.extend(taken)
                finished[index] = (case, future.result())
            flush(upto_gaps=False)
    except BaseException:
        kill_running()           # the configurations killed mid-way are not recorded: a resume reruns them
        flush(upto_gaps=True)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        _restore_handlers(previous)


# ---- the GPU this machine has ---------------------------------------------------------------------

@dataclass(frozen=True)
class GpuInfo:
    """The first CUDA device as torch sees it: name, total memory (bytes), device count."""

    name: str
    memory_bytes: int
    count: int


_PROBE = ("import json, os, torch\n"
          "sim = os.environ.get('PROFILER_SIMULATED_DEVICE')\n"
          "if sim is not None:\n"
          "    from profiler.device import simulated\n"
          "    s = simulated.spec()\n"
          "    print(json.dumps({'count': s.count, 'name': s.name + ' (simulated)', 'memory_bytes': s.capacity_bytes}))\n"
          "    raise SystemExit(0)\n"
          "ok = torch.cuda.is_available() and torch.cuda.device_count() > 0\n"
          "p = torch.cuda.get_device_properties(0) if ok else None\n"
          "print(json.dumps({'count': torch.cuda.device_count() if ok else 0,\n"
          "                  'name': p.name if ok else '', 'memory_bytes': p.total_memory if ok else 0}))\n")


def detect_gpu(timeout_s: float = 180.0) -> GpuInfo | None:
    """Ask torch in a short-lived subprocess (so this process never holds a CUDA context that
    would sit on the device while children measure); None when there is no usable CUDA GPU."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout_s, cwd=ROOT, env=_child_env())
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError):
        return None
    if info.get("count"):  # cuda-only
        return GpuInfo(info["name"], int(info["memory_bytes"]), int(info["count"]))
    return None
