"""profiler/record.py owns the results row: building one (new_row), its column types
(parse_value), reading its Workload back (case_from_row / workload_from_row), the spelling of
lora_targets (parse_lora_targets, `all-linear` on every path) and one row per configuration
from its ranks (merge_ranks: slowest rank's step time, each memory quantity's own maximum)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from estimator.errors import InputError
from estimator.params import ALL_LINEAR
from profiler import record
from profiler.case import Case
from profiler.record import (COLUMN_NAMES, WORKLOAD_COLUMNS, case_from_row, case_status, merge_ranks, new_row,
                             parse_lora_targets, parse_value, workload_columns, workload_from_row)
from profiler.store import RunStore
from profiler.sweep import expand, field_value, load_sweep

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")

# every Workload column away from its default (a 4-process QLoRA job under ZeRO-3 with tp x pp)
EVERY_FIELD = {"method": "qlora", "precision": "amp-bf16", "optimizer": "paged-adamw-8bit",
               "adamw_impl": "foreach", "batch": 3, "seq": 96, "grad_accum": 2, "lora_rank": 8,
               "lora_targets": "all-linear", "dora": True, "grad_ckpt": True, "attn": "eager", "quant": "fp4",
               "double_quant": False, "gpus": 2, "nodes": 2, "zero": 3, "offload": "optimizer+params",
               "tp": 2, "pp": 2, "loss": "model-dtype", "padding_mask": True}
INFERENCE = {"method": "inference", "new_tokens": 7, "batch": 2, "seq": 64, "compiled": True}
# the training stack's fields (FSDP excludes ZeRO, so they move in a case of their own)
STACK = {"method": "qlora", "quant": "nf4", "fsdp": "hybrid", "gpus": 2, "nodes": 2, "kbit_prep": "on",
         "liger": True, "activation_offload": True, "lora_dropout": True}

# expert parallel needs a MoE model (Qwen1.5-MoE: 60 experts)
EXPERT = {"ep": 2, "gpus": 2, "trainable_dtype": "model"}
MOE = str(ROOT / "estimator" / "catalog" / "Qwen--Qwen1.5-MoE-A2.7B.json")
# a trained vision tower needs a vision-language model
VISION = {"train_vision": True, "precision": "fp8", "fp8_backend": "te"}   # and fp8 through Transformer Engine
VL = str(ROOT / "estimator" / "catalog" / "Qwen--Qwen2.5-VL-7B-Instruct.json")


def test_every_field_case_covers_every_workload_column():
    assert set(EVERY_FIELD) | set(INFERENCE) | set(STACK) | set(EXPERT) | set(VISION) == set(WORKLOAD_COLUMNS)


# ---- lora_targets ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["all-linear", " All-Linear ", ["all-linear"], ("all-linear",)])
def test_parse_lora_targets_all_linear(value):
    assert parse_lora_targets(value) == ALL_LINEAR


@pytest.mark.parametrize("value", ["q_proj,v_proj", " q_proj , v_proj ,", ["q_proj", "v_proj"], ("q_proj", "v_proj")])
def test_parse_lora_targets_roles(value):
    assert parse_lora_targets(value) == ("q_proj", "v_proj")


@pytest.mark.parametrize("value", [5, None, ["q_proj", 3]])
def test_parse_lora_targets_refuses_what_is_not_text(value):
    with pytest.raises(InputError, match="lora_targets"):
        parse_lora_targets(value)


def _all_linear_paths(tmp_path: Path) -> dict:
    """lora_targets=all-linear through every way a Workload is made from text."""
    settings = {"method": "lora", "lora_targets": "all-linear"}
    case_file = json.dumps({"model": TINY, "settings": {"method": "lora", "lora_targets": ["all-linear"]}})
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"grid:\n  - model: {TINY}\n    method: lora\n    lora_targets: all-linear\n"
                     "exclude:\n  - {lora_targets: all-linear, batch: 2}\n")
    store = RunStore(tmp_path / "run")
    case = Case(TINY, settings)
    store.put(case.id, [new_row(case, "cuda", status="ok", message="")])
    csv_row = {k: "" if v is None else str(v) for k, v in new_row(case, "cuda").items()}
    csv_row["lora_targets"] = "all-linear"
    return {
        "Case settings": Case(TINY, settings).workload(),
        "case file (child)": Case.from_json(case_file).workload(),
        "sweep file": expand(load_sweep(sweep)).cases[0].workload(),
        "sweep value": Case(TINY, {"method": "lora", "lora_targets": field_value("lora_targets", "all-linear")}).workload(),
        "typed row": workload_from_row({"model": TINY, "method": "lora", "lora_targets": "all-linear"}),
        "csv row": workload_from_row(csv_row),
        "stored row": workload_from_row(store.rows()[0]),
    }


def test_all_linear_is_accepted_by_every_path(tmp_path):
    paths = _all_linear_paths(tmp_path)
    wrong = {name: w.lora_targets for name, w in paths.items() if w.lora_targets != ALL_LINEAR}
    assert not wrong
    assert len({w.id for w in paths.values()}) == 1  # one configuration, one resume key


# ---- building a row ----------------------------------------------------------------------------

def test_new_row_has_every_column_and_the_case_identity():
    case = Case(TINY, {"method": "lora", "batch": 2, "gpus": 2}, warmup=1, steps=3)
    row = new_row(case, "cpu", status="ok", message="", started_at="2026-01-01T00:00:00+00:00")
    w = case.workload()
    assert list(row) == COLUMN_NAMES
    assert (row["id"], row["model"], row["model_type"]) == (w.id, TINY, "llama")
    assert (row["warmup"], row["steps"], row["world_size"], row["rank"], row["backend"]) == (1, 3, 2, 0, "cpu")
    assert {k: row[k] for k in WORKLOAD_COLUMNS} == workload_columns(w)
    assert row["lora_targets"] == "q_proj,v_proj" and row["batch"] == 2
    measured = [k for k in COLUMN_NAMES if k.endswith(("_bytes", "_s")) and k != "started_at"]
    assert all(row[k] is None for k in measured)  # not measured: None, never 0
    record.check_row(row)


def test_new_row_columns_override_and_unknown_columns_are_refused():
    case = Case(TINY, {"gpus": 2})
    row = new_row(case, "trace", world_size=1, warmup=0, status="skipped", message="why")
    assert (row["world_size"], row["warmup"], row["status"], row["message"]) == (1, 0, "skipped", "why")
    with pytest.raises(ValueError, match="unknown record columns: bogus"):
        new_row(case, "cuda", bogus=1)


def test_new_row_without_a_case():
    row = new_row(None, "cpu", model="missing.json", status="error", message="x")
    assert row["model"] == "missing.json" and row["id"] is None and row["method"] is None
    w = Case(TINY, {"batch": 4}).workload()
    row = new_row(None, "cuda", workload=w, model="tiny")
    assert (row["id"], row["model"], row["batch"], row["world_size"]) == (w.id, "tiny", 4, 1)


def test_the_row_builders_use_new_row(tmp_path):
    """The runner's parent row, the child's row of an unreadable case and a synthetic row: same
    identity columns as new_row gives."""
    from fitting import synthetic
    from profiler import child
    from profiler.runner import Runner

    case = Case(TINY, {"method": "lora", "batch": 2})
    expected = {k: v for k, v in new_row(case, "cpu").items() if k in ("id", "model", "model_type", *WORKLOAD_COLUMNS)}
    parent = Runner(backend="cpu")._known(case, "2026-01-01T00:00:00+00:00", 1.0)
    assert {k: parent[k] for k in expected} == expected and parent["status"] is None
    made = child.new_row(case, None, "cpu", status="ok")
    assert {k: made[k] for k in expected} == expected
    broken = child.new_row(Case(TINY, {"method": "qlora", "quant": "none"}), None, "cpu", status="ok")
    assert broken["model"] == TINY and broken["id"] is None and list(broken) == COLUMN_NAMES
    rows = synthetic.rows(models=("tinyllama",), noise=0.0)
    r = rows[0]
    w = workload_from_row(r)
    assert r["id"] == w.id and {k: r[k] for k in WORKLOAD_COLUMNS} == workload_columns(w)
    assert list(r) == COLUMN_NAMES


# ---- values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,text,value", [
    ("grad_ckpt", "True", True), ("grad_ckpt", "false", False), ("double_quant", "0", False),
    ("grad_ckpt", True, True), ("batch", "3", 3), ("batch", "3.0", 3), ("peak_allocated_bytes", "8.5e9", 8_500_000_000),
    ("peak_allocated_bytes", "85899345921", 85899345921), ("step_s", "0.125", 0.125), ("mfu", 0.5, 0.5),
    ("lora_targets", "q_proj,v_proj", "q_proj,v_proj"), ("lora_targets", ("q_proj", "v_proj"), "q_proj,v_proj"),
    ("message", "a, b", "a, b"), ("not_a_column", "x", "x"),
    ("step_s", "", None), ("step_s", "nan", None), ("step_s", float("nan"), None), ("batch", None, None),
])
def test_parse_value(name, text, value):
    got = parse_value(name, text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name,text", [("grad_ckpt", "maybe"), ("batch", "2.5"), ("batch", "two"),
                                       ("peak_allocated_bytes", "1.5"), ("step_s", "fast"), ("batch", True)])
def test_parse_value_refuses_text_of_another_type(name, text):
    with pytest.raises(InputError, match=name):
        parse_value(name, text)


# ---- row -> Workload -> row --------------------------------------------------------------------

@pytest.mark.parametrize("settings", [EVERY_FIELD, INFERENCE, STACK, EXPERT, VISION],
                         ids=["training", "inference", "stack", "ep", "vision"])
def test_row_workload_row_round_trip_keeps_every_workload_column(settings):
    model = {id(EXPERT): MOE, id(VISION): VL}.get(id(settings), TINY)
    case = Case(model, settings, warmup=1, steps=4)
    row = new_row(case, "cuda", status="ok", message="")
    as_csv = {k: "" if v is None else str(v) for k, v in row.items()}
    for source in (row, as_csv):
        back = case_from_row(source)
        w = back.workload()
        assert w.id == row["id"]
        assert workload_columns(w) == {k: row[k] for k in WORKLOAD_COLUMNS}
        assert (back.warmup, back.steps) == (1, 4)
    if settings is not INFERENCE:  # the case really moves every field it names off its default
        default = workload_columns(Case(TINY).workload())
        assert [k for k in settings if row[k] == default[k]] == []


def test_round_trip_through_the_store(tmp_path):
    case = Case(TINY, EVERY_FIELD)
    row = new_row(case, "cuda", status="ok", message="", peak_allocated_bytes=10**9, step_s=0.5)
    RunStore(tmp_path).put(case.id, [row])
    stored = RunStore(tmp_path).rows()[0]
    assert workload_from_row(stored).id == case.id
    assert {k: stored[k] for k in WORKLOAD_COLUMNS} == {k: row[k] for k in WORKLOAD_COLUMNS}


def test_row_model_paths_resolve_against_the_given_folders(tmp_path):
    shutil.copy(TINY, tmp_path / "local.json")
    w = workload_from_row({"model": "local.json", "batch": "2"}, base_dirs=[tmp_path])
    assert w.batch == 2 and w.model.model_type == "llama"
    with pytest.raises(InputError, match="row has no model"):
        workload_from_row({"model": "", "batch": 2})
    with pytest.raises(InputError, match="not found"):
        workload_from_row({"model": "nowhere.json"}, base_dirs=[tmp_path])
    with pytest.raises(InputError, match="batch"):
        workload_from_row({"model": TINY, "batch": "many"})


# ---- ranks -------------------------------------------------------------------------------------

def rank_row(rank, **values) -> dict:
    row = record.empty_row()
    row.update(id="z", status="ok", message="", backend="cuda", rank=rank, world_size=2, gpu_name="G")
    row.update(values)
    return row


def test_merge_ranks_takes_the_slowest_step_and_each_memory_quantity_on_its_own():
    rows = [rank_row(0, peak_allocated_bytes=100, peak_reserved_bytes=300, device_used_bytes=500,
                     device_used_source="nvml-process", context_bytes=50, host_rss_bytes=70, weights_bytes=40,
                     step_s=1.0, step_s_min=0.9, step_s_max=1.7, step_spread=0.8, tokens_per_s=200.0, mfu=0.4,
                     wall_s=30.0),
            rank_row(1, peak_allocated_bytes=120, peak_reserved_bytes=250, device_used_bytes=450,
                     device_used_source="nvml-device", context_bytes=60, host_rss_bytes=None, weights_bytes=40,
                     step_s=1.5, step_s_min=1.4, step_s_max=1.6, step_spread=0.1333, tokens_per_s=133.0,
                     mfu=0.27, wall_s=29.0)]
    (m,) = merge_ranks(rows)
    # memory: each quantity's own largest value (allocated from rank 1, reserved and used from rank 0)
    assert (m["peak_allocated_bytes"], m["peak_reserved_bytes"], m["device_used_bytes"]) == (120, 300, 500)
    assert m["device_used_source"] == "nvml-process"  # goes with device_used_bytes (rank 0)
    assert (m["context_bytes"], m["host_rss_bytes"], m["weights_bytes"]) == (60, 70, 40)
    # time: every step column of the slowest rank (rank 1), never mixed with rank 0's
    assert (m["step_s"], m["step_s_min"], m["step_s_max"], m["step_spread"]) == (1.5, 1.4, 1.6, 0.1333)
    assert (m["tokens_per_s"], m["mfu"]) == (133.0, 0.27)
    assert m["wall_s"] == 30.0
    assert m["rank"] is None and m["status"] == "ok" and m["id"] == "z" and m["gpu_name"] == "G"


def test_merge_ranks_status_order_and_text_cells():
    rows = [rank_row(1, status="oom", message="CUDA out of memory"), rank_row(0, step_s=0.5, peak_allocated_bytes=9),
            {**rank_row(0), "id": "single", "step_s": 2.0},
            # text cells (a CSV read as strings): numbers compared as numbers, kept as text
            {**rank_row(0), "id": "t", "step_s": "9.0", "peak_allocated_bytes": "100"},
            {**rank_row(1), "id": "t", "step_s": "10.0", "peak_allocated_bytes": "99"}]
    merged = {m["id"]: m for m in merge_ranks(rows)}
    assert list(merged) == ["z", "single", "t"]
    assert merged["z"]["status"] == "oom" and merged["z"]["message"] == "CUDA out of memory"
    assert merged["z"]["peak_allocated_bytes"] == 9  # what was measured stays; the oom rank measured nothing
    assert merged["single"] == {**rank_row(0), "id": "single", "step_s": 2.0}  # one rank: unchanged
    assert (merged["t"]["step_s"], merged["t"]["peak_allocated_bytes"]) == ("10.0", "100")


def test_merge_ranks_key_keeps_files_apart():
    rows = [{**rank_row(0), "source_file": "a.csv", "step_s": 1.0}, {**rank_row(0), "source_file": "b.csv", "step_s": 2.0}]
    assert len(merge_ranks(rows)) == 1
    assert [m["step_s"] for m in merge_ranks(rows, key=("source_file", "id"))] == [1.0, 2.0]


def test_case_status():
    assert case_status([{"status": "ok"}, {"status": "oom"}, {"status": "error"}]) == "oom"
    assert case_status([{"status": "ok"}, {"status": "skipped"}]) == "skipped"
    assert case_status([{"status": "ok"}, {"status": "ok"}]) == "ok"
    assert case_status([{"status": None}]) == "error"
