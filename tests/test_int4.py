"""GPTQ and AWQ int4 checkpoints for inference (`--quant gptq|awq`, estimator.states.int4_linear_bytes)
against hand counts of their packed layouts, 4 bits with groups of 128 input rows:
- GPTQ (AutoGPTQ/GPTQModel QuantLinear): qweight int32 [in/8, out], qzeros int32 [in/128, out/8],
  scales fp16 [in/128, out], g_idx int32 [in];
- AWQ (AutoAWQ WQLinear_GEMM): qweight int32 [in, out/8], qzeros and scales as GPTQ's, no g_idx.
Llama-3.1-8B (H = 4096, I = 14336, k/v 1024, V = 128256, 32 layers), per layer:
  (qweight + scales + qzeros)
  q, o  (4096 x 4096):     8,388,608 + 262,144 +  65,536 =  8,716,288 B each
  k, v  (4096 x 1024):     2,097,152 +  65,536 +  16,384 =  2,179,072 B each
  gate, up (4096 x 14336): 29,360,128 + 917,504 + 229,376 = 30,507,008 B each
  down (14336 x 4096):     29,360,128 + 917,504 + 229,376 = 30,507,008 B
  sum 113,311,744 B (AWQ); GPTQ's g_idx 4 x (6 x 4096 + 14336) = 155,648 B more.
Embeddings, lm_head (2 x 128256 x 4096) and norms (65 x 4096) stay bf16: 2,101,878,784 B.
"""

from __future__ import annotations

import pytest

from estimator.api import estimate
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.workload import Workload

LLAMA = load_spec("llama-3.1-8b")
PER_LAYER_AWQ = 2 * 8_716_288 + 2 * 2_179_072 + 3 * 30_507_008
REST = 2 * (2 * 128_256 * 4096 + 65 * 4096)


def _w(quant: str, **kw) -> Workload:
    return Workload(model=LLAMA, method="inference", quant=quant, **kw).validate()


def test_the_packed_layouts_are_the_hand_counts():
    assert PER_LAYER_AWQ == 113_311_744 and REST == 2_101_878_784
    awq = estimate(_w("awq"), "h100-80gb", "none").memory
    gptq = estimate(_w("gptq"), "h100-80gb", "none").memory
    assert awq.weights_bytes == 32 * PER_LAYER_AWQ + REST == 5_727_854_592
    assert gptq.weights_bytes == 32 * (PER_LAYER_AWQ + 155_648) + REST == 5_732_835_328


def test_tensor_parallel_splits_the_packed_linears():
    one, two = (estimate(_w("awq", gpus=n, tp=n), "h100-80gb", "none").memory for n in (1, 2))
    assert two.weights_bytes == (32 * PER_LAYER_AWQ + REST) // 2


def test_the_prefill_counts_one_dequantized_widest_linear_and_decode_reads_packed_weights():
    from estimator.memory import components
    from estimator.timing import decode_parts

    assert components(_w("gptq")).quant_workspace == 2 * 4096 * 14336
    e = estimate(_w("gptq", new_tokens=16), "h100-80gb", "none")
    parts = decode_parts(_w("gptq", new_tokens=16), _gpu(), e.memory, 512)
    assert parts.slowdown == 1.0
    assert parts.moved_bytes - e.memory.weights_bytes == pytest.approx(
        2 * 2 * 32 * 1024 * 512, rel=1e-12)   # bf16 k and v of 32 layers x 1024 wide x 512 cached tokens
    assert any("GPTQ int4" in n for n in e.regime_notes)


def _gpu():
    from estimator import tables

    return tables.gpu("h100-80gb")


@pytest.mark.parametrize("model,kw,words", [
    ("llama-3.1-8b", dict(method="lora"), "LoRA on GPTQ bases"),
    ("qwen1.5-moe-a2.7b", dict(method="inference"), "MoE"),
    ("qwen2.5-vl-7b", dict(method="inference"), "vision-language"),
    ("gpt2", dict(method="inference"), "Conv1D"),
])
def test_what_is_not_modelled_is_refused_in_one_line(model, kw, words):
    with pytest.raises(InputError, match=words):
        Workload(model=load_spec(model), quant="gptq", **kw).validate()


def test_the_profiler_skips_int4_checkpoints():
    from profiler import build

    with pytest.raises(build.MissingPackage, match="quant awq"):
        build.check_packages(_w("awq"))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_checkpoints_quantization_config_reads_as_its_quant(method):
    from estimator.sources import quantization

    cfg = {"quant_method": method, "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert quantization.read(cfg).fields["quant"] == method
    with pytest.raises(InputError, match="bits 8"):
        quantization.read(dict(cfg, bits=8))
    with pytest.raises(InputError, match="group_size 32"):
        quantization.read(dict(cfg, group_size=32))


@pytest.mark.parametrize("args,words", [
    (("--quant", "gptq", "--method", "lora"), "LoRA on GPTQ bases"),
    (("--quant", "awq", "--model", "qwen1.5-moe-a2.7b"), "MoE"),
    (("--train-vision", "--method", "full"), "no vision tower"),
    (("--loss", "chunked", "--method", "lora", "--model", "gemma-2-2b", "--attn", "eager"), "--loss chunked"),
])
def test_command_line_refuses_in_one_line(args, words):
    """The flags this file's regimes brought, refused in one line with exit 2 (no traceback)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "scripts" / "estimate.py"), "--model", "llama-3.1-8b",
                          "--method", "inference", "--calibration", "none", *args],
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in run.stderr
