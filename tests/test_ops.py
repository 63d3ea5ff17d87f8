"""The operator counts behind the launch floor (estimator/ops.py, estimator/data/op_counts.csv,
profiler/opcount.py, scripts/count_ops.py). The oracle is the real code: a whole model built by
profiler.build and stepped on CPU under a counting dispatch mode."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from estimator import tables
from estimator.api import estimate
from estimator.defaults import time_constant
from estimator.errors import InputError
from estimator.model import spec_from_config
from estimator.ops import counted_type, micro_batch_ops
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
QWEN = "Qwen--Qwen2.5-0.5B-Instruct.json"


def _cfg(name: str, **changes) -> dict:
    cfg = json.loads((ROOT / "estimator" / "catalog" / name).read_text())
    cfg.update(vocab_size=512, bos_token_id=0, eos_token_id=0, **changes)
    return cfg


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-0.5B's structure (24 layers, tied embeddings, q/k/v biases) at a small MLP width and
    vocabulary: the operator count does not depend on widths."""
    cfg = _cfg(QWEN, intermediate_size=256)
    return cfg, spec_from_config(cfg, "qwen2.5-0.5b-narrow")


def _real_ops(cfg: dict, w: Workload) -> int:
    from profiler.opcount import BATCH, SEQ, _counted_step

    small = replace(w, batch=BATCH, seq=SEQ).validate()
    return sum(_counted_step(cfg, small).values())


@pytest.mark.parametrize("settings", [
    dict(method="full"),
    dict(method="full", grad_ckpt=True),
    dict(method="lora", lora_targets=("all-linear",), grad_ckpt=True),   # 7 adapters per layer, 2 counted
    dict(method="full", precision="amp-bf16"),                          # autocast's casts per linear
    dict(method="inference", new_tokens=1),
], ids=["full", "full-ckpt", "lora-all-linear-ckpt", "amp", "prefill"])
def test_the_estimated_count_is_the_whole_models_real_count(qwen, settings):
    """The table holds a 1- and 2-layer difference of qwen2's counts and Llama's per-adapter and
    per-cast increments; the whole 24-layer model, built and stepped for real, dispatches that many
    operators (within 1 %; 3 % under autocast, whose per-linear casts are Llama's: qwen2's q/k/v
    biases are cast too)."""
    cfg, spec = qwen
    w = Workload(spec, **settings).validate()
    assert counted_type(spec.model_type) == "qwen2"
    real = _real_ops(cfg, w)
    assert micro_batch_ops(w) == pytest.approx(real, rel=0.03 if w.amp else 0.01)


def test_the_count_does_not_depend_on_sizes(qwen):
    cfg, spec = qwen
    a = _real_ops(cfg, Workload(spec, batch=1, seq=16).validate())
    from profiler.opcount import _counted_step

    b = sum(_counted_step(cfg, Workload(spec, batch=2, seq=40).validate()).values())
    assert b == pytest.approx(a, abs=4)   # a batch of one skips a couple of views
    assert micro_batch_ops(Workload(spec, batch=8, seq=4096).validate()) == micro_batch_ops(
        Workload(spec, batch=1, seq=16).validate())


def test_an_uncounted_type_takes_llamas_counts():
    assert counted_type("no-such-type") == "llama"
    assert counted_type("qwen2") == "qwen2"


def test_bad_op_count_rows_are_refused(tmp_path):
    header = "model_type,method,grad_ckpt,phase,per_layer,outside,lora_targets,counted_on,source,date\n"
    good = "llama,full,0,forward,77,50,,x.json,counted,2026-11-27\n"
    for bad, message in [
        ("llama,full,0,backward,-3,50,,x.json,counted,2026-11-27\n", "positive count"),
        ("llama,dpo,0,forward,77,50,,x.json,counted,2026-11-27\n", "is not one of"),
        ("llama,full,2,forward,77,50,,x.json,counted,2026-11-27\n", "is not one of"),
        ("llama,full,0,backward,77,fifty,,x.json,counted,2026-11-27\n", "not an integer"),
        ("llama,full,0,backward,77,50,,x.json,counted,27/11/2026\n", "ISO date"),
        (good, "duplicate row"),
    ]:
        f = tmp_path / "op_counts.csv"
        f.write_text(header + good + bad)
        with pytest.raises(InputError, match=message):
            tables._load_op_counts(f)


def test_the_launch_floor_binds_small_models_and_not_large_ones(qwen):
    """Qwen2.5-0.5B full at 2 x 1024 on an H100: its kernels are shorter than their dispatch, the
    step's compute is the floor (operators x seconds each); Llama-3.1-8B at 4 x 4096 is GEMM-bound.
    Compiled training (fp8 under torch.compile) has no floor: torch.compile fuses the operators."""
    cfg = _cfg(QWEN)
    small = Workload(spec_from_config(cfg, "qwen2.5-0.5b"), batch=2, seq=1024).validate()
    t = estimate(small, "h100-80gb", "none").time
    floor = micro_batch_ops(small) * time_constant("training_host_s_per_op")
    assert t.launch_bound and t.launch_floor_s == pytest.approx(floor)
    assert t.compute_s == pytest.approx(floor)
    assert sum(t.compute_parts.values()) < floor
    big = Workload(spec_from_config(json.loads((ROOT / "estimator" / "catalog" / "meta-llama--Llama-3.1-8B.json")
                                               .read_text()), "llama-3.1-8b"), batch=4, seq=4096).validate()
    tb = estimate(big, "h100-80gb", "none").time
    assert not tb.launch_bound and tb.compute_s == pytest.approx(sum(tb.compute_parts.values()))
    eager8 = estimate(replace(small, precision="fp8").validate(), "h100-80gb", "none").time
    compiled = estimate(replace(small, precision="fp8", compiled=True).validate(), "h100-80gb", "none").time
    assert eager8.launch_bound and compiled.launch_floor_s == 0.0 and not compiled.launch_bound


def test_the_committed_counts_are_what_the_script_counts_today():
    """scripts/count_ops.py --check recounts GPT-2 (the smallest catalog type) with the pinned
    transformers and compares every row with estimator/data/op_counts.csv: a transformers upgrade
    that changes the code changes the counts, and this fails until the table is rewritten."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_ops.py"), "--only", "gpt2", "--check"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
