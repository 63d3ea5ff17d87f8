"""GPT-OSS's MXFP4 experts (issue 14): stored as shipped for inference, dequantized to bf16 for
training, refused where transformers 5.23 has no MXFP4 path (other families, training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bad_input import assert_refused
from tests.scripts_loader import call_main, load_script

from estimator.api import estimate
from estimator.configs import load_spec
from estimator.memory import estimate_memory
from estimator.params import count_params
from estimator.sources import quantization
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
CLI = load_script("estimate")
CONFIG = json.loads((ROOT / "estimator" / "catalog" / "openai--gpt-oss-20b.json").read_text())


def _w(**changes) -> Workload:
    settings = dict(method="inference", attn="eager", batch=1, seq=1024, quant="mxfp4")
    settings.update(changes)
    return Workload(load_spec("gpt-oss-20b"), **settings).validate()


def test_weights_pack_the_routed_experts_only():
    # The routed experts from the config's own numbers: per layer gate_up (E x 2I x H) and down
    # (E x H x I); MXFP4 stores half a byte per element plus one scale byte per 32 elements
    # (OCP MX v1.0), everything else (attention, router, biases, embeddings, lm_head) stays bf16
    layers, experts = CONFIG["num_hidden_layers"], CONFIG["num_local_experts"]
    hidden, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    expert_elements = layers * experts * 3 * hidden * inter
    total = count_params(load_spec("gpt-oss-20b")).total
    expected = expert_elements * (0.5 + 1 / 32) + (total - expert_elements) * 2
    got = estimate_memory(_w(), 0.0, 0).weights_bytes
    assert got == int(expected)
    bf16 = estimate_memory(_w(quant="none"), 0.0, 0).weights_bytes
    assert bf16 == total * 2 and got < 0.4 * bf16


def test_fits_the_16_gb_openai_states():
    # OpenAI's model card (huggingface.co/openai/gpt-oss-20b): the model "can run within 16GB of
    # memory" with its MXFP4 experts
    result = estimate(_w(seq=512, new_tokens=256), "rtx4090-24gb", "none")
    assert result.memory.peak_allocated_bytes < 16e9


def test_no_dequantized_copy_and_fewer_bytes_per_decode_step():
    from estimator.timing import decode_parts
    from estimator import tables

    mx, bf = estimate(_w(), "h100-80gb", "none"), estimate(_w(quant="none"), "h100-80gb", "none")
    assert mx.memory.quant_workspace_bytes == 0          # matmul_ogs reads the packed experts
    gpu = tables.gpu("h100-80gb")
    moved_mx = decode_parts(_w(), gpu, mx.memory, 1024).moved_bytes
    moved_bf = decode_parts(_w(quant="none"), gpu, bf.memory, 1024).moved_bytes
    assert moved_bf - moved_mx == bf.memory.weights_bytes - mx.memory.weights_bytes


def test_the_shipped_quantization_config_reads_as_mxfp4_or_dequantized():
    assert quantization.read({"quant_method": "mxfp4"}).fields == {"quant": "mxfp4"}
    assert quantization.read({"quant_method": "mxfp4", "dequantize": True}).fields == {"quant": "none"}


def _json(capsys, *argv) -> dict:
    code, out, err = call_main(CLI, capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_the_catalog_model_serves_mxfp4_and_trains_bf16(capsys):
    served = _json(capsys, "--model", "gpt-oss-20b", "--method", "inference", "--seq", "512")
    assert served["workload"]["quant"] == "mxfp4"
    assert any("MXFP4 experts as shipped" in n for n in served["regime"])
    trained = _json(capsys, "--model", "gpt-oss-20b", "--method", "lora", "--seq", "512")
    assert trained["workload"]["quant"] == "none"
    assert any("MXFP4 does not train" in n for n in trained["regime"])
    assert trained["memory"]["weights_bytes"] > 2.5 * served["memory"]["weights_bytes"]


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama-3.2-1b", "--method", "inference", "--quant", "mxfp4"], "GPT-OSS's experts only"),
    (["--model", "gpt-oss-20b", "--method", "lora", "--quant", "mxfp4"], "do not train"),
])
def test_refused_where_transformers_has_no_mxfp4_path(capsys, argv, words):
    assert_refused(CLI, capsys, argv, words, "estimate.py", ROOT / "calibrations")


def test_the_profiler_and_the_tracer_say_they_do_not_build_it():
    from profiler.build import MissingPackage, check_packages
    from profiler.trace_scope import check_traceable

    with pytest.raises(MissingPackage, match="mxfp4"):
        check_packages(_w())
    with pytest.raises(NotImplementedError, match="MXFP4"):
        check_traceable(_w())
