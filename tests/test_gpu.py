"""Measurements on a real GPU (marker `gpu`: skipped without CUDA, never counted as a pass there).

The child runs as a subprocess on cuda, as the runner runs it (PYTHONPATH extended, never
replaced: a CI job may carry packages there). Expected bytes come from the project's tracer
(`profiler.trace.trace`: the same step on fake tensors, 512-byte rounded as the CUDA caching
allocator rounds every block) or from the model's own tensors built on `meta`, never from what the
child measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiler import build
from profiler.case import Case
from profiler.trace import trace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"  # catalog config: no download
BLOCK = 512  # CUDA caching allocator block rounding (bytes)


def _r512(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def _env() -> dict:
    """This environment for a one-process child: ROOT first on PYTHONPATH, what was there kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(tmp_path: Path, case: Case, timeout_s: int = 600) -> dict:
    case_path, out = tmp_path / "case.json", tmp_path / "out.json"
    case_path.write_text(case.to_json())
    proc = subprocess.run([sys.executable, "-m", "profiler.child", "--case", str(case_path), "--out",
                           str(out), "--backend", "cuda"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    return rows[0]


def _meta_model(case: Case):
    return build.build_model(case.config(), case.workload(), "meta")


def _param_grad_adam_bytes(case: Case) -> int:
    """Parameters + gradients + AdamW exp_avg and exp_avg_sq (in the parameter dtype) + fused
    AdamW's float32 `step` tensor per parameter + buffers, each block 512-byte rounded. Tied
    weights are one parameter (`parameters()` yields each once)."""
    model = _meta_model(case)
    total = sum(_r512(b.numel() * b.element_size()) for b in model.buffers())
    for p in model.parameters():
        block = _r512(p.numel() * p.element_size())
        total += block + (3 * block + _r512(4) if p.requires_grad else 0)
    return total


@pytest.fixture(scope="module")
def states_row(tmp_path_factory):
    # seq 8, batch 1: activations and logits (~7 MB) are far below 2% of ~4 GB of states
    case = Case(QWEN, {"method": "full", "precision": "bf16", "adamw_impl": "fused", "batch": 1,
                       "seq": 8}, warmup=2, steps=3)
    return case, _run(tmp_path_factory.mktemp("states"), case)


def test_env_extends_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/ci/wheels/site-packages")
    monkeypatch.setenv("WORLD_SIZE", "4")
    env = _env()
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/ci/wheels/site-packages"])
    assert "WORLD_SIZE" not in env


def test_peak_allocated_is_what_the_tracer_predicts(states_row):
    # Not params + grads + Adam alone: Qwen2.5-0.5B ties its embedding, and the backward briefly
    # holds a second embedding-sized gradient (the lm_head's, summed into the embedding's), which
    # the tracer sees (about 1.07 x the states). The tracer is the expectation, within 2%.
    case, row = states_row
    assert row["status"] == "ok", row["message"]
    expected = trace(case).peak_allocated_bytes
    assert expected >= _param_grad_adam_bytes(case)
    assert 0.98 * expected <= row["peak_allocated_bytes"] <= 1.02 * expected, (expected, row["peak_allocated_bytes"])


def test_memory_quantities_are_ordered_and_environment_filled(states_row):
    _, row = states_row
    assert row["device_used_bytes"] >= row["peak_reserved_bytes"] >= row["peak_allocated_bytes"] > 0
    assert row["device_used_source"] in ("nvml-process", "nvml-device-delta")
    assert row["alloc_retries"] is not None and row["device_baseline_bytes"] is not None
    assert 50 * 2**20 < row["context_bytes"] < 4 * 2**30
    assert row["gpu_memory_bytes"] > 8 * 2**30 and row["gpu_name"]
    assert row["driver"] and row["cuda"] == torch.version.cuda
    assert row["weights_bytes"] == 2 * sum(p.numel() for p in _meta_model(states_row[0]).parameters())
    if row["gpu_slug"]:
        assert 0 < row["mfu"] < 1
    else:
        assert row["mfu"] is None


def test_step_time_spread_under_5_percent(tmp_path):
    case = Case(QWEN, {"method": "full", "precision": "bf16", "batch": 4, "seq": 512}, warmup=3, steps=10)
    row = _run(tmp_path, case)
    assert row["status"] == "ok", row["message"]
    assert row["step_spread"] < 0.05, (row["step_s_min"], row["step_s"], row["step_s_max"])
    assert row["tokens_per_s"] == pytest.approx(4 * 512 / row["step_s"])


def test_inference_prefill_and_decode(tmp_path):
    case = Case(QWEN, {"method": "inference", "precision": "bf16", "batch": 1, "seq": 128,
                       "new_tokens": 16}, warmup=2, steps=5)
    row = _run(tmp_path, case)
    assert row["status"] == "ok", row["message"]
    assert row["prefill_s"] > 0 and row["decode_token_s"] > 0
    assert row["peak_allocated_bytes"] >= row["weights_bytes"]


def test_a_model_too_large_is_recorded_as_oom(tmp_path):
    case = Case("meta-llama/Llama-3.1-405B", {"method": "full", "precision": "bf16", "seq": 128},
                warmup=1, steps=1)
    row = _run(tmp_path, case)
    assert row["status"] == "oom", row["message"]
    assert "out of memory" in row["message"].lower()
    assert row["peak_allocated_bytes"] is None


def test_zero2_on_one_gpu(tmp_path):
    # Without a CUDA toolkit FusedAdam cannot be compiled: torch's AdamW runs and the row says so.
    from profiler import zero

    case = Case(QWEN, {"zero": 2, "batch": 1, "seq": 128}, warmup=2, steps=3)
    row = _run(tmp_path, case)
    assert row["status"] == "ok", row["message"]
    assert ("torch_adam" in row["message"]) == (zero.cuda_toolkit() is None), row["message"]
    n = sum(p.numel() for p in _meta_model(case).parameters())
    # bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam 8 (one rank holds every partition)
    assert row["peak_allocated_bytes"] >= 16 * n
    assert row["host_offload_bytes"] is None


_BUILD_PEAK = """
import json, sys, torch
from profiler import build
from profiler.case import Case
case = Case.from_json(sys.argv[1])
torch.cuda.init()
model = build.build_model(case.config(), case.workload(), "cuda")
torch.cuda.synchronize()
print(json.dumps({"peak": torch.cuda.max_memory_allocated(), "kept": torch.cuda.memory_allocated()}))
"""


@pytest.mark.parametrize("quant,bytes_per_weight", [("nf4", 0.55), ("int8", 1.05)])
def test_a_quantized_build_never_holds_the_full_precision_model(quant, bytes_per_weight):
    # Llama-3.1-8B in bf16 is 16 GB; built as transformers loads a bitsandbytes model, the build
    # peaks at the quantized model plus one layer's unquantized linears (the old build: 16 GB+,
    # and Llama-3.1-70B QLoRA was a false OOM on an 80 GB card). Inference: no peft upcast.
    case = Case("meta-llama/Llama-3.1-8B", {"method": "inference", "quant": quant})
    proc = subprocess.run([sys.executable, "-c", _BUILD_PEAK, case.to_json()], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = _meta_model(case.with_(quant="none"))
    linears = [plain.get_submodule(n) for n in build.quantized_linear_names(plain)]
    linear_numel = sum(m.weight.numel() for m in linears)
    rest_bytes = 2 * (sum(p.numel() for p in plain.parameters()) - linear_numel)
    one_layer = sum(2 * m.weight.numel() for m in plain.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    assert got["kept"] <= rest_bytes + bytes_per_weight * linear_numel, got  # quantized (+ statistics)
    assert got["peak"] <= got["kept"] + one_layer, (got, one_layer)
