"""profiler/sweep.py: grid expansion, defaults, exclusions, invalid and duplicate configurations
dropped and counted, YAML and JSON, model path resolution, one-line errors, the shipped sweeps."""

from __future__ import annotations

import json
import shutil
from itertools import product
from pathlib import Path

import pytest

from estimator import tables
from estimator.api import estimate
from estimator.errors import InputError
from profiler.sweep import (CPU_SWEEP, DEFAULT_SWEEP, ROOT, expand, gpu_count_test, keep_if, load_sweep,
                            predicted_fit_test)

TINY = ROOT / "tests" / "data" / "tiny-llama.json"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture()
def folder(tmp_path):
    shutil.copy(TINY, tmp_path / "tiny.json")
    return tmp_path


GRID_YAML = """
defaults:
  precision: fp32
  seq: 64
  steps: 3
grid:
  - model: tiny.json
    method: [full, lora]
    batch: [1, 2, 4]
    grad_ckpt: [false, true]
  - model: tiny.json
    method: inference
    precision: bf16
    new_tokens: [4, 8]
"""


def test_grid_is_the_cartesian_product_over_defaults(folder):
    expansion = expand(load_sweep(write(folder / "s.yaml", GRID_YAML)))
    assert not expansion.dropped
    training = [c for c in expansion.cases if c.workload().method != "inference"]
    got = {(c.workload().method, c.workload().batch, c.workload().grad_ckpt) for c in training}
    assert got == set(product(["full", "lora"], [1, 2, 4], [False, True]))
    assert len(expansion.cases) == 12 + 2
    for case in expansion.cases:
        w = case.workload()
        assert w.seq == 64 and case.steps == 3 and case.warmup == 2  # defaults; warmup: Case default
        assert w.precision == ("bf16" if w.method == "inference" else "fp32")  # entry overrides defaults
    assert {c.workload().new_tokens for c in expansion.cases if c.workload().method == "inference"} == {4, 8}


def test_file_order_is_kept(folder):
    cases = expand(load_sweep(write(folder / "s.yaml", GRID_YAML))).cases
    methods = [c.workload().method for c in cases]
    assert methods == ["full"] * 6 + ["lora"] * 6 + ["inference"] * 2


def test_json_and_yaml_give_the_same_cases(folder):
    import yaml

    data = yaml.safe_load(GRID_YAML)
    from_yaml = expand(load_sweep(write(folder / "s.yaml", GRID_YAML))).cases
    from_json = expand(load_sweep(write(folder / "s.json", json.dumps(data)))).cases
    assert [c.id for c in from_yaml] == [c.id for c in from_json]


def test_invalid_combinations_are_dropped_and_counted_by_reason(folder):
    text = """
grid:
  - model: tiny.json
    method: [full, qlora]
    precision: [fp32, bf16]
    attn: [sdpa, flash]
"""
    expansion = expand(load_sweep(write(folder / "s.yaml", text)))
    # 8 combinations; invalid: qlora+fp32 (x2 attn), flash+fp32 for full (1) -> 3 dropped
    assert len(expansion.cases) == 5
    assert len(expansion.dropped) == 3
    reasons = expansion.reasons()
    assert sum(reasons.values()) == 3
    assert all(r.startswith("invalid: ") for r in reasons)
    assert sum(n for r, n in reasons.items() if "QLoRA" in r) == 2
    assert sum(n for r, n in reasons.items() if "FlashAttention" in r) == 1
    assert any("dropped 2 x invalid: QLoRA" in line for line in expansion.summary_lines())


def test_qlora_gets_nf4_unless_quant_is_given(folder):
    text = """
grid:
  - {model: tiny.json, method: qlora, precision: bf16}
  - {model: tiny.json, method: qlora, precision: bf16, quant: fp4}
"""
    cases = expand(load_sweep(write(folder / "s.yaml", text))).cases
    assert [c.workload().quant for c in cases] == ["nf4", "fp4"]


def test_exclude_rules_match_all_keys_and_lists_mean_any_of(folder):
    text = """
grid:
  - model: tiny.json
    method: [full, lora]
    batch: [1, 2, 4]
exclude:
  - {method: lora, batch: [2, 4]}
  - {batch: 4, grad_ckpt: false}   # grad_ckpt is false by default: matches full batch 4
"""
    expansion = expand(load_sweep(write(folder / "s.yaml", text)))
    got = {(c.workload().method, c.workload().batch) for c in expansion.cases}
    assert got == {("full", 1), ("full", 2), ("lora", 1)}
    assert expansion.reasons() == {"excluded by a rule": 3}


def test_duplicates_are_dropped_and_counted(folder):
    text = """
grid:
  - {model: tiny.json, batch: [1, 2]}
  - {model: tiny.json, batch: 2, seq: 512}   # seq 512 is the default: same id as above
"""
    expansion = expand(load_sweep(write(folder / "s.yaml", text)))
    assert len(expansion.cases) == 2
    assert expansion.reasons() == {"duplicate of an earlier configuration": 1}


def test_lora_targets_all_linear_and_comma_strings(folder):
    text = """
grid:
  - model: tiny.json
    method: lora
    lora_targets: [all-linear, "q_proj,k_proj"]
"""
    cases = expand(load_sweep(write(folder / "s.yaml", text))).cases
    assert [len(c.workload().lora_targets) for c in cases] == [7, 2]


def test_model_paths_resolve_against_the_sweep_folder_then_the_repo_root(tmp_path):
    sub = tmp_path / "here"
    sub.mkdir()
    shutil.copy(TINY, sub / "local.json")
    text = "grid:\n  - model: [local.json, tests/data/tiny-gpt2.json]\n"
    cases = expand(load_sweep(write(sub / "s.yaml", text))).cases
    assert Path(cases[0].model) == (sub / "local.json").resolve()
    assert Path(cases[1].model) == ROOT / "tests" / "data" / "tiny-gpt2.json"


@pytest.mark.parametrize("name, text, words", [
    ("bad.yaml", "grid: [\n  - model: x\n", ["malformed YAML", "line"]),
    ("bad.json", '{"grid": [', ["malformed sweep", "Expecting value at line 1"]),
    ("s.yaml", "grid:\n  - {model: tiny.json, bacth: 2}\n", ["unknown key 'bacth'", "grid entry 1"]),
    ("s.yaml", "grids:\n  - {model: tiny.json}\n", ["unknown key 'grids'"]),
    ("s.yaml", "defaults: {batch: 2}\n", ["'grid' is missing"]),
    ("s.yaml", "grid:\n  - {batch: 2}\n", ["has no model"]),
    ("s.yaml", "grid:\n  - {model: tiny.json, batch: []}\n", ["'batch' is an empty list"]),
    ("s.yaml", "grid:\n  - {model: no-such-model-anywhere}\n", ["unknown model 'no-such-model-anywhere'"]),
    ("s.yaml", "grid:\n  - {model: missing.json}\n", ["not found", "missing.json"]),
    ("s.yaml", "- just\n- a list\n", ["must hold a mapping"]),
    ("s.yaml", "timeout_s: -1\ngrid:\n  - {model: tiny.json}\n", ["timeout_s must be a positive number"]),
    ("s.yaml", "grid:\n  - {model: tiny.json}\nexclude:\n  - {methd: lora}\n", ["exclude rule 1", "methd"]),
])
def test_bad_files_give_one_clear_line(folder, name, text, words):
    path = write(folder / name, text)
    with pytest.raises(InputError) as err:
        expand(load_sweep(path))
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")


def test_gpu_count_filter_drops_cases_needing_more_gpus(folder):
    text = "grid:\n  - {model: tiny.json, gpus: [1, 2], zero: 2}\n"
    expansion = keep_if(expand(load_sweep(write(folder / "s.yaml", text))), gpu_count_test(1))
    assert [c.workload().gpus for c in expansion.cases] == [1]
    assert expansion.reasons() == {"needs more GPUs than --gpus 1": 1}


def test_predicted_fit_filter_agrees_with_the_estimator():
    expansion = expand(load_sweep(DEFAULT_SWEEP))
    kept = keep_if(expansion, predicted_fit_test("h100-80gb", 1.3, calibration="none"))
    limit = 1.3 * tables.gpu("h100-80gb").memory_bytes
    kept_ids = {c.id for c in kept.cases}
    for case in expansion.cases:
        predicted = estimate(case.workload(), "h100-80gb", calibration="none").memory.device_used_bytes
        assert (case.id in kept_ids) == (predicted <= limit), case.id
    assert len(kept.dropped) == len(expansion.cases) - len(kept.cases) > 0


def test_default_sweep_is_sized_for_one_80gb_gpu():
    sweep = load_sweep(DEFAULT_SWEEP)
    expansion = expand(sweep)
    assert not expansion.dropped  # nothing invalid or duplicated in the shipped file
    kept = keep_if(expansion, predicted_fit_test("a100-80gb", sweep.skip_predicted_over, "none")).cases
    assert 40 <= len(kept) <= 60
    workloads = [c.workload() for c in kept]
    assert {w.method for w in workloads} == {"full", "lora", "qlora", "inference"}
    assert any(w.model.num_experts for w in workloads)  # one MoE
    assert {w.grad_ckpt for w in workloads} == {False, True}
    assert len({w.precision for w in workloads}) >= 2
    assert len({w.batch for w in workloads}) >= 3 and len({w.seq for w in workloads}) >= 3
    params = {w.model.name for w in workloads}
    assert {"Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B", "Qwen/Qwen1.5-MoE-A2.7B"} <= params


def test_cpu_sweep_covers_every_path_on_tiny_models():
    expansion = expand(load_sweep(CPU_SWEEP))
    assert not expansion.dropped
    workloads = [c.workload() for c in expansion.cases]
    assert {w.method for w in workloads} == {"full", "lora", "qlora", "inference"}
    assert any(w.grad_ckpt for w in workloads)
    assert {w.model.model_type for w in workloads} == {"llama", "gpt2"}
    assert all(w.model.hidden_size <= 64 for w in workloads)
    assert len(workloads) <= 8  # about a minute on CPU at a few seconds per process
