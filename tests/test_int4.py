"""GPTQ and AWQ int4 checkpoints for inference (`--quant gptq|awq`, estimator.states.int4_linear_bytes),
and LoRA on a GPTQ base (`--method lora --quant gptq`), against hand counts of their packed layouts,
4 bits with groups of 128 input rows:
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
LoRA on GPTQ (gptqmodel's trainable TorchLinear dequantizes the whole weight, [in, out] in bf16, in every
forward and its matmul saves it for the input's gradient): per layer q, o 16,777,216 + k, v 4,194,304 +
gate, up, down 58,720,256 elements each = 218,103,808 elements, 436,207,616 B.
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


LAYER_WEIGHT_ELEMENTS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
QKV_ELEMENTS = 4096 * (4096 + 1024 + 1024)


def _lora(quant: str = "gptq", **kw) -> Workload:
    return Workload(model=LLAMA, method="lora", quant=quant, **kw).validate()


def test_lora_on_gptq_holds_each_linears_dequantized_copy_to_the_backward():
    """No checkpointing: every layer's copies, less the first layer's q, k and v, whose input (the
    frozen embedding's normed output) needs no gradient, so their matmuls save nothing."""
    from estimator import activations as act
    from estimator.memory import components

    assert LAYER_WEIGHT_ELEMENTS == 218_103_808 and QKV_ELEMENTS == 25_165_824
    plain = components(Workload(model=LLAMA, method="lora", precision="bf16").validate())
    gptq = components(_lora())
    held = 2 * (32 * LAYER_WEIGHT_ELEMENTS - QKV_ELEMENTS)
    assert held == 13_908_312_064
    assert gptq.activations - plain.activations == held
    assert act.layer_fixed_bytes(act.activation_key(_lora())) == held // 32
    # the packed base and the bf16 rest, plus the default adapters (rank 16 on q and v, fp32)
    adapters = 4 * 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    assert gptq.weights == 32 * (PER_LAYER_AWQ + 155_648) + REST + adapters
    # the widest linear's torch dequantization above its saved copy: int8 codes, half scales
    # gathered and the int8 difference (1 + 2 + 1 B per element) at the product
    assert gptq.quant_workspace == 4 * 4096 * 14336


def test_torchs_matmul_saves_only_the_weight_when_only_the_input_needs_a_gradient():
    """The premise of `int4_dequantized_bytes_per_layer`, with torch as the oracle: TorchLinear's
    `torch.matmul(x.reshape(-1, in), weights)` with a dequantized weight that needs no gradient keeps
    the [in, out] weight for the input's gradient and not the input."""
    import torch

    x = torch.randn(2, 3, 8, requires_grad=True)
    weights = torch.randn(8, 16, dtype=torch.float32)
    out = torch.matmul(x.reshape(-1, 8), weights)
    saved = out.grad_fn._saved_mat2
    assert saved.data_ptr() == weights.data_ptr() and tuple(saved.shape) == (8, 16)
    assert out.grad_fn._saved_self is None


def test_a_calibrated_activation_scale_leaves_the_dequantized_copies_alone():
    """The scale corrects the activation formulas (measured / formula); the copies are weights,
    exact bytes: activations = copies + scale x the rest."""
    from estimator.calibration import NONE, memory_corrections
    from estimator.memory import assemble, components

    w = _lora()
    parts = components(w)
    held = 2 * (32 * LAYER_WEIGHT_ELEMENTS - QKV_ELEMENTS)
    assert parts.weight_copies == held
    corrections = memory_corrections(NONE, w)[0]._replace(activation_scale=2.0)
    assert assemble(parts, corrections).activations_bytes == int(held + 2 * (parts.activations - held))


def test_the_safe_bound_counts_the_copies_as_exact():
    from estimator.bounds import exact_bytes

    m = estimate(_lora(), "h100-80gb", "none").memory
    assert m.peak_phase == "forward/backward"
    assert m.weight_copies_bytes == 2 * (32 * LAYER_WEIGHT_ELEMENTS - QKV_ELEMENTS)
    assert exact_bytes(m) == (m.weights_bytes + m.optimizer_states_bytes + m.blas_workspace_bytes
                              + m.weight_copies_bytes)


def test_checkpointing_keeps_the_recomputed_layers_copies_and_the_forwards_scratch():
    from estimator import activations as act
    from estimator.memory import components

    w = _lora(grad_ckpt=True)
    assert act.layer_fixed_bytes(act.activation_key(w)) == 2 * LAYER_WEIGHT_ELEMENTS == 436_207_616
    assert components(w).quant_workspace == 6 * 4096 * 14336   # the half copy is scratch too


def test_a_first_layer_with_no_adapter_before_down_proj_saves_only_down_projs_copy():
    """LoRA on down_proj only: in the first layer nothing before down_proj's adapter needs a
    gradient, so q, k, v, o, gate and up save nothing; down_proj's input (the MLP's product) does not
    need one either (the adapter reads it, the base's matmul saves only for an input needing a gradient)."""
    from estimator import activations as act

    w = _lora(lora_targets=("down_proj",))
    gradless = QKV_ELEMENTS + 4096 * 4096 + 2 * 4096 * 14336 + 14336 * 4096
    assert act.layer_fixed_bytes(act.activation_key(w)) == 2 * (32 * LAYER_WEIGHT_ELEMENTS - gradless) // 32


def test_zero_2_partitions_the_adapters_states_and_leaves_the_packed_base_whole():
    """ZeRO-1/2 partition what trains: the packed base and its saved copies stay per GPU as on one
    GPU (the DeepSpeed bf16 section keeps the half rest half); the adapters' gradients and Adam
    states are split over the 2 ranks."""
    from estimator.memory import components

    one, two = components(_lora()), components(_lora(zero=2, gpus=2))
    adapters = 32 * 16 * ((4096 + 4096) + (4096 + 1024))     # rank 16 on q and v
    assert two.weight_copies == one.weight_copies
    assert two.weights == 32 * (PER_LAYER_AWQ + 155_648) + REST + 2 * adapters   # bf16 adapters
    assert two.optimizer_states == 8 * adapters / 2                              # fp32 Adam states, halved


def test_kbit_preparation_leaves_a_gptq_model_as_loaded():
    from estimator.memory import components

    on, off = (components(_lora(kbit_prep=s)) for s in ("on", "off"))
    assert on.weights == off.weights and on.activations == off.activations
    notes = estimate(_lora(kbit_prep="on"), "h100-80gb", "none").regime_notes
    assert any("skips the fp32 upcast for GPTQ" in n for n in notes)
    assert any("saves that half copy" in n for n in notes)


def test_lora_on_gptq_dequantizes_once_per_forward():
    """The forward dequantizes (reads the packed linears, writes bf16 copies); the backward reuses
    the saved copies; a checkpointed step's recomputation dequantizes once more."""
    from estimator.compute_time import bandwidth, compute_parts

    # torch dequantization in training mode, per element: shift to int32 (write 4), cast to int8
    # (read 4, write 1), mask (1 + 1), zeros gathered (1), difference (2 + 1), scales gathered (2),
    # product (read 2 + 1, write 2): 22 B, besides the packed weights read once
    per_use = 32 * (PER_LAYER_AWQ + 155_648) + 22 * 32 * LAYER_WEIGHT_ELEMENTS
    one = compute_parts(_lora(), _gpu(), 0.5).dequant_s
    assert one == pytest.approx(per_use / bandwidth(_gpu()), rel=1e-12)
    assert compute_parts(_lora(grad_ckpt=True), _gpu(), 0.5).dequant_s == pytest.approx(2 * one, rel=1e-12)


def test_lora_on_gptq_dispatches_torchlinears_dequantization_per_forward():
    """19 aten operators per quantized linear (scripts/check_gptq_lora.py --ops counted them on
    gptqmodel 7.7.0) in each forward and each recomputation: Llama's 32 layers x 7 linears."""
    from estimator.ops import micro_batch_ops

    for ckpt, forwards in ((False, 1), (True, 2)):
        plain = micro_batch_ops(Workload(model=LLAMA, method="lora", precision="bf16", grad_ckpt=ckpt).validate())
        assert micro_batch_ops(_lora(grad_ckpt=ckpt)) - plain == forwards * 32 * 7 * 19
    # Qwen2.5-7B's biased q, k and v (28 layers): TorchLinear adds the bias after its matmul, 2 more
    # operators in the forward, 6 in the backward, 5 in a recomputation (check_gptq_lora.py --family qwen2)
    qwen = load_spec("qwen2.5-7b-instruct")
    for ckpt, extra in ((False, 28 * (7 * 19 + 3 * 2) + 28 * 3 * 6),
                        (True, 28 * (7 * 19 + 3 * 2) + 28 * 3 * 6 + 28 * (7 * 19 + 3 * 5))):
        plain = micro_batch_ops(Workload(model=qwen, method="lora", precision="bf16", grad_ckpt=ckpt).validate())
        gptq = micro_batch_ops(Workload(model=qwen, method="lora", quant="gptq", precision="bf16",
                                        grad_ckpt=ckpt).validate())
        assert gptq - plain == extra


def test_the_gptqmodel_check_says_what_it_needs_in_one_line():
    """scripts/check_gptq_lora.py runs gptqmodel's own code, which the project does not pin (it asks
    for a newer torch): without it, one line and exit 2."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("gptqmodel") is not None:
        pytest.skip("gptqmodel is installed here: the check runs instead")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "scripts" / "check_gptq_lora.py")], capture_output=True,
                         text=True, cwd=root, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "needs gptqmodel and optimum" in lines[0]


@pytest.mark.parametrize("kw,words", [
    (dict(quant="awq"), "LoRA on AWQ bases"),
    (dict(precision="amp-bf16"), "--precision fp16 or bf16"),
    (dict(precision="fp32"), "--precision fp16 or bf16"),
    (dict(zero=3, gpus=2), "--zero 3"),
    (dict(fsdp="full", gpus=2), "--fsdp"),
    (dict(dora=True), "refuses DoRA"),
    (dict(activation_offload=True), "--activation-offload"),
])
def test_lora_on_int4_refuses_what_it_does_not_model(kw, words):
    with pytest.raises(InputError, match=words):
        _lora(**{"precision": "bf16", **kw})


@pytest.mark.parametrize("model,kw,words", [
    ("llama-3.1-8b", dict(method="full"), "trains through LoRA adapters"),
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
    (("--quant", "awq", "--method", "lora"), "LoRA on AWQ bases"),
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
