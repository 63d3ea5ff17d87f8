"""The child process contract (profiler/child.py) on CPU.

Real subprocesses (`python -m profiler.child`) on tiny-llama: full, LoRA, QLoRA (nf4: bitsandbytes
trains on CPU; 4-bit *inference* on CPU needs out_features divisible by 32, which tiny-llama's
176-wide MLP is not, so it is not run), gradient checkpointing and inference with new tokens.
In-process (`child.main` with a patched step or package lookup): oom, error and skipped rows, a
malformed case, an unwritable output, atomic writes and the multi-rank file names.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiler import build, child, record, steps
from profiler.case import Case

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")
CUDA_COLUMNS = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "context_bytes",
                "device_used_source")
SUBPROCESS_CASES = {
    "full": {"batch": 2, "seq": 32},
    "lora": {"method": "lora", "batch": 2, "seq": 32},
    "qlora": {"method": "qlora", "quant": "nf4", "batch": 2, "seq": 32},
    "ckpt": {"grad_ckpt": True, "batch": 2, "seq": 32},
    "inference": {"method": "inference", "batch": 2, "seq": 16, "new_tokens": 4},
}


def _write_case(folder: Path, name: str, settings: dict, warmup: int = 1, steps_: int = 3) -> Path:
    path = folder / f"{name}.case.json"
    path.write_text(Case(TINY, settings, warmup, steps_).to_json())
    return path


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every subprocess case, started together: {name: (returncode, rows, case)}."""
    folder = tmp_path_factory.mktemp("child")
    procs = {}
    for name, settings in SUBPROCESS_CASES.items():
        case_path = _write_case(folder, name, settings)
        out = folder / f"{name}.json"
        cmd = [sys.executable, "-m", "profiler.child", "--case", str(case_path), "--out", str(out),
               "--backend", "cpu"]
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True), out, case_path)
    results = {}
    for name, (proc, out, case_path) in procs.items():
        _, err = proc.communicate(timeout=600)
        rows = json.loads(out.read_text()) if out.exists() else err[-2000:]
        results[name] = (proc.returncode, rows, Case.from_json(case_path.read_text()))
    return results


def _row(runs, name) -> dict:
    code, rows, _ = runs[name]
    assert code == 0, rows
    assert isinstance(rows, list) and len(rows) == 1
    return rows[0]


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_subprocess_row_is_complete_and_ok(runs, name):
    row = _row(runs, name)
    case = runs[name][2]
    w = case.workload()
    assert sorted(row) == sorted(record.COLUMN_NAMES)
    record.check_row(row)
    assert (row["status"], row["message"], row["backend"]) == ("ok", "", "cpu")
    assert (row["id"], row["model"], row["model_type"]) == (w.id, TINY, "llama")
    assert (row["method"], row["batch"], row["seq"], row["grad_ckpt"]) == (w.method, w.batch, w.seq, w.grad_ckpt)
    assert (row["rank"], row["world_size"], row["warmup"], row["steps"]) == (0, 1, 1, 3)
    for name_ in CUDA_COLUMNS:
        assert row[name_] is None, name_  # not measured on cpu: never 0
    assert row["mfu"] is None  # no GPU table row for a CPU
    assert isinstance(row["host_rss_bytes"], int) and row["host_rss_bytes"] > 50_000_000
    assert 0 < row["step_s_min"] <= row["step_s"] <= row["step_s_max"]
    assert row["step_spread"] == pytest.approx((row["step_s_max"] - row["step_s_min"]) / row["step_s"])
    assert row["wall_s"] > 3 * row["step_s_min"]
    assert row["started_at"].endswith("+00:00")


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_subprocess_tokens_per_s(runs, name):
    row = _row(runs, name)
    w = runs[name][2].workload()
    tokens = w.batch * (w.seq + w.new_tokens) if not w.training else w.batch * w.seq * w.grad_accum
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"], rel=1e-9)


def test_subprocess_environment_is_filled(runs):
    import peft
    import transformers

    row = _row(runs, "full")
    assert row["torch"] == torch.__version__
    assert row["transformers"] == transformers.__version__
    assert row["peft"] == peft.__version__
    assert row["bitsandbytes"] and row["deepspeed"]  # installed in this venv
    assert row["hostname"] == socket.gethostname()
    assert row["gpu_name"] and row["gpu_slug"] is None and row["gpu_memory_bytes"] is None


def test_subprocess_weights_bytes_are_the_parameter_storage(runs):
    # Expected from a meta-device build (no storage), independent of the child's reading.
    case = runs["full"][2]
    with torch.device("meta"):
        model = build.build_model(case.config(), case.workload(), "meta")
    params = sum(p.numel() for p in model.parameters())
    assert _row(runs, "full")["weights_bytes"] == 2 * params  # bf16
    # LoRA r=16 on q_proj (64->64) and v_proj (64->32) in 2 layers, adapters in fp32
    adapters = 2 * 16 * ((64 + 64) + (64 + 32))
    assert _row(runs, "lora")["weights_bytes"] == 2 * params + 4 * adapters


def test_subprocess_inference_times_prefill_and_decode(runs):
    row = _row(runs, "inference")
    assert 0 < row["prefill_s"] <= row["step_s_max"]
    assert 0 < row["decode_token_s"] and 3 * row["decode_token_s"] <= row["step_s_max"]


def test_training_rows_have_no_inference_columns(runs):
    for name in ("full", "lora", "qlora", "ckpt"):
        row = _row(runs, name)
        assert row["prefill_s"] is None and row["decode_token_s"] is None
        assert row["host_offload_bytes"] is None


# ---------------------------------------------------------------- in-process: statuses


def _main(tmp_path, settings, *, case_text=None, backend="cpu") -> tuple[int, list]:
    case_path = tmp_path / "case.json"
    case_path.write_text(case_text if case_text is not None else Case(TINY, settings, 0, 1).to_json())
    out = tmp_path / "out.json"
    code = child.main(["--case", str(case_path), "--out", str(out), "--backend", backend])
    return code, json.loads(out.read_text())


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _raiser(exc):
    def step(*args, **kwargs):
        raise exc
    return step


def test_oom_in_the_step_is_recorded_as_oom(tmp_path, monkeypatch, single_process):
    text = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB\nmore"
    monkeypatch.setattr(steps, "forward_backward", _raiser(torch.OutOfMemoryError(text)))
    code, rows = _main(tmp_path, {"seq": 16})
    assert code == 0 and len(rows) == 1
    row = rows[0]
    assert row["status"] == "oom"
    assert row["message"] == text.splitlines()[0]
    assert row["step_s"] is None and row["peak_allocated_bytes"] is None
    assert row["torch"] == torch.__version__  # the environment is there for failures too
    assert row["id"] == Case(TINY, {"seq": 16}).id


def test_oom_in_inference_prefill_is_recorded_as_oom(tmp_path, monkeypatch, single_process):
    monkeypatch.setattr(steps, "prefill", _raiser(RuntimeError("CUDA error: out of memory")))
    code, rows = _main(tmp_path, {"method": "inference", "seq": 8, "new_tokens": 2})
    assert (code, rows[0]["status"], rows[0]["message"]) == (0, "oom", "CUDA error: out of memory")


@pytest.mark.parametrize("exc,status,message", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried"), "oom", "CUDA out of memory. Tried"),
    (RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"), "oom",
     "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory"),
     "oom", "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory"),
    (MemoryError(), "oom", "MemoryError: host"),
    (build.MissingPackage("deepspeed is not installed (needed for zero 2)"), "skipped",
     "deepspeed is not installed (needed for zero 2)"),
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with..."), "error",
     "RuntimeError: CUDA error: an illegal memory access was encountered"),
    (ValueError("Class validation error for validator 'validate_rope':\n  ValueError: odd"), "error",
     "ValueError: Class validation error for validator 'validate_rope': ValueError: odd"),
])
def test_classify(exc, status, message):
    assert child.classify(exc) == (status, message)


def test_an_exception_is_an_error_row_with_its_message(tmp_path, monkeypatch, single_process):
    monkeypatch.setattr(steps, "forward_backward", _raiser(KeyError("boom")))
    code, rows = _main(tmp_path, {"seq": 16})
    assert (code, rows[0]["status"], rows[0]["message"]) == (0, "error", "KeyError: 'boom'")


@pytest.mark.parametrize("settings,package,words", [
    ({"method": "lora", "seq": 16}, "peft", "method lora"),
    ({"method": "qlora", "quant": "nf4", "seq": 16}, "bitsandbytes", "quant nf4"),
    ({"optimizer": "adamw-8bit", "seq": 16}, "bitsandbytes", "optimizer adamw-8bit"),
    ({"zero": 2, "seq": 16}, "deepspeed", "zero 2"),
])
def test_a_missing_package_skips_naming_it(tmp_path, monkeypatch, single_process, settings, package, words):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    code, rows = _main(tmp_path, settings)
    row = rows[0]
    assert (code, row["status"]) == (0, "skipped")
    assert row["message"] == f"{package} is not installed (needed for {words})"
    assert row["id"] == Case(TINY, settings).id


def test_only_configurations_needing_the_missing_package_are_skipped(tmp_path, monkeypatch, single_process):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    code, rows = _main(tmp_path, {"seq": 16})
    assert (code, rows[0]["status"]) == (0, "ok")


@pytest.mark.parametrize("text,words", [
    ("{not json", "JSONDecodeError"),
    ('{"model": "x.json", "colour": 1}', "unknown case keys: colour"),
    ('{"model": "/no/such/config.json"}', "InputError: config file not found: /no/such/config.json"),
    ('{"model": "%s", "settings": {"method": "dance"}}' % TINY, "method must be one of"),
    ('[1, 2]', "ValueError: a case is a JSON object (Case.to_json()); got a list"),
])
def test_a_malformed_case_is_an_error_row(tmp_path, single_process, text, words):
    code, rows = _main(tmp_path, None, case_text=text)
    row = record.check_row(rows[0])
    assert (code, row["status"], row["backend"]) == (0, "error", "cpu")
    assert words in row["message"]
    assert row["torch"] == torch.__version__ and row["wall_s"] > 0


def test_a_case_for_several_processes_refuses_one(tmp_path, single_process):
    code, rows = _main(tmp_path, {"gpus": 2, "zero": 2, "seq": 16})
    assert (code, rows[0]["status"]) == (0, "error")
    assert "needs 2 processes" in rows[0]["message"]


def test_cuda_backend_without_a_gpu_is_an_error_row(tmp_path, single_process):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, rows = _main(tmp_path, {"seq": 16}, backend="cuda")
    assert (code, rows[0]["status"], rows[0]["backend"]) == (0, "error", "cuda")
    assert "cuda" in rows[0]["message"]


def test_unwritable_output_exits_2_with_one_line(tmp_path, capsys, single_process):
    case_path = _write_case(tmp_path, "c", {"seq": 16})
    code = child.main(["--case", str(case_path), "--out", str(tmp_path / "missing" / "out.json")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot write" in err


# ---------------------------------------------------------------- files


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    path.write_text("previous complete result")
    row = {**record.empty_row(), "status": "ok", "backend": "cpu"}

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(child.os, "replace", broken_replace)
    with pytest.raises(OSError):
        child.write_rows(path, [row])
    assert path.read_text() == "previous complete result"  # never half a file
    assert list(tmp_path.iterdir()) == [path]              # no temporary left behind
    monkeypatch.undo()
    child.write_rows(path, [row])
    assert json.loads(path.read_text()) == [row]
    assert list(tmp_path.iterdir()) == [path]


def test_write_refuses_a_row_that_would_lie(tmp_path):
    row = {**record.empty_row(), "status": "ok", "backend": "cpu", "peak_allocated_bytes": 0}
    with pytest.raises(ValueError):
        child.write_rows(tmp_path / "out.json", [row])
    assert not (tmp_path / "out.json").exists()


def test_rank_file_names():
    assert child.out_path("/r/RESULT.json", 0, 1) == Path("/r/RESULT.json")
    assert child.out_path("/r/RESULT.json", 0, 2) == Path("/r/RESULT.rank0.json")
    assert child.out_path("/r/RESULT.json", 1, 2) == Path("/r/RESULT.rank1.json")


def test_a_failed_rank_writes_its_file_then_exits_3(tmp_path, monkeypatch):
    # Rank 1 of 2 (no peer runs: the world check fails before any collective).
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(child.os, "_exit", fake_exit)
    case_path = _write_case(tmp_path, "c", {"seq": 16})
    with pytest.raises(SystemExit) as stop:
        child.main(["--case", str(case_path), "--out", str(tmp_path / "R.json"), "--backend", "cpu"])
    assert stop.value.code == 3
    assert not (tmp_path / "R.json").exists()
    rows = json.loads((tmp_path / "R.rank1.json").read_text())
    assert (rows[0]["rank"], rows[0]["world_size"], rows[0]["status"]) == (1, 2, "error")


def test_a_row_check_row_refuses_becomes_an_error_row(tmp_path):
    row = {**record.empty_row(), "status": "ok", "backend": "cpu", "host_rss_bytes": 0, "step_s": 0.1}
    written = child.write_checked(tmp_path / "out.json", row)
    assert written["status"] == "error" and "host_rss_bytes" in written["message"]
    assert json.loads((tmp_path / "out.json").read_text()) == [written]
    assert written["host_rss_bytes"] is None and written["step_s"] == 0.1


def test_allocator_retries_are_recorded_and_flagged(tmp_path, monkeypatch, single_process):
    # issue 16 item 6: a run near the limit retries cudaMalloc; the row must say so
    from profiler import measure

    counter = iter([2, 5])
    monkeypatch.setattr(measure.cuda, "alloc_retries", lambda d: next(counter))
    code, (row,) = _main(tmp_path, {"seq": 16})
    assert code == 0 and row["status"] == "ok"
    assert row["alloc_retries"] == 3 and "allocator retried 3 time(s)" in row["message"]


def test_cpu_rows_leave_retries_and_baseline_unmeasured(tmp_path, single_process):
    code, (row,) = _main(tmp_path, {"seq": 16})
    assert row["status"] == "ok" and row["message"] == ""
    assert row["alloc_retries"] is None and row["device_baseline_bytes"] is None


def test_after_a_sticky_cuda_error_the_row_keeps_the_gpu_name_read_before(monkeypatch):
    # issue 16 item 8: not the CPU's name on a row measured on a GPU
    gpu = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_slug": "h100-80gb", "gpu_memory_bytes": 85 * 2**30}
    calls = []

    def environment(device):
        calls.append(device)
        if device == "cpu":
            return {"gpu_name": "AMD EPYC", "gpu_slug": None, "gpu_memory_bytes": None, "torch": "x"}
        if len(calls) > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {**gpu, "torch": "x"}

    monkeypatch.setattr(child, "environment", environment)
    monkeypatch.setattr(child, "host_environment", lambda: environment("cpu"))   # asks no device
    monkeypatch.setattr(child, "_device_fields", {})
    assert child.safe_environment("cuda:0")["gpu_name"] == gpu["gpu_name"]  # read while healthy
    after = child.safe_environment("cuda:0")
    assert {k: after[k] for k in gpu} == gpu and after["torch"] == "x"
    # nothing read before the error: not measured, never the CPU's name
    assert child.safe_environment("cuda:1")["gpu_name"] is None
    assert child.safe_environment("cpu")["gpu_name"] == "AMD EPYC"


def test_a_training_row_times_its_clipping_and_optimizer_step(tmp_path, single_process):
    """The step is three timed phases (forward and backward, the HF Trainer's gradient clipping,
    optimizer step): `clip_s` and `optimizer_s` are the last two's medians, parts of the whole step."""
    code, rows = _main(tmp_path, {"seq": 16})
    row = rows[0]
    assert code == 0 and row["status"] == "ok"
    assert 0 < row["optimizer_s"] < row["step_s"]
    assert 0 < row["clip_s"] < row["step_s"]
    assert row["clip_s"] + row["optimizer_s"] < row["step_s"]


def test_the_clipping_phase_clips_as_the_trainer_does():
    """steps.clip_gradients scales the gradients to a total norm of max_grad_norm (1.0), as
    torch.nn.utils.clip_grad_norm_ in the HF Trainer does, and leaves parameters without one alone."""
    import torch

    from profiler import steps

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.grad = torch.full((4, 4), 3.0)
    model[1].weight.grad = torch.full((1, 4), 4.0)
    steps.clip_gradients(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(total) == pytest.approx(steps.MAX_GRAD_NORM, rel=1e-5)
    assert model[0].bias.grad is None
