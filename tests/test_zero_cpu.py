"""DeepSpeed ZeRO 1/2/3 on CPU (DeepSpeed's CPU accelerator, gloo): profiler/zero.py and the child
under DeepSpeed's launcher.

What each rank holds is checked against counts made without DeepSpeed (the parameters of a
transformers model built on `meta`) and DeepSpeed's padding rules (0.19.8):
- stages 1/2 flatten all trainable parameters into one group padded to a multiple of
  2 x world size (stage_1_and_2.py: `nccl_start_alignment_factor = 2`, alignment = 2 x dp), and
  each rank holds 1/world of it;
- stage 3 partitions every parameter on its own: ceil(numel / world) elements per rank.

Time: about 1 minute on 2 cores once DeepSpeed's ops are compiled. The first run on a machine
compiles FusedAdam and DeepSpeedCPUAdam with g++ (about 85 s each on 2 cores) into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions): cache that folder in CI.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiler import build, zero
from profiler.case import Case

from tests.tiny_configs import ODD, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")


def _odd_config(folder: Path) -> str:
    """tiny-llama with odd sizes (hidden 45, vocab 1001, MLP 99), so the padding rules matter:
    most parameters and the total have an odd number of elements."""
    return str(tiny_llama(folder, "odd", **ODD))


def _numels(case: Case) -> list[int]:
    """Element count of every parameter, from a meta build without ZeRO (no DeepSpeed involved)."""
    w = case.with_(zero=0, offload="none", gpus=1).workload()
    model = build.build_model(case.config(), w, "meta")
    return [p.numel() for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def world1():
    """A single-process gloo group on DeepSpeed's CPU accelerator for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(zero._free_port())),
                            ("DS_ACCELERATOR", "cpu")):
            mp.setenv(name, value)  # restored when the module's tests are done
        zero.init_distributed("gloo")
        yield
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        zero.remove_shm_buffer()   # DeepSpeed's CPU allreduce buffer, as the child removes it


# ---------------------------------------------------------------- config


def test_config_follows_the_workload():
    w = Case(TINY, {"zero": 3, "offload": "optimizer+params", "batch": 2, "grad_accum": 4}).workload()
    cfg = zero.ds_config(w)
    # bucket sizes: what the HF Trainer fills for "auto" from hidden_size 64 (transformers
    # integrations/deepspeed.py: hidden^2, int(0.9 hidden^2), 10 hidden)
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
                                        "stage3_param_persistence_threshold": 640,
                                        "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                        "offload_param": {"device": "cpu", "pin_memory": True}}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["optimizer"]["type"] == "AdamW"
    opt = zero.ds_config(Case(TINY, {"zero": 2, "offload": "optimizer"}).workload())["zero_optimization"]
    assert opt == {"stage": 2, "reduce_bucket_size": 4096, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    fp16 = zero.ds_config(Case(TINY, {"zero": 1, "precision": "amp-fp16"}).workload())
    assert fp16["fp16"] == {"enabled": True} and fp16["bf16"] == {"enabled": False}
    fp32 = zero.ds_config(Case(TINY, {"zero": 1, "precision": "fp32"}).workload())
    assert not fp32["fp16"]["enabled"] and not fp32["bf16"]["enabled"]


def test_unsupported_zero_workloads_are_refused():
    with pytest.raises(ValueError, match="optimizer sgd"):
        zero.check_supported(Case(TINY, {"zero": 2, "optimizer": "sgd"}).workload())
    with pytest.raises(ValueError, match="ZeRO training"):
        zero.check_supported(Case(TINY, {"zero": 0}).workload())


# ---------------------------------------------------------------- DeepSpeed's compiled ops


@pytest.fixture
def no_cuda_toolkit(tmp_path, monkeypatch):
    """No nvcc where torch/DeepSpeed look: CUDA_HOME/CUDA_PATH unset, PATH without nvcc, and the
    /usr/local/cuda guess pointed at a folder that does not exist."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    real_exists = os.path.exists
    monkeypatch.setattr(cpp.os.path, "exists",
                        lambda p: False if str(p).startswith("/usr/local/cuda") else real_exists(p))


def _fake_toolkit(folder: Path) -> Path:
    nvcc = folder / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_without_a_cuda_toolkit_fused_adam_falls_back_to_torch_adam(no_cuda_toolkit):
    # FusedAdam is JIT-compiled with nvcc on cuda: without a toolkit DeepSpeed raises
    # "CUDA_HOME does not exist" and the row was `error`; now torch.optim.AdamW runs, and says so.
    w = Case(TINY, {"zero": 2}).workload()
    assert zero.cuda_toolkit() is None
    note = zero.adam_fallback(w, "cuda:0")
    assert note and "nvcc" in note and "torch_adam" in note and "\n" not in note
    assert zero.ds_config(w, torch_adam=True)["optimizer"] == {"type": "AdamW",
                                                               "params": {"lr": zero.LR, "torch_adam": True}}
    assert "torch_adam" not in zero.ds_config(w)["optimizer"]["params"]
    # DeepSpeedCPUAdam (optimizer offload) and the CPU accelerator compile with g++: no fallback
    assert zero.adam_fallback(Case(TINY, {"zero": 2, "offload": "optimizer"}).workload(), "cuda:0") is None
    assert zero.adam_fallback(w, "cpu") is None


def test_a_cuda_toolkit_keeps_fused_adam(tmp_path, no_cuda_toolkit, monkeypatch):
    nvcc = _fake_toolkit(tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(nvcc.parents[1]))
    assert zero.cuda_toolkit() == str(nvcc)
    assert zero.adam_fallback(Case(TINY, {"zero": 2}).workload(), "cuda:0") is None
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", str(nvcc.parent))  # found on PATH, as torch finds it
    assert zero.cuda_toolkit() == str(nvcc)


def test_deepspeed_runs_torch_adam_when_configured(world1, monkeypatch):
    # the fallback as DeepSpeed applies it (cpu here; `adam_fallback` decides it on cuda)
    monkeypatch.setattr(zero, "adam_fallback", lambda w, device: "no toolkit")
    case = Case(TINY, {"zero": 2, "seq": 16})
    engine, _ = zero.build(case.config(), case.workload(), "cpu")
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW


def test_stale_build_locks_are_removed(tmp_path):
    # torch's FileBaton: <root>/<op>/lock (TORCH_EXTENSIONS_DIR) or <root>/<python>_<accel>/<op>/lock
    # (the default root); a build killed midway leaves it and later builds wait on it forever.
    old_lock, fresh_lock = tmp_path / "py311_cu124" / "fused_adam" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (old_lock, fresh_lock):
        lock.parent.mkdir(parents=True)
        lock.touch()
    (old_lock.parent / "build.ninja").touch()
    hour_ago = old_lock.stat().st_mtime - 3600
    os.utime(old_lock, (hour_ago, hour_ago))
    assert zero.clear_stale_locks(tmp_path, older_than_s=900) == [old_lock]
    assert not old_lock.exists() and fresh_lock.exists() and (old_lock.parent / "build.ninja").exists()
    assert zero.clear_stale_locks(tmp_path, older_than_s=0, ops=("fused_adam",)) == []
    assert zero.clear_stale_locks(tmp_path, older_than_s=0, ops=("cpu_adam",)) == [fresh_lock]
    assert zero.clear_stale_locks(tmp_path / "missing") == []


def test_extensions_dir_follows_torch(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert zero.extensions_dir() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert zero.extensions_dir() == Path(get_default_build_root())


def test_prepare_ops_builds_each_needed_op_once(tmp_path, monkeypatch, no_cuda_toolkit):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = []
    monkeypatch.setattr(zero, "_build_op", lambda op, backend, timeout_s: built.append((op, backend)) or f"{op} ok")
    workloads = [Case(TINY, s).workload() for s in ({"zero": 2}, {"zero": 3}, {"zero": 3, "offload": "optimizer"},
                                                   {"zero": 0})]
    assert zero.ops_needed(workloads) == ["cpu_adam", "fused_adam"]
    assert zero.prepare_ops(workloads, "cpu") == ["cpu_adam ok", "fused_adam ok"]
    assert built == [("cpu_adam", "cpu"), ("fused_adam", "cpu")]
    built.clear()
    lines = zero.prepare_ops(workloads, "cuda")  # no toolkit: FusedAdam is not built
    assert built == [("cpu_adam", "cuda")]
    assert any("no CUDA toolkit" in line and "torch_adam" in line for line in lines)
    assert zero.prepare_ops([Case(TINY, {}).workload()], "cpu") == []
    assert zero.prepare_ops(workloads, "trace") == []


def test_a_build_past_its_time_limit_is_killed_and_its_lock_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # as the killed build leaves it
    line = zero._build_op("cpu_adam", "cpu", timeout_s=0.5)  # importing deepspeed alone takes longer
    assert "timed out" in line
    assert not lock.exists()


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_holds_every_trainable_parameter(world1, stage):
    case = Case(TINY, {"zero": stage, "seq": 16})
    w = case.workload()
    n = sum(_numels(case))
    engine, model = zero.build(case.config(), w, "cpu")
    assert type(engine.optimizer.optimizer).__name__ == "FusedAdam"  # DeepSpeed's own AdamW
    before = [t.clone() for t in zero.master_partitions(engine.optimizer)]
    zero.train_phase(engine, build.make_batch(w, 1000, "cpu"), w)()
    after = zero.master_partitions(engine.optimizer)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the step updated the weights
    parts = zero.partitions(engine)
    assert n % 2 == 0  # so stages 1/2 pad nothing at world 1
    assert (parts.stage, parts.world_size) == (stage, 1)
    assert parts.master_numel == n
    assert parts.state_numel == {"exp_avg": n, "exp_avg_sq": n}
    assert parts.param_numel == n
    assert zero.host_offload_bytes(engine, "none") is None


def test_stage3_builds_the_model_under_zero_init(world1):
    # As the HF Trainer does (HfDeepSpeedConfig + zero.Init): every parameter is partitioned as it
    # is created, before deepspeed.initialize; outside the context a build is a plain model.
    case = Case(TINY, {"zero": 3, "seq": 16})
    w = case.workload()
    with zero._hf_zero3(zero.ds_config(w), True):
        model = build.build_model(case.config(), w, "cpu")
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    assert sum(p.ds_numel for p in model.parameters()) == sum(_numels(case))
    plain = build.build_model(case.config(), w, "cpu")
    assert not any(hasattr(p, "ds_id") for p in plain.parameters())


def test_one_process_stage2_pads_the_flat_group(world1, tmp_path):
    case = Case(_odd_config(tmp_path), {"zero": 2, "seq": 16})
    n = sum(_numels(case))
    engine, _ = zero.build(case.config(), case.workload(), "cpu")
    w = case.workload()
    zero.train_phase(engine, build.make_batch(w, 1001, "cpu"), w)()
    assert n % 2 == 1
    assert zero.partitions(engine).master_numel == n + 1  # a multiple of 2 x world


def test_one_process_offload_uses_cpu_adam_and_counts_host_bytes(world1):
    case = Case(TINY, {"zero": 3, "offload": "optimizer+params", "seq": 16})
    w = case.workload()
    n = sum(_numels(case))
    engine, _ = zero.build(case.config(), w, "cpu")
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    zero.train_phase(engine, build.make_batch(w, 1000, "cpu"), w)()
    # per element on the host: fp32 master 4 + its fp32 gradient 4 + Adam 8
    # + bf16 gradient partition 2 (stage 3) + bf16 parameter partition 2 (param offload)
    assert zero.host_offload_bytes(engine, w.offload) == n * (4 + 4 + 8 + 2 + 2)


# ---------------------------------------------------------------- two processes


def test_two_ranks_under_the_deepspeed_launcher_each_hold_their_partition(tmp_path):
    case = Case(_odd_config(tmp_path), {"zero": 3, "offload": "optimizer", "gpus": 2, "seq": 16}, 1, 2)
    numels = _numels(case)
    per_rank = sum(math.ceil(n / 2) for n in numels)  # stage 3: each parameter padded on its own
    case_path, out = tmp_path / "case.json", tmp_path / "R.json"
    case_path.write_text(case.to_json())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    port = zero._free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(port), "--no_local_rank", "--module", "profiler.child",
           "--case", str(case_path), "--out", str(out), "--backend", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # each rank removed its shared-memory allreduce buffer (DeepSpeed's CPU comm op leaves them)
    assert not list(zero.SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not out.exists()  # several processes: rank files only
    rows = [json.loads((tmp_path / f"R.rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rank_rows in enumerate(rows):
        assert len(rank_rows) == 1
        row = rank_rows[0]
        assert (row["status"], row["rank"], row["world_size"], row["backend"]) == ("ok", rank, 2, "cpu")
        # offloaded: fp32 master 4 + fp32 gradient 4 + Adam 8 + bf16 gradient partition 2
        assert row["host_offload_bytes"] == 18 * per_rank
        assert row["weights_bytes"] == 2 * per_rank  # this rank's bf16 partitions
    assert sum(numels) / 2 < per_rank < sum(numels) / 2 + len(numels) / 2  # half, plus padding


def test_the_shared_memory_buffer_of_this_rank_is_removed(tmp_path):
    # DeepSpeed's CPU comm op names each rank's buffer deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    mine = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29512_1"
    other = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29512_0"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512", "RANK": "1"}
    assert zero.remove_shm_buffer(env, tmp_path) == mine
    assert not mine.exists() and other.exists()          # another rank's stays: it removes its own
    assert zero.remove_shm_buffer(env, tmp_path) is None  # already gone
    assert zero.remove_shm_buffer({}, tmp_path) is None   # no process group: nothing named
