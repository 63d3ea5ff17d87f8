"""scripts/estimate.py refuses bad input: exit 2, exactly one stderr line naming the bad value,
no traceback, nothing written (issue 10). One row per bad input: config files, flags, job numbers,
calibration tables, price tables, model references. Plus property tests: random bytes and random
JSON given as a config or a calibration table never raise anything but InputError."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tests.bad_input import assert_refused
from tests.scripts_loader import call_main, load_script

from estimator.api import estimate
from estimator.calibration import SCHEMA, _parse
from estimator.configs import _parse_json
from estimator.errors import InputError
from estimator.model import spec_from_config
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "tests" / "data" / "tiny-llama.json").read_text())
MIXTRAL = json.loads((ROOT / "estimator" / "catalog" / "mistralai--Mixtral-8x7B-v0.1.json").read_text())
CLI = load_script("estimate")
MODEL = "llama-3.2-1b"
GOOD_TABLE = {"schema": SCHEMA, "gpu": "h100-80gb", "factors": {"cuda_context_bytes": 600 * 2**20},
              "range": {"params_total": [1e9, 8e9], "tokens": [128, 16384]},
              "provenance": {"runs": [{"file": "x.csv", "sha256": "ab", "rows": 3}], "points": 3},
              "cv_error": {"peak_allocated_bytes": {"median_abs": 0.01, "p90_abs": 0.02, "under_rate": 0.5}},
              "upper_bound": {"peak_allocated_bytes": {"factor": 1.05, "coverage": 0.95}},
              "notes": []}


def _tiny(**changes) -> dict:
    cfg = dict(TINY)
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


_DROP = object()


def _table(**changes) -> dict:
    table = json.loads(json.dumps(GOOD_TABLE))
    for dotted, value in changes.items():
        keys = dotted.split("__")
        node = table
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return table


def _config_files(tmp: Path) -> list[tuple[str, bytes, str]]:
    """(file name, bytes, words the error must contain)."""
    j = lambda cfg: json.dumps(cfg).encode()  # noqa: E731
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        ("latin1.json", '{"model_type": "llama", "name": "caf\u00e9"}'.encode("latin-1"), "not UTF-8"),
        ("deep.json", deep, "nested more than"),
        ("deep-object.json", b'{"a":' * 200 + b"1" + b"}" * 200, "nested more than"),
        ("huge-int.json", b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}", "digits"),
        ("zero-heads.json", j(_tiny(num_attention_heads=0)), "malformed"),
        ("list-type.json", j(_tiny(model_type=["llama"])), "model_type must be text"),
        ("dict-type.json", j(_tiny(model_type={"a": 1})), "model_type must be text"),
        ("layers-1e15.json", j(_tiny(num_hidden_layers=10**15)), "num_hidden_layers must be between"),
        ("nan.json", j(_tiny(hidden_size="@")).replace(b'"@"', b"NaN"), "NaN"),
        ("infinity.json", j(_tiny(rms_norm_eps="@")).replace(b'"@"', b"Infinity"), "Infinity"),
        ("array.json", b"[1, 2, 3]", "not a JSON object"),
        ("empty.json", b"", "malformed config"),
        ("text-size.json", j(_tiny(hidden_size="256")), "malformed"),
        ("negative.json", j(_tiny(hidden_size=-256)), "malformed"),
        ("float-size.json", j(_tiny(intermediate_size=176.5)), "intermediate_size"),
        ("kv-heads.json", j(_tiny(num_key_value_heads=3)), "kv heads"),
        ("vocab-1e9.json", j(_tiny(vocab_size=10**9)), "vocab_size must be between"),
        ("bool-layers.json", j(_tiny(num_hidden_layers=True)), "integer"),
        ("unknown-type.json", j(_tiny(model_type="no_such_arch")), "not supported"),
        ("no-hidden.json", j(_tiny(hidden_size=_DROP)), "hidden_size"),
        ("layer-types.json", j(_tiny(layer_types=["full_attention"] * 3)), "layer_types"),
        ("experts-1e7.json", j({**MIXTRAL, "num_local_experts": 10**7}), "num_local_experts must be between"),
        ("top-k.json", j({**MIXTRAL, "num_experts_per_tok": 9}), "experts per token"),
        ("null.json", b"null", "not a JSON object"),
        ("truncated.json", j(_tiny())[:-10], "malformed config"),
    ]


def _tables(tmp: Path) -> list[tuple[str, bytes, str]]:
    j = lambda t: json.dumps(t).encode()  # noqa: E731
    return [
        ("range-list.json", j(_table(range=["a", "b"])), "range must be"),
        ("range-pair.json", j(_table(range__params_total=["small", "large"])), "range.params_total"),
        ("range-order.json", j(_table(range__tokens=[100, 10])), "range.tokens"),
        ("runs-text.json", j(_table(provenance__runs="all of them")), "provenance.runs"),
        ("runs-rows.json", j(_table(provenance__runs=[{"file": "x", "sha256": "a", "rows": "3"}])), "rows"),
        ("cv-number.json", j(_table(cv_error={"peak_allocated_bytes": 0.1})), "cv_error"),
        ("bound-nan.json", j(_table()).replace(b'"factor": 1.05', b'"factor": NaN'), "NaN"),
        ("no-factors.json", j({k: v for k, v in GOOD_TABLE.items() if k != "factors"}), "no factors"),
        ("latin1-table.json", j(_table(gpu="h100-80gb")).replace(b"h100-80gb", "h100-80gb\u00e9".encode("latin-1")),
         "not UTF-8"),
        ("array-table.json", b"[]", "not a gpu-budget-calibration"),
        ("unknown-key.json", j({**GOOD_TABLE, "extra": 1}), "unknown keys"),
        ("notes-text.json", j(_table(notes="fine")), "notes"),
        ("deep-table.json", b'{"notes": ' + b"[" * 5000 + b"]" * 5000 + b"}", "corrupt"),
        ("factor-text.json", j(_table(factors={"cuda_context_bytes": "600MB"})), "cuda_context_bytes"),
        ("schema-old.json", j({**GOOD_TABLE, "schema": "gpu-budget-calibration/1"}), "retired schema"),
    ]


def _flags(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "prices-negative.csv").write_text(
        "slug,provider,tier,region,multi_node,usd_per_gpu_hour,pricing,source,date\nh100-80gb,x,cloud,unstated,unstated,-2.0,on-demand,s,2026-01-01\n")
    (tmp / "prices-huge.csv").write_text(
        "slug,provider,tier,region,multi_node,usd_per_gpu_hour,pricing,source,date\nh100-80gb,x,cloud,unstated,unstated,50000,on-demand,s,2026-01-01\n")
    m = ["--model", MODEL]
    job = m + ["--samples", "1000"]
    return [
        (m + ["--seq", "1000000000000"], "seq must be between 1 and 16,777,216"),
        (m + ["--batch", "0"], "batch must be between 1 and"),
        (m + ["--batch", "-1"], "batch must be between 1 and"),
        (m + ["--batch", "2.5"], "invalid int value"),
        (m + ["--batch", "9999999999"], "batch must be between 1 and 1,048,576"),
        (m + ["--batch", "9" * 5000], "invalid int value"),
        (m + ["--gpus", "100000"], "gpus must be between 1 and 1,024"),
        (m + ["--nodes", "0"], "nodes must be between"),
        (m + ["--grad-accum", "0"], "grad_accum must be between"),
        (m + ["--lora-rank", "100000", "--method", "lora"], "lora_rank must be between"),
        (m + ["--method", "inference", "--new-tokens", "-5"], "new_tokens must be between 0"),
        (m + ["--method", "inference", "--seq", "10000000", "--new-tokens", "10000000"], "seq + new_tokens"),
        (job + ["--epochs", "nan"], "--epochs: value must be a finite number"),
        (job + ["--epochs", "inf"], "--epochs: value must be a finite number"),
        (job + ["--epochs", "-1"], "--epochs: value must be above 0"),
        (job + ["--epochs", "1e9"], "at most 10000"),
        (job + ["--retry-factor", "nan"], "--retry-factor: value must be a finite number"),
        (job + ["--retry-factor", "0.5"], "at least 1"),
        (m + ["--samples", "0"], "--samples: value must be between 1"),
        (m + ["--samples", "1e20"], "is not an integer"),
        (job + ["--cheapest", "--deadline-hours", "nan"], "--deadline-hours: value must be a finite number"),
        (job + ["--cheapest", "--deadline-hours", "-3"], "--deadline-hours: value must be above 0"),
        (["--chinchilla", "--hours", "inf"], "--hours: value must be a finite number"),
        (["--chinchilla", "--hours", "72", "--mfu", "1.5"], "--mfu: value must be above 0 and at most 1"),
        (m + ["--tp", "3", "--gpus", "8"], "must divide"),
        (m + ["--gpu", "no-such-gpu"], "unknown GPU"),
        (["--model", ""], "--model is"),
        (["--model", "no-such-model-anywhere"], "unknown model"),
        (m + ["--lora-targets", "(", "--method", "lora"], "not a regular expression"),
        (m + ["--precision", "fp64"], "invalid choice"),
        (job + ["--price-table", str(tmp / "prices-negative.csv")], "must be a positive number"),
        (job + ["--price-table", str(tmp / "prices-huge.csv")], "beyond sense"),
        (job + ["--price-table", str(tmp / "no-prices.csv")], "cannot read price file"),
        (m + ["--calibration", str(tmp / "no-table.json")], "calibration file not found"),
        (m + ["--trace", "--fit-gpus"], "--trace applies to a single estimate"),
    ]


def test_bad_config_files_are_refused_in_one_line(tmp_path, capsys):
    cases = _config_files(tmp_path)
    for name, raw, _ in cases:
        (tmp_path / name).write_bytes(raw)
    for name, _, words in cases:
        assert_refused(CLI, capsys, ["--model", str(tmp_path / name)], words, "estimate.py", tmp_path)
    assert len(cases) >= 25


def test_bad_calibration_tables_are_refused_in_one_line(tmp_path, capsys):
    cases = _tables(tmp_path)
    for name, raw, _ in cases:
        (tmp_path / name).write_bytes(raw)
    (tmp_path / "good.json").write_bytes(json.dumps(GOOD_TABLE).encode())
    code, out, err = call_main(CLI, capsys, "--model", MODEL, "--calibration", str(tmp_path / "good.json"))
    assert code == 0, err                       # the well-formed table is accepted
    for name, _, words in cases:
        assert_refused(CLI, capsys, ["--model", MODEL, "--calibration", str(tmp_path / name)], words,
                       "estimate.py", tmp_path)
    assert len(cases) >= 15


def test_bad_flags_are_refused_in_one_line(tmp_path, capsys):
    cases = _flags(tmp_path)
    for argv, words in cases:
        assert_refused(CLI, capsys, argv, words, "estimate.py", tmp_path)
    assert len(cases) >= 35


def test_an_unknown_hub_id_fails_fast_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))   # an empty cache
    start = time.perf_counter()
    assert_refused(CLI, capsys, ["--model", "some-org/no-such-model-xyz"], "unreachable", "estimate.py", tmp_path)
    assert time.perf_counter() - start < 3.0


def test_no_answer_holds_nan_or_infinity(capsys):
    # the same numbers, valid: every printed figure is finite
    code, out, err = call_main(CLI, capsys, "--model", MODEL, "--samples", "1000", "--epochs", "2", "--json")
    assert code == 0, err
    assert "NaN" not in out and "Infinity" not in out


# ---- property tests: random bytes and random JSON never raise anything but InputError ------------

def _random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "list", "dict"] if depth < 4 else ["int", "str", "null"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 2**31, 10**15, rng.randint(-10**6, 10**6)])
    if kind == "float":
        return rng.choice([0.0, 0.5, -2.5, 1e300, 1e-300, rng.uniform(-1e6, 1e6)])
    if kind == "str":
        return rng.choice(["", "llama", "mixtral", "x" * 50, "\u00e9", "1e3"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "model_type", "layer_types", "num_local_experts", "head_dim", "range",
            "factors", "provenance", "cv_error", "upper_bound", "gpu", "schema", "notes", "runs", "tokens"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))}


def _mutated_config(rng: random.Random) -> dict:
    """A real config with some fields replaced by random JSON values (reaches the mapping's arithmetic)."""
    cfg = dict(rng.choice([TINY, MIXTRAL]))
    for key in rng.sample(sorted(cfg), rng.randint(1, 3)):
        cfg[key] = _random_json(rng, 3)
    return cfg


def _mutated_table(rng: random.Random) -> dict:
    table = json.loads(json.dumps(GOOD_TABLE))
    for key in rng.sample(sorted(table), rng.randint(1, 3)):
        table[key] = _random_json(rng, 2)
    return table


def _random_inputs(rng: random.Random, mutated, n: int = 150):
    """n inputs in turn: random bytes, random JSON, a real file with some fields made random."""
    for i in range(n):
        if i % 3 == 0:
            yield bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        elif i % 3 == 1:
            yield json.dumps(_random_json(rng)).encode()
        else:
            yield json.dumps(mutated(rng)).encode()


@pytest.mark.parametrize("seed", range(4))
def test_random_configs_raise_only_input_error(seed):
    accepted = refused = 0
    for i, raw in enumerate(_random_inputs(random.Random(seed), _mutated_config)):
        try:
            spec = spec_from_config(_parse_json(raw, "random"), "random")
            for method in ("full", "inference"):   # what passes the guards is estimable
                estimate(Workload(spec, method=method, new_tokens=8 if method == "inference" else 0).validate(),
                         "h100-80gb", "none")
            accepted += 1
        except InputError:
            refused += 1
    assert refused > 0 and accepted > 0 and accepted + refused == 150


@pytest.mark.parametrize("seed", range(4))
def test_random_tables_raise_only_input_error(seed):
    refused = 0
    for i, raw in enumerate(_random_inputs(random.Random(1000 + seed), _mutated_table)):
        try:
            _parse(f"random-{seed}-{i}", raw, "h100-80gb", False)
        except InputError:
            refused += 1
    assert refused > 0


def test_valid_configs_still_build():
    # the guards refuse nonsense only: the real configs above pass them
    assert spec_from_config(_parse_json(json.dumps(TINY).encode(), "tiny"), "tiny").num_layers == TINY[
        "num_hidden_layers"]
    assert spec_from_config(_parse_json(json.dumps(MIXTRAL).encode(), "mixtral"), "mixtral").num_experts == 8
