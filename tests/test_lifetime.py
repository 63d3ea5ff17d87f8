"""Children die with their parent (issue 16 item 3): a real parent process runs
profiler.runner.execute on a long-sleeping child, the parent gets SIGTERM, SIGHUP or SIGKILL, and
the child (and a grandchild in a session of its own, as torchrun starts its workers) must be gone
within a few seconds. Also: the runner's kill reaches descendants in other sessions, and the
child's idle check decides from NVML's process list (fake handles, no GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from profiler import child
from profiler.case import Case
from profiler.device import nvml
from profiler.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 8.0


def alive(pid: int) -> bool:
    """True while the process runs (a zombie is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, within_s: float = GONE_WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def wait_file(path: Path, within_s: float = 20.0) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path.name} never written")


def sleeper(tmp_path: Path, protect: bool, grandchild: bool = False) -> list[str]:
    """A child that records its pid (and optionally starts a grandchild in its own session that
    records its pid), then sleeps; `protect`: it calls profiler.child.die_with_parent first, as
    `python -m profiler.child` does."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        if {protect!r}:
            from profiler.child import die_with_parent
            die_with_parent()
        if {grandchild!r} and len(sys.argv) == 1:
            subprocess.Popen([sys.executable, __file__, "grandchild"], start_new_session=True)
        name = "grandchild.pid" if len(sys.argv) > 1 else "child.pid"
        open(os.path.join({str(tmp_path)!r}, name + ".tmp"), "w").write(str(os.getpid()))
        os.replace(os.path.join({str(tmp_path)!r}, name + ".tmp"), os.path.join({str(tmp_path)!r}, name))
        time.sleep(600)
    """))
    return [sys.executable, str(script)]


def start_parent(tmp_path: Path, cmd: list[str]) -> subprocess.Popen:
    """A parent process (as scripts/profile.py is one) running the child through runner.execute."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys
        from pathlib import Path
        # a terminal's parent: SIGHUP at its default even when the suite runs under nohup, which
        # the runner respects by leaving an ignored SIGHUP ignored
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        sys.path.insert(0, {str(ROOT)!r})
        from profiler.runner import execute
        d = Path({str(tmp_path)!r})
        execute({cmd!r}, d / "child.stdout", d / "child.stderr", 600)
    """))
    return subprocess.Popen([sys.executable, str(script)], cwd=ROOT, start_new_session=True)


def _cleanup(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_parent_takes_its_child_down(tmp_path, sig):
    # an unprotected child: the parent's handlers alone must kill it
    parent = start_parent(tmp_path, sleeper(tmp_path, protect=False))
    pid = wait_file(tmp_path / "child.pid")
    try:
        parent.send_signal(sig)
        code = parent.wait(timeout=20)
        assert wait_gone(pid), f"child {pid} outlived its parent after {sig.name}"
        assert code == 128 + sig  # the parent ended by the signal's path, after the kill
    finally:
        _cleanup(pid, parent.pid)


def test_a_sigkilled_parent_takes_its_child_and_the_childs_other_session_down(tmp_path):
    parent = start_parent(tmp_path, sleeper(tmp_path, protect=True, grandchild=True))
    pid = wait_file(tmp_path / "child.pid")
    grand = wait_file(tmp_path / "grandchild.pid")
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(pid), "child outlived its SIGKILLed parent"
        assert wait_gone(grand), "a worker in its own session outlived the runner"
    finally:
        _cleanup(pid, grand)


def test_the_child_of_a_dead_parent_stops_at_once(tmp_path):
    # the parent died before the child could set its parent-death signal: the runner pid is gone
    script = tmp_path / "orphan.py"
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "from profiler.child import die_with_parent\ndie_with_parent()\ntime.sleep(600)\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True,
                            env={**os.environ, child.PARENT_ENV: str(dead.pid)})
    try:
        assert proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        _cleanup(proc.pid)


def test_the_timeout_kill_reaches_workers_in_their_own_session(tmp_path):
    # torchrun starts its workers with start_new_session: killpg of the child's group misses them
    cmd = sleeper(tmp_path, protect=False, grandchild=True)
    wrapper = tmp_path / "child.py"  # Runner passes --case/--out/--backend: drop them
    wrapper.write_text(f"import os, sys\nos.execv(sys.executable, {cmd!r})\n")
    case = Case(str(ROOT / "tests" / "data" / "tiny-llama.json"), {"precision": "fp32", "seq": 64},
                warmup=1, steps=2)
    (row,) = Runner(child_cmd=[sys.executable, str(wrapper)], timeout_s=3).run(case)
    assert row["status"] == "error" and "timeout" in row["message"]
    grand = wait_file(tmp_path / "grandchild.pid")
    try:
        assert wait_gone(grand, 3.0), "the worker in its own session survived the timeout"
    finally:
        _cleanup(grand)


def test_the_child_env_names_the_runner():
    from profiler.runner import _child_env

    assert _child_env()[child.PARENT_ENV] == str(os.getpid())


# ---------------------------------------------------------------- the GPU is idle before measuring


class FakeHandle:
    """An NvmlDevice stand-in whose process list changes with each call (None: NVML cannot say)
    and whose used memory is `used` bytes (None: the reading fails)."""

    def __init__(self, *lists, used=100 * 2**20):
        self.lists, self.used = list(lists), used

    def processes(self):
        return self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]

    def used_bytes(self):
        if self.used is None:
            raise RuntimeError("NVML cannot read memory")
        return self.used


def test_busy_processes_leaves_out_this_process_and_the_expected_ones():
    me = os.getpid()
    handle = FakeHandle([(me, 100), (11, 2**30), (12, None)])
    assert nvml.busy_processes(handle, {12}) == [(11, 2**30)]
    assert nvml.busy_processes(FakeHandle(None, used=None)) is None  # NVML cannot say
    # no process listed (a container's pid namespace): the device's memory must be back at rest
    assert nvml.busy_processes(FakeHandle([])) == []
    assert nvml.busy_processes(FakeHandle(None, used=3 * 2**30)) == [(0, 3 * 2**30)]
    assert nvml.busy_processes(None) is None


def test_wait_until_idle_waits_for_a_leftover_to_go_then_gives_up():
    slept = []
    clock = iter(range(100)).__next__
    # a killed run's process frees the device on the third look
    assert nvml.wait_until_idle(FakeHandle([(7, 1)], [(7, 1)], []), timeout_s=10, sleep=slept.append,
                                clock=clock) == []
    assert len(slept) == 2
    # still there when the time is up: what holds it
    assert nvml.wait_until_idle(FakeHandle([(7, 2**31)]), timeout_s=3, sleep=slept.append,
                                clock=iter(range(100)).__next__) == [(7, 2**31)]
    assert nvml.wait_until_idle(FakeHandle(None, used=None), timeout_s=3, sleep=slept.append) is None


def test_check_idle_refuses_a_busy_device_and_passes_an_unknown_one(monkeypatch):
    monkeypatch.setattr(child, "launcher_family", lambda: set())
    with pytest.raises(child.DeviceBusy, match="pid 7 .2048 MiB."):
        child.check_idle(FakeHandle([(7, 2 * 2**30)]), wait_s=0)
    child.check_idle(FakeHandle([]), wait_s=0)
    child.check_idle(FakeHandle(None), wait_s=0)  # containers: nothing listed, memory at rest
    child.check_idle(FakeHandle(None, used=None), wait_s=0)  # NVML cannot say at all
    with pytest.raises(child.DeviceBusy, match="processes NVML does not list .4096 MiB."):
        child.check_idle(FakeHandle([], used=4 * 2**30), wait_s=0)
    child.check_idle(None, wait_s=0)
    assert child.classify(child.DeviceBusy("GPU not idle"))[0] == "error"
