"""scripts/estimate.py: JSON and table output, the planner answers, and one-line errors (exit 2).

Most cases call the script's `main(argv)` in-process (capsys); a few real subprocesses prove the
exit code, the absence of tracebacks, and that the estimator never imports torch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts_loader import call_main, load_script

from estimator import tables
from estimator.api import estimate
from estimator.configs import load_spec
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "estimate.py"
TINY = Path(__file__).with_name("data") / "tiny-llama.json"


CLI = load_script("estimate")


def run_cli(capsys, *argv):
    return call_main(CLI, capsys, *argv)


def run_json(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)  # the whole of stdout is one JSON object


# ---- the estimate itself -------------------------------------------------------------------

def test_json_estimate_keys_and_types(capsys):
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "lora", "--batch", "2", "--seq", "1024",
                    "--gpu", "a100-80gb")
    memory = data["memory"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"):
        assert type(memory[key]) is int and memory[key] > 0
    components = [k for k in memory if k.endswith("_bytes")]
    assert len(components) >= 15
    for key in components:
        assert type(memory[key]) is int and memory[key] >= 0, key
    assert memory["peak_allocated_bytes"] <= memory["peak_reserved_bytes"] <= memory["device_used_bytes"]
    t = data["time"]
    for key in ("step_s", "tokens_per_s"):
        assert type(t[key]) is float and t[key] > 0 and math.isfinite(t[key])
    assert data["fits"] is True
    assert data["workload"]["batch"] == 2 and data["workload"]["seq"] == 1024
    # tokens/s is what one step processes over its duration (1 GPU)
    assert t["tokens_per_s"] == pytest.approx(2 * 1024 / t["step_s"], rel=1e-9)


def test_json_from_a_config_path(capsys):
    data = run_json(capsys, "--model", str(TINY), "--method", "full", "--precision", "fp32", "--attn", "eager")
    # 220,480 params (worked out in test_memory_exact.py) x 4 B
    assert data["model"]["params_total"] == 220_480
    assert data["memory"]["weights_bytes"] == 4 * 220_480


def test_json_inference_and_job_cost(capsys):
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "inference", "--seq", "1024",
                    "--new-tokens", "256", "--batch", "4")
    assert data["memory"]["kv_cache_bytes"] == 2 * 32 * 8 * 128 * 2 * 4 * (1024 + 256)
    assert data["time"]["decode_s_per_token"] > 0
    job = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--samples", "1000", "--epochs", "2",
                   "--gpu", "a100-80gb")["job"]
    assert job["steps"] == 2000  # 1000 samples x 2 epochs / global batch 1
    assert job["cost_usd"] == pytest.approx(job["gpu_hours"] * job["usd_per_gpu_hour"], rel=1e-9)


def test_table_output_fits(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--gpu", "a100-80gb")
    assert code == 0 and err == ""
    assert "peak allocated" in out and "peak reserved" in out
    assert "-> FITS" in out and "DOES NOT FIT" not in out


def test_table_output_does_not_fit(capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-3.1-70b", "--method", "full", "--gpu", "a100-80gb")
    assert code == 0
    assert "peak allocated" in out
    assert "-> DOES NOT FIT" in out


# ---- bad input: exit 2, one line, no traceback -----------------------------------------------

def _bad_files(tmp_path):
    bad_json = tmp_path / "broken.json"
    bad_json.write_text('{"model_type": "llama", "hidden_size": 64,')
    unsupported = tmp_path / "mamba.json"
    unsupported.write_text(json.dumps({"model_type": "mamba", "hidden_size": 64, "vocab_size": 10}))
    no_hidden = tmp_path / "nohidden.json"
    cfg = json.loads(TINY.read_text())
    del cfg["hidden_size"]
    no_hidden.write_text(json.dumps(cfg))
    corrupt_cal = tmp_path / "cal.json"
    corrupt_cal.write_text("{not json")
    foreign_cal = tmp_path / "foreign.json"
    foreign_cal.write_text(json.dumps({"schema": "something-else/1", "factors": {}}))
    return dict(bad_json=bad_json, unsupported=unsupported, no_hidden=no_hidden,
                corrupt_cal=corrupt_cal, foreign_cal=foreign_cal)


BAD = {
    "unknown model": ["--model", "no-such-model"],
    "unknown gpu": ["--model", "llama-3.1-8b", "--gpu", "b300-999gb"],
    "qlora fp32": ["--model", "llama-3.1-8b", "--method", "qlora", "--precision", "fp32"],
    "batch 0": ["--model", "llama-3.1-8b", "--batch", "0"],
    "seq -5": ["--model", "llama-3.1-8b", "--seq", "-5"],
    "gpus 0": ["--model", "llama-3.1-8b", "--gpus", "0"],
    "malformed config": ["--model", "{bad_json}"],
    "unsupported model_type": ["--model", "{unsupported}"],
    "missing hidden_size": ["--model", "{no_hidden}"],
    "offload without zero": ["--model", "llama-3.1-8b", "--offload", "optimizer"],
    "zero with inference": ["--model", "llama-3.1-8b", "--method", "inference", "--zero", "1"],
    "bogus lora target": ["--model", "llama-3.1-8b", "--method", "lora", "--lora-targets", "bogus"],
    "missing calibration": ["--model", "llama-3.1-8b", "--calibration", "{tmp}/nope.json"],
    "corrupt calibration": ["--model", "llama-3.1-8b", "--calibration", "{corrupt_cal}"],
    "foreign calibration": ["--model", "llama-3.1-8b", "--calibration", "{foreign_cal}"],
    "cheapest without deadline": ["--model", "llama-3.1-8b", "--cheapest", "--samples", "100"],
    "chinchilla without hours": ["--chinchilla", "--gpu", "a100-80gb"],
    "no model": ["--method", "lora"],
    "missing config file": ["--model", "{tmp}/absent/config.json"],
    "zero out of range (argparse)": ["--model", "llama-3.1-8b", "--zero", "5"],
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_input_exit_2_one_line(capsys, tmp_path, case, as_json):
    files = _bad_files(tmp_path)
    argv = [a.format(tmp=tmp_path, **files) for a in BAD[case]] + (["--json"] if as_json else [])
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (case, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("estimate.py: error: ")
    assert "Traceback" not in err


def test_bad_input_subprocess_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{]")
    for argv in (["--model", "no-such-model", "--json"], ["--model", str(bad), "--gpu", "a100-80gb"]):
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def test_subprocess_json_one_object():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "llama-3.1-8b", "--method", "qlora",
                           "--batch", "4", "--seq", "2048", "--gpu", "a10g-24gb", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    assert isinstance(data, dict) and data["gpu"]["slug"] == "a10g-24gb"


def test_estimate_never_imports_torch():
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = [{str(SCRIPT)!r}, '--model', {str(TINY)!r}, '--method', 'qlora', '--json']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "    rc = 0\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes', 'deepspeed', 'numpy')"
        " if m in sys.modules)\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["rc"] == 0
    json.loads(proc.stdout)  # it did produce its answer
    assert report["heavy"] == []


# ---- planner answers -------------------------------------------------------------------------

def test_max_batch_is_the_largest_that_fits(capsys):
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "lora", "--max-batch", "--gpu", "a100-80gb",
                    "--calibration", "none")
    assert set(data) == {"workload", "gpu", "max_batch", "planned_on"}
    assert "safe bound" in data["planned_on"]
    b = data["max_batch"]
    assert isinstance(b, int) and b >= 1
    w = Workload(model=load_spec("llama-3.1-8b"), method="lora").validate()
    # planned on the bound: uncalibrated, point + 0.5 x uncertain part (estimator/bounds.py) must fit 80 GB
    capacity = tables.gpu("a100-80gb").memory_bytes
    assert estimate(w.with_(batch=b), "a100-80gb", "none").safe["device_used_bytes"] <= capacity
    assert estimate(w.with_(batch=b + 1), "a100-80gb", "none").safe["device_used_bytes"] > capacity


def test_max_seq_is_the_longest_that_fits(capsys):
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--max-seq", "--gpu", "a10g-24gb",
                    "--calibration", "none")
    s = data["max_seq"]
    assert isinstance(s, int) and s >= 512
    w = Workload(model=load_spec("llama-3.1-8b"), method="qlora", quant="nf4").validate()
    capacity = tables.gpu("a10g-24gb").memory_bytes
    assert estimate(w.with_(seq=s), "a10g-24gb", "none").safe["device_used_bytes"] <= capacity
    assert estimate(w.with_(seq=s + 1), "a10g-24gb", "none").safe["device_used_bytes"] > capacity


def test_max_batch_zero_when_nothing_fits(capsys):
    data = run_json(capsys, "--model", "llama-3.1-70b", "--method", "full", "--max-batch", "--gpu", "t4-16gb",
                    "--precision", "fp16", "--calibration", "none")
    assert data["max_batch"] == 0
    # what would make batch 1 fit: the planner's levers on the batch-1 workload, each a real fit
    assert data["advice"] and data["advice"][0].startswith("--grad-ckpt --optimizer adamw-8bit --method qlora"), data


def test_max_seq_zero_says_what_would_make_one_token_fit(capsys):
    code, out, err = call_main(CLI, capsys, "--model", "llama-3.1-70b", "--method", "inference", "--max-seq",
                               "--gpu", "t4-16gb", "--precision", "fp16", "--calibration", "none")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(": 0 (even 1 does not fit)")
    assert lines[1].startswith("seq 1 would fit with: "), lines
    w = Workload(model=load_spec("llama-3.1-70b"), method="inference", precision="fp16", seq=1).validate()
    assert not estimate(w, "t4-16gb", "none").safe_fits
    assert any(tip.startswith("--quant nf4") or "x t4-16gb" in tip for tip in lines[1].split("; "))


def test_fit_gpus_rows(capsys):
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "lora", "--fit-gpus", "--calibration", "none")
    assert set(data) == {"workload", "gpus", "planned_on"}
    rows = {r["gpu"]: r for r in data["gpus"]}
    assert set(rows) == set(tables.gpus())
    for slug, r in rows.items():
        assert set(r) == {"gpu", "gpus_needed", "device_used_bytes", "memory_bytes", "step_s", "usd_per_gpu_hour",
                          "safe_device_used_bytes", "price_row"}
        assert r["memory_bytes"] == tables.gpu(slug).memory_bytes
        if r["gpus_needed"] is None:
            assert r["device_used_bytes"] is None and r["step_s"] is None
        else:
            n = r["gpus_needed"]
            assert n >= 1 and n & (n - 1) == 0  # a power of two
            assert 0 < r["device_used_bytes"] <= r["memory_bytes"]
            assert r["step_s"] > 0
    # LoRA of an 8B model in bf16 (16 GB of weights) fits one 80 GB GPU
    assert rows["a100-80gb"]["gpus_needed"] == 1 and rows["h100-80gb"]["gpus_needed"] == 1
    # the V100 and T4 have no bf16: bf16 LoRA cannot run there
    assert rows["v100-16gb"]["gpus_needed"] is None and rows["t4-16gb"]["gpus_needed"] is None


def test_fit_gpus_zero3_needs_several(capsys):
    data = run_json(capsys, "--model", "llama-3.1-70b", "--method", "full", "--zero", "3", "--fit-gpus",
                    "--calibration", "none")
    a100 = {r["gpu"]: r for r in data["gpus"]}["a100-80gb"]
    # 70B x 20 B of states (ZeRO mixed precision) cannot fit in 80 GB on fewer than 16 GPUs
    assert a100["gpus_needed"] is not None and a100["gpus_needed"] >= 16


def test_cheapest_setups(capsys):
    data = run_json(capsys, "--model", "mistral-7b", "--method", "qlora", "--samples", "10000", "--epochs", "3",
                    "--cheapest", "--deadline-hours", "24", "--calibration", "none")
    assert set(data) == {"workload", "deadline_hours", "setups", "planned_on"}
    assert data["deadline_hours"] == 24
    setups = data["setups"]
    assert setups, "a 7B QLoRA job of 30k samples must fit some GPU within a day"
    costs = [s["cost_usd"] for s in setups]
    priced = [c for c in costs if c is not None]
    assert costs == priced + [None] * (len(costs) - len(priced))   # cheapest first, unpriced GPUs last
    assert priced == sorted(priced) and priced
    for s in setups:
        assert set(s) == {"gpu", "gpus", "job_hours", "cost_usd", "device_used_bytes"}
        assert 0 < s["job_hours"] <= 24
        assert s["cost_usd"] is None and s["gpu"] in tables.unpriced() or s["cost_usd"] > 0
        assert s["device_used_bytes"] <= tables.gpu(s["gpu"]).memory_bytes


def test_chinchilla_budget(capsys):
    data = run_json(capsys, "--chinchilla", "--gpu", "a100-80gb", "--gpus", "8", "--hours", "24", "--mfu", "0.4")
    for key in ("gpu", "gpus", "hours", "mfu", "flops", "params", "tokens", "params_parametric",
                "tokens_parametric", "source"):
        assert key in data, key
    # A100 dense BF16 312 TFLOPS (NVIDIA datasheet) x 0.4 x 8 GPUs x 24 h x 3600 s
    flops = 312e12 * 0.4 * 8 * 24 * 3600
    assert data["flops"] == pytest.approx(flops, rel=1e-3)
    # C = 6 N D with D = 20 N (Hoffmann et al. 2022)
    assert data["params"] == pytest.approx(math.sqrt(flops / 120), rel=1e-3)
    assert data["tokens"] == pytest.approx(20 * data["params"], rel=1e-9)
    assert "Hoffmann" in data["source"]


def test_table_answers_render(capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-3.1-8b", "--method", "lora", "--max-batch", "--gpu",
                           "a100-80gb", "--calibration", "none")
    assert code == 0 and "largest micro-batch" in out
    code, out, _ = run_cli(capsys, "--chinchilla", "--gpu", "a100-80gb", "--gpus", "8", "--hours", "24")
    assert code == 0 and "compute-optimal" in out


def test_a_model_without_sdpa_runs_eager_unless_sdpa_is_asked_for(capsys):
    # transformers 5.23 loads gpt_oss (and gptj) eager when no attn_implementation is given; asking
    # for SDPA is refused by the model, so by the estimator too
    data = run_json(capsys, "--model", "gpt-oss-20b", "--method", "inference", "--seq", "512")
    assert data["workload"]["attn"] == "eager"
    assert any("no SDPA" in note for note in data["regime"])
    code, out, err = run_cli(capsys, "--model", "gpt-oss-20b", "--method", "inference", "--attn", "sdpa")
    assert code == 2 and "no SDPA" in err and "Traceback" not in err
    data = run_json(capsys, "--model", "llama-3.1-8b", "--method", "inference", "--seq", "512")
    assert data["workload"]["attn"] == "sdpa" and not any("SDPA" in note for note in data["regime"])
