"""estimator/flags.py: one flag per Workload field, generated from the fields' metadata, shared by
scripts/estimate.py and scripts/profile.py; flags -> Workload keyword arguments -> flags round trip."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest

from tests.scripts_loader import call_main, load_script

from estimator import flags, report
from estimator.configs import load_spec
from estimator.params import ALL_LINEAR
from estimator.workload import Workload
from profiler.case import Case

TINY = Path(__file__).with_name("data") / "tiny-llama.json"
ESTIMATE = load_script("estimate")
PROFILE = load_script("profile")


def _options(parser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def test_every_workload_field_has_exactly_one_flag():
    names = [f.name for f in fields(Workload)]
    assert [flag.field for flag in flags.FLAGS] == names
    options = [flag.option for flag in flags.FLAGS]
    assert len(set(options)) == len(options)
    for f in fields(Workload):
        assert f.metadata.get("help"), f"Workload field {f.name} has no flag help"


def test_a_field_without_flag_metadata_is_refused():
    @dataclass(frozen=True)
    class Bare:
        size: int = 1
        other: int = field(default=2, metadata=dict(help="documented"))

    with pytest.raises(TypeError, match="'size' has no flag metadata"):
        flags._flag(fields(Bare)[0])
    assert flags._flag(fields(Bare)[1]).option == "--other"


def test_flag_kinds_follow_the_field():
    by = flags.BY_FIELD
    assert by["grad_ckpt"].option == "--grad-ckpt" and by["grad_ckpt"].switch_value is True
    assert by["double_quant"].option == "--no-double-quant" and by["double_quant"].switch_value is False
    assert by["zero"].choices == (0, 1, 2, 3) and by["zero"].parse("3") == 3
    assert by["lora_targets"].parse("all-linear") == ALL_LINEAR
    assert by["lora_targets"].parse(" q_proj, o_proj ") == ("q_proj", "o_proj")
    assert by["model"].option == "--model" and by["model"].default is None


@pytest.mark.parametrize("script", [ESTIMATE, PROFILE], ids=["estimate", "profile"])
def test_both_command_lines_take_every_workload_flag(script):
    options = _options(script._parser())
    missing = {flag.option for flag in flags.FLAGS} - options
    assert not missing
    assert {"--nodes", "--tp", "--pp"} <= options


def test_the_two_command_lines_share_the_workload_flags():
    workload = {flag.option for flag in flags.FLAGS}
    assert _options(ESTIMATE._parser()) & workload == _options(PROFILE._parser()) & workload


SETTINGS = dict(model=str(TINY), method="qlora", precision="bf16", optimizer="paged-adamw-8bit",
                adamw_impl="foreach", batch=3, seq=96, grad_accum=2, lora_rank=8,
                lora_targets=("q_proj", "k_proj", "o_proj"), grad_ckpt=True, attn="eager", quant="fp4",
                double_quant=False, gpus=2, nodes=2, zero=0, offload="none", tp=2, pp=2)


@pytest.mark.parametrize("script", [ESTIMATE, PROFILE], ids=["estimate", "profile"])
def test_round_trip_settings_to_flags_to_workload(script):
    argv = flags.to_argv(SETTINGS)
    args = script._parser().parse_args(argv)
    assert flags.given(args) == SETTINGS
    w = flags.workload_from_args(args)
    expected = Workload(model=load_spec(str(TINY)), **{k: v for k, v in SETTINGS.items() if k != "model"})
    assert w == expected.validate()
    # the profiler's configuration of the same flags is the same Workload
    case = Case(SETTINGS["model"], {k: v for k, v in SETTINGS.items() if k != "model"})
    assert case.id == w.id


def test_no_flags_given_is_the_default_workload_and_qlora_means_nf4():
    args = ESTIMATE._parser().parse_args(["--model", str(TINY)])
    assert flags.given(args) == {"model": str(TINY)}
    assert flags.workload_from_args(args) == Workload(model=load_spec(str(TINY)))
    args = ESTIMATE._parser().parse_args(["--model", str(TINY), "--method", "qlora"])
    assert flags.workload_from_args(args).quant == "nf4"
    args = ESTIMATE._parser().parse_args(["--model", str(TINY), "--method", "qlora", "--quant", "fp4"])
    assert flags.workload_from_args(args).quant == "fp4"


def test_help_overrides_only_known_fields():
    parser = flags.OneLineParser(prog="x")
    with pytest.raises(ValueError, match="nope"):
        flags.add_workload_flags(parser, help={"nope": "text"})


def test_report_renders_and_reads_no_arguments():
    source = inspect.getsource(report)
    assert "argparse" not in source and "args." not in source and "args)" not in source


@pytest.mark.parametrize("argv, words", [
    (["--model", str(TINY), "--nodes", "2", "--gpus", "1"], "multi-node"),
    (["--batch", "4"], "--batch: workload flags describe one configuration"),
    (["--model", str(TINY), "--tp", "3"], "tp x pp = 3 must divide the 1 GPUs"),
])
def test_profile_workload_flags_bad_input(tmp_path, capsys, argv, words):
    code, out, err = call_main(PROFILE, capsys, *argv, "--backend", "cpu", "--run", str(tmp_path / "run"))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("profile.py: error: ") and words in err
    assert not (tmp_path / "run").exists()
