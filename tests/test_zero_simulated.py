"""ZeRO and DDP with two ranks on the simulated device (issue 16): the profiler's own sweep path
(runner.run_sweep -> run_parallel -> Runner.run -> runner.launch_command: DeepSpeed's launcher for
ZeRO 2 and 3, torchrun for DDP; the three cases at once on six simulated GPUs, each pinned to two,
as `profile.py --parallel` runs them) with PROFILER_SIMULATED_DEVICE set, each rank a
`profiler.child --backend cuda` measuring through profiler.device (its own simulated allocator and
NVML entry; gloo stands in for NCCL, DeepSpeed runs its CPU accelerator), every row stored in the
run folder with backend `simulated`.

Expected numbers never come from the profiler:
- what each rank holds, from the parameters of a `meta` build counted here and DeepSpeed's
  partitioning rules (0.19.8, as tests/test_zero_cpu.py states them): stages 1/2 flatten every
  trainable parameter into one group padded to a multiple of 2 x world and keep 1/world of it;
  stage 3 keeps ceil(numel / world) of every parameter;
- the model states per rank from those partitions (the estimator's rules, estimator/states.py:
  DDP under AMP 4 + 4 + 8 B per parameter plus DDP's 4 B bucket copy of the gradients; DeepSpeed
  mixed precision 2 B weights and 2 + 4 + 4 + 8 B of gradients, fp32 gradient, master and Adam
  per partition element) and the estimator's peak (`estimate_memory`);
- the DDP peak from the tracer: one process's traced step plus DDP's gradient buckets.

The model: tiny-llama widened and deepened (0.8 M parameters, hidden 128, 4 layers, vocab 256), so
model states outweigh activations and DeepSpeed's gathered layers and buffers, as on real models:
then stage 3 holds less than stage 2, which holds less than DDP.

Time: three launches at once, about 35 s on 2 cores (2.5 GB of memory at most) once DeepSpeed's
ops are compiled (see tests/test_zero_cpu.py for TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from estimator.memory import estimate_memory
from profiler import build, runner
from profiler.case import Case
from profiler.device import simulated
from profiler.store import RunStore
from profiler.trace import trace

from tests.tiny_configs import tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny-llama.json"
SETTINGS = {"precision": "amp-bf16", "seq": 32, "batch": 1, "gpus": 2}
STAGES = (0, 2, 3)
WORLD = 2


def _deep_config(folder: Path) -> str:
    return str(tiny_llama(folder, "deep", hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                          vocab_size=256, num_attention_heads=4, num_key_value_heads=2))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """{stage: (case, [row of rank 0, row of rank 1])} as the run folder stores them."""
    folder = tmp_path_factory.mktemp("zero-sim")
    model = _deep_config(folder)
    cases = {z: Case(model, {**SETTINGS, "zero": z}, warmup=1, steps=1) for z in STAGES}
    with pytest.MonkeyPatch.context() as mp:
        # three simulated pairs of GPUs: the cases run at once, each pinned to its pair (--parallel)
        mp.setenv(simulated.ENV, json.dumps({"count": WORLD * len(STAGES)}))
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        store = RunStore(folder / "run")
        outcome = runner.run_sweep(list(cases.values()), runner.Runner(backend="cuda", timeout_s=300),
                                   store, progress=False, devices=runner.visible_devices(WORLD * len(STAGES)))
    assert outcome.statuses == {"ok": len(STAGES)}, store.rows()
    stored = RunStore(folder / "run")       # read back from results.csv
    return {z: (case, sorted(stored.rows_of(case.id), key=lambda r: r["rank"])) for z, case in cases.items()}


def _numels(case: Case) -> list[int]:
    """Element count of every trainable parameter, from a meta build without DeepSpeed."""
    w = case.with_(zero=0, gpus=1).workload()
    return [p.numel() for p in build.build_model(case.config(), w, "meta").parameters() if p.requires_grad]


def _partition(case: Case, stage: int) -> int:
    """Elements of the flat partition one rank holds (DeepSpeed's padding included)."""
    numels = _numels(case)
    if stage == 3:
        return sum(math.ceil(n / WORLD) for n in numels)
    align = 2 * WORLD
    return math.ceil(sum(numels) / align) * align // WORLD


def _model_states(case: Case, stage: int) -> int:
    """Bytes of model states one rank holds at the optimizer step (see the module docstring)."""
    n = sum(_numels(case))
    if stage == 0:
        return (4 + 4 + 8 + 4) * n
    part = _partition(case, stage)
    weights = 2 * part if stage == 3 else 2 * n
    return weights + (2 + 4 + 4 + 8) * part


def test_every_rank_is_measured_and_stored_as_simulated(swept):
    for stage, (case, rows) in swept.items():
        assert [r["rank"] for r in rows] == [0, 1], stage
        for row in rows:
            assert (row["status"], row["backend"], row["world_size"], row["zero"]) == ("ok", "simulated", WORLD, stage)
            assert row["gpu_name"] == "NVIDIA H100 80GB HBM3 (simulated)" and row["gpu_slug"] == "h100-80gb"
            # each rank its own allocator and NVML entry: its reserved segments plus its context
            assert row["device_used_source"] == "nvml-process" and row["context_bytes"] == 512 * 2**20
            assert row["device_used_bytes"] >= row["peak_reserved_bytes"] + 512 * 2**20
            assert row["host_offload_bytes"] is None and row["step_s"] > 0


def test_each_rank_holds_its_partition_of_the_weights(swept):
    n = sum(_numels(swept[0][0]))
    expected = {0: 4 * n,                                    # DDP under AMP: fp32 parameters, all of them
                2: 2 * n,                                    # stage 2: every bf16 parameter
                3: 2 * _partition(swept[3][0], 3)}           # stage 3: this rank's bf16 partitions
    assert _partition(swept[3][0], 3) < n                    # half, plus padding
    for stage, (_, rows) in swept.items():
        assert [r["weights_bytes"] for r in rows] == [expected[stage]] * WORLD, stage


def test_rank_peaks_follow_the_partitioning(swept):
    peaks = {z: [r["peak_allocated_bytes"] for r in rows] for z, (_, rows) in swept.items()}
    for rank in range(WORLD):
        assert peaks[3][rank] < peaks[2][rank] < peaks[0][rank], peaks
    for stage, (case, rows) in swept.items():
        states = _model_states(case, stage)
        predicted = estimate_memory(case.workload(), 0.0, 0).peak_allocated_bytes
        for peak in peaks[stage]:
            # at least the partitioned model states; within 15% of the estimator's peak (DeepSpeed's
            # flattened gradient copies and gathered layers are what the estimator leaves out)
            assert states <= peak <= 1.15 * predicted, (stage, states, peak, predicted)
            assert peak == pytest.approx(peaks[stage][0], rel=0.01)   # the ranks hold the same


def test_the_ddp_rank_peak_is_the_traced_step_plus_its_buckets(swept):
    # DDP copies every gradient into its buckets (gradient_as_bucket_view=False): one traced
    # single-process step plus 4 B per parameter
    case, rows = swept[0]
    traced = trace(case.with_(gpus=1)).peak_allocated_bytes
    buckets = 4 * sum(_numels(case))
    for row in rows:
        assert row["peak_allocated_bytes"] == pytest.approx(traced + buckets, rel=0.02)


def test_a_sweep_on_the_simulated_device_prepares_the_cpu_accelerator_s_ops(monkeypatch):
    # the ranks run DeepSpeed's CPU accelerator, whose FusedAdam g++ compiles: prepare_ops builds it
    # (on real GPUs without nvcc it would be dropped for torch_adam) and for the CPU accelerator
    from profiler import zero

    built = []
    monkeypatch.setattr(zero, "_build_op", lambda op, backend, timeout_s: built.append((op, backend)) or f"{op} ok")
    monkeypatch.setattr(zero, "cuda_toolkit", lambda: None)
    workloads = [Case(str(TINY), {"zero": 2}).workload(), Case(str(TINY), {"zero": 3, "offload": "optimizer"}).workload()]
    monkeypatch.setenv(simulated.ENV, "{}")
    assert zero.prepare_ops(workloads, "cuda") == ["cpu_adam ok", "fused_adam ok"]
    assert built == [("cpu_adam", "cpu"), ("fused_adam", "cpu")]
    monkeypatch.delenv(simulated.ENV)
    built.clear()
    assert any("no CUDA toolkit" in line for line in zero.prepare_ops(workloads, "cuda"))
    assert built == [("cpu_adam", "cuda")]
