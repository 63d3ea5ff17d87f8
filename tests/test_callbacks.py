"""profiler.callbacks.MeasureCallback with the real transformers Trainer on CPU (issue 12 item 2):
a tiny random Llama trains a few steps; the callback writes one row in the profiler's schema
(step time measured, GPU memory not measured), derives the Workload from the trainer (batch,
accumulation, checkpointing, precision from the weights, LoRA from peft, the sequence from the
batches), and a fresh estimate of the row's Workload can be compared with it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from estimator.api import estimate
from profiler import record
from profiler.callbacks import MeasureCallback

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "tests" / "data" / "tiny-llama.json").read_text())
SEQ = 32


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _train(tmp_path, lora: bool, fp32: bool = False, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))     # the config's dtype: bf16
    if fp32:
        model = model.float()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    out = tmp_path / "measurements.csv"
    callback = MeasureCallback(out, warmup_steps=1, compare=True)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=4, use_cpu=True, report_to=[],
                             logging_strategy="no", save_strategy="no", gradient_checkpointing=True,
                             **overrides)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    return callback, rows


@pytest.mark.parametrize("lora", [False, True])
def test_the_callback_records_the_real_job(tmp_path, capsys, lora):
    callback, rows = _train(tmp_path, lora)
    assert len(rows) == 1 and list(rows[0]) == record.COLUMN_NAMES
    row = {k: record.parse_value(k, v) for k, v in rows[0].items()}
    assert row["backend"] == "cpu" and row["status"] == "ok"
    assert row["steps"] == 3 and row["step_s"] > 0                      # 4 steps, 1 of warm-up
    # optimizer.step alone, between the Trainer's pre- and post-optimizer events, inside each step
    assert len(callback.optimizer_times) == 3 and 0 < row["optimizer_s"] < row["step_s"]
    # the host's work between steps: from each timed step's end to the next one's begin
    assert len(callback.between_times) == 2 and row["overhead_s"] == pytest.approx(
        sorted(callback.between_times)[0] / 2 + sorted(callback.between_times)[1] / 2) and row["overhead_s"] > 0
    assert row["peak_allocated_bytes"] is None and row["peak_reserved_bytes"] is None   # not measured
    w = record.workload_from_row(row)
    assert (w.batch, w.grad_accum, w.grad_ckpt, w.seq, w.precision) == (2, 2, True, SEQ, "bf16")
    assert (w.method, w.lora_rank, w.lora_targets) == (("lora", 4, ("q_proj", "v_proj")) if lora else
                                                       ("full", 16, w.lora_targets))
    assert w.optimizer == "adamw" and w.adamw_impl == "fused"          # the Trainer's default optim
    assert "batch" in row["stated"] and "seq" in row["stated"]
    # a fresh estimate of the same Workload compares with the row
    assert estimate(w, "h100-80gb", "none").memory.peak_allocated_bytes > 0
    err = capsys.readouterr().err
    assert "peak allocated" in err and "not measured" in err and "measured" in err


def test_fp32_weights_under_bf16_autocast_are_amp(tmp_path):
    _, rows = _train(tmp_path, False, fp32=True, bf16=True)
    assert record.workload_from_row(rows[0]).precision == "amp-bf16"


def test_a_second_run_appends_a_row(tmp_path):
    _train(tmp_path, False)
    _, rows = _train(tmp_path, False)
    assert len(rows) == 2


def test_the_cuda_branch_through_the_simulated_device(tmp_path, capsys, monkeypatch):
    """The callback's CUDA code (synchronisation, peaks, the device's name and slug) on the simulated
    device of profiler.device.simulated: the row is labelled `simulated` (never fitted), the
    allocator's peaks are measured and hold at least the weights, the GPU is the simulated H100."""
    from profiler.device import cuda, simulated

    monkeypatch.setenv(simulated.ENV, json.dumps({}))
    cuda.init("cpu")
    try:
        callback, rows = _train(tmp_path, lora=False)
    finally:
        simulated.stop()
    row = {k: record.parse_value(k, v) for k, v in rows[0].items()}
    assert row["backend"] == "simulated" and row["gpu_slug"] == "h100-80gb"
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).parameters())
    # bf16 weights, their gradients and AdamW's two states are alive at the peak of a full fine-tune
    assert row["peak_allocated_bytes"] >= params * (2 + 2 + 2 * 2)
    assert row["peak_reserved_bytes"] >= row["peak_allocated_bytes"]
    err = capsys.readouterr().err
    assert "(simulated)" in err and f"measured {row['peak_allocated_bytes'] / 2**30:.2f} GiB" in err
