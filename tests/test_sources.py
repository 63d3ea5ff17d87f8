"""Users' own files -> the Workload (estimator/sources, issue 15): each file kind gives the same answer
as the equivalent flags, byte for byte; each setting says where it came from; unknown keys are listed,
settings the estimator does not model are said; explicit flags override files; two files that
disagree, and wrong types, are one-line errors. TrainingArguments' own `to_dict()` is an oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bad_input import assert_refused
from tests.scripts_loader import call_main, load_script

from estimator.sources import Reading, combine, deepspeed, training_args

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "tests" / "data" / "userfiles"
CLI = load_script("estimate")


def answer(capsys, *argv) -> dict:
    code, out, err = call_main(CLI, capsys, *argv, "--json", "--calibration", "none", "--samples", "10000")
    assert code == 0, err
    return json.loads(out)


# file flags -> the equivalent explicit flags (written out by hand from the files)
EQUIVALENTS = [
    (["--model", "llama-3.1-8b", "--training-args", str(FILES / "sft_config.json"),
      "--peft", str(FILES / "adapter_config.json"), "--gpus", "8"],
     ["--model", "llama-3.1-8b", "--method", "lora", "--lora-rank", "32", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
      "--lora-dropout", "--batch", "2", "--grad-accum", "8", "--grad-ckpt", "--precision", "bf16", "--optimizer", "paged-adamw-8bit",
      "--seq", "2048", "--zero", "3", "--offload", "optimizer", "--gpus", "8", "--epochs", "3"]),
    (["--axolotl", str(FILES / "axolotl_qlora.yaml")],
     ["--model", "meta-llama/Llama-3.1-8B", "--method", "qlora", "--quant", "nf4", "--lora-rank", "16",
      "--lora-targets", "all-linear", "--lora-dropout", "--seq", "4096", "--batch", "1", "--grad-accum", "4", "--grad-ckpt",
      "--precision", "bf16", "--optimizer", "paged-adamw-8bit", "--attn", "flash", "--epochs", "2"]),
    (["--llamafactory", str(FILES / "llamafactory_lora.yaml")],
     ["--model", "Qwen/Qwen2.5-7B-Instruct", "--method", "lora", "--lora-rank", "8", "--lora-targets", "all-linear",
      "--seq", "2048", "--batch", "1", "--grad-accum", "8", "--precision", "bf16", "--attn", "flash",
      "--epochs", "3"]),
    (["--model", "llama-3.1-8b", "--method", "lora", "--accelerate-config", str(FILES / "accelerate_fsdp.yaml")],
     ["--model", "llama-3.1-8b", "--method", "lora", "--fsdp", "hybrid", "--gpus", "8", "--nodes", "2",
      "--precision", "bf16", "--grad-ckpt"]),
    (["--model", "llama-3.1-8b", "--peft", str(FILES / "adapter_config.json"),
      "--quant-config", str(FILES / "bnb_nf4.json")],
     ["--model", "llama-3.1-8b", "--method", "qlora", "--quant", "nf4", "--lora-rank", "32",
      "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--lora-dropout"]),
]


@pytest.mark.parametrize("from_files, from_flags", EQUIVALENTS, ids=["sft+peft+ds", "axolotl", "llamafactory",
                                                                      "accelerate", "peft+bnb"])
def test_files_give_the_answer_of_the_equivalent_flags_to_the_byte(capsys, from_files, from_flags):
    files, flags = answer(capsys, *from_files), answer(capsys, *from_flags)
    sources = files.pop("sources")
    assert json.dumps(files, sort_keys=True) == json.dumps(flags, sort_keys=True)
    assert "sources" not in flags                          # flags alone: nothing to attribute
    assert any(v != "flag" for v in sources["origin"].values())


def test_each_setting_names_its_file_and_key_and_nothing_is_dropped_silently(capsys):
    data = answer(capsys, "--model", "llama-3.1-8b", "--training-args", str(FILES / "sft_config.json"))
    origin = data["sources"]["origin"]
    assert origin["batch"].endswith("sft_config.json: per_device_train_batch_size")
    assert origin["zero"] == "ds_zero3.json: zero_optimization: stage"
    assert origin["epochs"].endswith("sft_config.json: num_train_epochs")
    assert origin["model"] == "flag"
    assert any(i.endswith("some_future_option") for i in data["sources"]["ignored"])
    assert any("packing" in u for u in data["sources"]["unmodelled"])
    assert data["job"]["epochs"] == 3.0


def test_explicit_flags_override_files(capsys):
    data = answer(capsys, "--model", "llama-3.1-8b", "--training-args", str(FILES / "sft_config.json"),
                  "--batch", "4", "--zero", "2")
    assert data["workload"]["batch"] == 4 and data["workload"]["zero"] == 2
    assert data["sources"]["origin"]["batch"] == "flag" and data["sources"]["origin"]["zero"] == "flag"
    assert data["workload"]["grad_accum"] == 8                  # the rest still from the file


def test_text_output_lists_where_settings_came_from(capsys):
    code, out, err = call_main(CLI, capsys, "--axolotl", str(FILES / "axolotl_qlora.yaml"))
    assert code == 0, err
    assert "settings from files (explicit flags override them):" in out
    assert "axolotl_qlora.yaml: lora_target_linear" in out


def test_trainingarguments_own_dict_is_read():
    # the oracle: transformers' TrainingArguments fills its own defaults (optim, precision flags)
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/x", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             gradient_checkpointing=True, num_train_epochs=2, use_cpu=True)
    r = training_args.workload_fields(args.to_dict(), "trainer")
    assert r.fields["batch"] == 3 and r.fields["grad_accum"] == 2 and r.fields["grad_ckpt"] is True
    assert (r.fields["optimizer"], r.fields["adamw_impl"]) == ("adamw", "fused")   # torch >= 2.8 default
    assert r.job["epochs"] == 2.0
    assert "precision" not in r.fields                          # bf16 and fp16 both false: weights as loaded


def test_trl_activation_offloading_is_read():
    """TRL's SFTConfig(activation_offloading=True) (trl/trainer/sft_config.py; DPO, KTO and reward
    configs have it too) is --activation-offload: read, not listed as unmodelled or ignored."""
    r = training_args.workload_fields({"activation_offloading": True, "per_device_train_batch_size": 2}, "sft")
    assert r.fields["activation_offload"] is True and r.origin["activation_offload"] == "sft: activation_offloading"
    assert not r.unmodelled and not r.ignored
    assert training_args.workload_fields({"activation_offloading": False}, "sft").fields["activation_offload"] is False


@pytest.mark.parametrize("recipe, fields, unmodelled", [
    ({"gradient_checkpointing": True, "activation_offloading": True}, {"grad_ckpt": True, "activation_offload": True}, ""),
    ({"gradient_checkpointing": "offload"}, {"grad_ckpt": True, "activation_offload": True}, ""),
    ({"gradient_checkpointing": True, "activation_offloading": "legacy"}, {"grad_ckpt": True}, "'legacy'"),
    ({"gradient_checkpointing": "offload_disk"}, {"grad_ckpt": True}, "offload_disk"),
])
def test_axolotl_activation_offloading_is_read(recipe, fields, unmodelled):
    """axolotl: `activation_offloading: true` is TRL's OffloadActivations around checkpointed layers;
    `gradient_checkpointing: offload` converts to it; its own `legacy` and `disk` offloading are said
    to be not modelled (and are not counted as TRL's)."""
    from estimator.sources import axolotl

    r = axolotl.read(recipe, "recipe")
    assert {k: v for k, v in r.fields.items() if k in ("grad_ckpt", "activation_offload")} == fields
    assert not r.ignored
    assert (any(unmodelled in u for u in r.unmodelled) if unmodelled else not r.unmodelled)


def test_deepspeed_auto_sizes_are_the_modelled_ones_and_explicit_sizes_are_said():
    auto = deepspeed.read({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                 "stage3_prefetch_bucket_size": "auto"}})
    assert auto.fields == {"zero": 3} and auto.unmodelled == []
    explicit = deepspeed.read({"zero_optimization": {"stage": 2, "reduce_bucket_size": 500000000}})
    assert explicit.fields == {"zero": 2}
    assert any("reduce_bucket_size = 500000000" in u for u in explicit.unmodelled)
    assert deepspeed.read({"fp16": {"enabled": True}}).fields == {"precision": "fp16"}


def test_two_files_that_disagree_are_an_error():
    a = Reading(fields={"batch": 2}, origin={"batch": "a.json: per_device_train_batch_size"})
    b = Reading(fields={"batch": 4}, origin={"batch": "b.json: train_micro_batch_size_per_gpu"})
    with pytest.raises(Exception, match="gives batch = 2 but b.json"):
        combine([a, b])
    assert combine([a, Reading(fields={"batch": 2}, origin={"batch": "c"})]).fields == {"batch": 2}


def test_bad_files_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "types.json").write_text(json.dumps({"per_device_train_batch_size": "two"}))
    (tmp_path / "both.json").write_text(json.dumps({"bf16": True, "fp16": True}))
    (tmp_path / "stage.json").write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    (tmp_path / "prefix.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    (tmp_path / "gptq.json").write_text(json.dumps({"quant_method": "gptq", "bits": 4}))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("a: [\n")
    (tmp_path / "procs.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n")
    (tmp_path / "adapter.yaml").write_text("base_model: llama-3.1-8b\nadapter: ia3\n")
    (tmp_path / "dropout.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_dropout": 1.5}))
    m = ["--model", "llama-3.1-8b"]
    cases = [
        (m + ["--training-args", str(tmp_path / "types.json")], "per_device_train_batch_size must be int"),
        (m + ["--training-args", str(tmp_path / "both.json")], "bf16 and fp16 are both true"),
        (m + ["--deepspeed", str(tmp_path / "stage.json")], "stage must be 0-3"),
        (m + ["--peft", str(tmp_path / "prefix.json")], "PREFIX_TUNING"),
        (m + ["--quant-config", str(tmp_path / "gptq.json")], "gptq"),
        (m + ["--training-args", str(tmp_path / "list.yaml")], "not a mapping"),
        (m + ["--accelerate-config", str(tmp_path / "broken.yaml")], "malformed"),
        (m + ["--accelerate-config", str(tmp_path / "procs.yaml")], "multiple of num_machines"),
        (["--axolotl", str(tmp_path / "adapter.yaml")], "adapter 'ia3'"),
        (m + ["--peft", str(tmp_path / "missing.json")], "cannot read"),
        (m + ["--peft", str(tmp_path / "dropout.json")], "lora_dropout must be a probability"),
        (m + ["--training-args", str(FILES / "sft_config.json"), "--deepspeed",
              str(FILES / "ds_zero3.json"), "--zero", "2"], ""),   # flags win: no error (checked below)
    ]
    for argv, words in cases[:-1]:
        assert_refused(CLI, capsys, argv, words, "estimate.py", tmp_path)
    code, out, err = call_main(CLI, capsys, *cases[-1][0])
    assert code == 0, err


@pytest.mark.parametrize("dropout, expected", [(0.05, True), (0.0, False)])
def test_lora_dropout_is_read_from_each_recipe(dropout, expected):
    from estimator.sources import axolotl, llamafactory, peft

    readings = [peft.read({"peft_type": "LORA", "r": 8, "lora_dropout": dropout}),
                axolotl.read({"base_model": "m", "adapter": "lora", "lora_dropout": dropout}),
                llamafactory.read({"model_name_or_path": "m", "finetuning_type": "lora", "lora_dropout": dropout})]
    for r in readings:
        assert r.fields.get("lora_dropout", False) is expected
        assert not any("lora_dropout" in i for i in r.ignored)
    # a full fine-tune's recipe: nothing to drop out, the key is neither a setting nor ignored
    full = llamafactory.read({"model_name_or_path": "m", "finetuning_type": "full", "lora_dropout": dropout})
    assert "lora_dropout" not in full.fields and not any("lora_dropout" in i for i in full.ignored)


def test_dora_with_lora_dropout_is_said_as_not_modelled():
    from estimator.sources import peft

    r = peft.read({"peft_type": "LORA", "r": 8, "use_dora": True, "lora_dropout": 0.1})
    assert r.fields["dora"] is True and "lora_dropout" not in r.fields
    assert any("lora_dropout = 0.1" in u and "DoRA" in u for u in r.unmodelled)


@pytest.mark.parametrize("backend, expected", [("AO", "torchao"), ("TE", "te"), (None, "torchao")])
def test_accelerate_fp8_backend_is_read(backend, expected):
    from estimator.sources import accelerate

    config = {"mixed_precision": "fp8", **({"fp8_config": {"backend": backend}} if backend else {})}
    r = accelerate.read(config)
    assert r.fields["precision"] == "fp8"
    assert r.fields.get("fp8_backend", "torchao") == expected
    msamp = accelerate.read({"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"}})
    assert "precision" not in msamp.fields and any("MSAMP" in u for u in msamp.unmodelled)
    longer = accelerate.read({"mixed_precision": "fp8", "fp8_config": {"backend": "TE", "amax_history_len": 16}})
    assert any("amax_history_len = 16" in u for u in longer.unmodelled)


def test_llamafactory_freeze_vision_tower_false_trains_the_tower():
    from estimator.sources import llamafactory

    base = {"model_name_or_path": "Qwen/Qwen2.5-VL-7B-Instruct", "finetuning_type": "full"}
    assert "train_vision" not in llamafactory.read(base).fields                       # LLaMA-Factory's default: frozen
    assert "train_vision" not in llamafactory.read(dict(base, freeze_vision_tower=True)).fields
    assert llamafactory.read(dict(base, freeze_vision_tower=False)).fields["train_vision"] is True
    lora = llamafactory.read(dict(base, finetuning_type="lora", freeze_vision_tower=False))
    assert "train_vision" not in lora.fields          # LoRA: the targets decide what trains
