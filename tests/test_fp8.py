"""`--precision fp8` (torchao float8 training, estimator/fp8.py) against hand counts.

Every expected value below is worked by hand from Llama-3.1-8B's config (hidden H = 4096,
intermediate I = 14336, 32 heads of 128, 8 kv heads: k/v width 1024, vocab V = 128256, 32 layers),
the datasheet peaks of estimator/data/gpus.csv (H100 SXM: bf16 989.4, fp8 1978.9 TFLOPS dense;
3.35 TB/s) and torchao's code as docs/design.md "fp8 training" reads it:
- Float8Linear saves its bf16 input and weight (`ctx.save_for_backward(input_hp, weight_hp_t)`):
  no activation is saved in fp8, so the saved activations equal bf16's;
- an eager cast of n elements holds 9 n bytes (fp32 scaled, fp32 clamped, fp8 result) and moves
  33 n bytes; compiled: 1 n held, 5 n moved;
- the converted linears: q (H x H), k, v (H x 1024), o (H x H), gate, up (H x I), down (I x H).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from estimator.api import estimate
from estimator.compute_time import compute_parts
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.memory import components, working_sets
from estimator import tables
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
H, I, KV, V, L = 4096, 14336, 1024, 128256, 32
LLAMA = load_spec("llama-3.1-8b")
H100_BF16, H100_FP8, H100_BW = 989.4e12, 1978.9e12, 3.35e12
ELEMENTWISE_FRACTION = 0.7     # estimator/data/time_constants.csv elementwise_bandwidth_fraction


def _w(precision: str, **kw) -> Workload:
    return Workload(model=LLAMA, precision=precision, **kw).validate()


# ---------------------------------------------------------------- what is converted


def test_every_decoder_linear_is_converted_and_the_lm_head_is_not():
    from estimator import fp8

    per_layer = 2 * H * H + 2 * H * KV + 3 * H * I          # q, o; k, v; gate, up, down
    assert per_layer == 218_103_808
    assert fp8.converted_weights(LLAMA) == L * per_layer == 6_979_321_856


# ---------------------------------------------------------------- memory


def test_states_and_saved_activations_are_the_bf16_stacks():
    """Float8Linear keeps the bf16 Parameter and saves bf16 input and weight: weights, gradients,
    optimizer states, master weights and saved activations are byte for byte bf16's (hand count of
    activations saved in fp8: 0)."""
    a, b = estimate(_w("bf16"), "h100-80gb", "none").memory, estimate(_w("fp8"), "h100-80gb", "none").memory
    for field in ("weights_bytes", "gradients_bytes", "optimizer_states_bytes", "master_weights_bytes",
                  "activations_bytes", "autocast_weight_cache_bytes"):
        assert getattr(a, field) == getattr(b, field), field


def test_eager_cast_workspace_is_the_largest_linears_weight_cast():
    """T = 512 tokens. The worst moment: the gate/up weight (H x I) cast in the backward beside the
    fp8 grad_output (T x I): T I + 9 H I = 7,340,032 + 528,482,304 (the down projection's forward
    weight cast, T I + 9 I H, ties it)."""
    from estimator.memory import fp8_workspace

    expected = 512 * I + 9 * H * I
    assert expected == 535_822_336
    assert fp8_workspace(_w("fp8", seq=512)) == expected
    assert estimate(_w("fp8", seq=512), "h100-80gb", "none").memory.quant_workspace_bytes == expected


def test_compiled_cast_workspace_keeps_only_fp8_results():
    """Compiled (1 B per element): gate/up backward, input cast beside both grad_output casts and the
    weight: 2 T I + H I + T H = 14,680,064 + 58,720,256 + 2,097,152."""
    from estimator.memory import fp8_workspace

    assert fp8_workspace(_w("fp8", seq=512, compiled=True)) == 2 * 512 * I + H * I + 512 * H == 75_497_472


def test_forward_backward_working_set_grows_by_the_hand_counted_casts():
    """One GPU, T = 512: bf16's forward/backward peak is the lm_head backward (saved activations +
    the bf16 logits gradient 2 V T + the lm_head weight gradient 2 V H); fp8's is a converted linear's
    backward in the top layer: saved activations less the final norm and lm_head input (8 H + 4 bytes
    per token: fp32 input 4H + rsqrt 4 + bf16 normed 2H, bf16 lm_head input 2H), the lm_head weight
    gradient and the casts. Difference: 535,822,336 - 32,772 x 512 - 2 x 128,256 x 512."""
    bf16, fp8 = (working_sets(components(_w(p, seq=512)))[1] for p in ("bf16", "fp8"))
    expected = (512 * I + 9 * H * I) - (8 * H + 4) * 512 - 2 * V * 512
    assert expected == 387_708_928
    assert fp8 - bf16 == expected


def test_peak_grows_by_the_hand_counted_casts_when_the_forward_backward_sets_it():
    """ZeRO-3 over 64 GPUs, T = 128: the partitioned states leave the forward/backward as the peak.
    bf16's working set peaks at the lm_head backward (2 V T logits gradient + 2 V H weight gradient);
    fp8's at the casts (gate/up weight cast beside the fp8 grad_output: T I + 9 H I) less the final
    norm and lm_head input, with the same lm_head gradient."""
    a = estimate(_w("bf16", seq=128, zero=3, gpus=8, nodes=8), "h100-80gb", "none").memory
    b = estimate(_w("fp8", seq=128, zero=3, gpus=8, nodes=8), "h100-80gb", "none").memory
    assert a.peak_phase == b.peak_phase == "forward/backward"
    expected = (128 * I + 9 * H * I) - (8 * H + 4) * 128 - 2 * V * 128
    assert expected == 493_288_960
    assert b.peak_allocated_bytes - a.peak_allocated_bytes == expected


def test_fsdp_gathers_converted_weights_in_fp8():
    """FSDP2 full shard over 64 GPUs, T = 128 (accelerate turns on torchao's float8 all-gather):
    the current and the prefetched layer's gathered linears hold 1 B per element instead of 2:
    2 x 218,103,808 B less; no weight is cast per matmul, so the casts (gate/up backward, grad_output
    cast beside its first cast: 10 T I = 18,350,080) stay under the loss backward (12 V T) and the
    peak falls by exactly the buffers' difference. The all-gather moves the converted weights
    (6,979,321,856 elements) at 1 B."""
    from estimator.memory import fp8_workspace
    from estimator.timing import _gathered_bytes

    kw = dict(seq=128, fsdp="full", gpus=8, nodes=8)
    a = estimate(_w("bf16", **kw), "h100-80gb", "none").memory
    b = estimate(_w("fp8", **kw), "h100-80gb", "none").memory
    assert a.peak_phase == b.peak_phase == "forward/backward"
    assert a.zero_buffers_bytes - b.zero_buffers_bytes == 2 * 218_103_808
    assert a.peak_allocated_bytes - b.peak_allocated_bytes == 2 * 218_103_808
    assert fp8_workspace(_w("fp8", **kw)) == 10 * 128 * I == 18_350_080
    assert _gathered_bytes(_w("bf16", **kw)) - _gathered_bytes(_w("fp8", **kw)) == 6_979_321_856


# ---------------------------------------------------------------- time


def test_converted_gemms_run_at_the_fp8_peak():
    """GEMM sizes off (pure FLOPs over peak): 3 passes x 2 x tokens x params; the lm_head (V x H)
    at the bf16 peak, every decoder linear (all converted) at the fp8 peak."""
    gpu, hfu, T = tables.gpu("h100-80gb"), 0.4, 512
    off = frozenset({"gemm_size"})
    head, layers = V * H, L * (2 * H * H + 2 * H * KV + 3 * H * I)
    got = compute_parts(_w("fp8", seq=T), gpu, hfu, off).gemm_s
    expected = 6 * T * (head / (H100_BF16 * hfu) + layers / (H100_FP8 * hfu))
    assert got == pytest.approx(expected, rel=1e-12)
    bf16 = compute_parts(_w("bf16", seq=T), gpu, hfu, off).gemm_s
    assert bf16 == pytest.approx(6 * T * (head + layers) / (H100_BF16 * hfu), rel=1e-12)


@pytest.mark.parametrize("compiled,per_element", [(False, 33), (True, 5)])
def test_cast_traffic_is_elementwise_time(compiled, per_element):
    """Per converted linear and micro-batch: forward input and weight, backward grad_output twice,
    weight and input: 2 T K + 2 T N + 2 K N elements; per layer sum K = 6 H + I, sum N = 3 H + 2 KV + 2 I,
    sum K N = 218,103,808. T = 512: 16,642,998,272 elements in 32 layers."""
    gpu, T = tables.gpu("h100-80gb"), 512
    elements = L * (2 * T * ((6 * H + I) + (3 * H + 2 * KV + 2 * I)) + 2 * 218_103_808)
    assert elements == 16_642_998_272
    extra = (compute_parts(_w("fp8", seq=T, compiled=compiled), gpu, 0.4).elementwise_s
             - compute_parts(_w("bf16", seq=T), gpu, 0.4).elementwise_s)
    assert extra == pytest.approx(per_element * elements / (H100_BW * ELEMENTWISE_FRACTION), rel=1e-9)


def test_attention_and_step_pieces_other_than_gemm_and_casts_are_bf16s():
    gpu = tables.gpu("h100-80gb")
    a, b = compute_parts(_w("bf16"), gpu, 0.4), compute_parts(_w("fp8"), gpu, 0.4)
    assert a.attention_s == b.attention_s
    ta = estimate(_w("bf16"), "h100-80gb", "none").time
    tb = estimate(_w("fp8"), "h100-80gb", "none").time
    assert ta.optimizer_s == tb.optimizer_s and ta.peak_tflops == tb.peak_tflops == 989.4


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw,words", [
    (dict(method="lora"), "--method lora"),
    (dict(method="qlora"), "--method qlora"),
    (dict(method="inference"), "fp8 inference"),
    (dict(tp=2, gpus=2), "--tp"),
])
def test_unsupported_combinations_are_refused(kw, words):
    from estimator.workload import method_defaults

    with pytest.raises(InputError, match=words.replace("-", r"\-")):
        Workload(model=LLAMA, precision="fp8", **method_defaults(kw)).validate()


@pytest.mark.parametrize("slug", ["a100-80gb", "v100-16gb", "a10g-24gb", "rtx3090-24gb", "t4-16gb"])
def test_gpus_without_fp8_tensor_cores_are_refused(slug):
    with pytest.raises(InputError, match=f"fp8 tensor cores.*{slug}"):
        estimate(_w("fp8"), slug, "none")


@pytest.mark.parametrize("slug,tflops", [("h100-80gb", 1978.9), ("h100-80gb-pcie", 1513), ("h200-141gb", 1978.9),
                                         ("l4-24gb", 242.5), ("l40s-48gb", 733), ("rtx4090-24gb", 330.3)])
def test_fp8_peaks_are_the_datasheet_dense_figures(slug, tflops):
    gpu = tables.gpu(slug)
    assert gpu.fp8_dense_tflops == tflops
    assert "fp8 figure read 2026-11-24" in gpu.source


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "estimate.py"), "--model", "llama-3.1-8b",
                           "--precision", "fp8", "--calibration", "none", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args,words", [
    (("--gpu", "a100-80gb"), "a100-80gb"),
    (("--method", "lora"), "--method lora"),
    (("--method", "qlora"), "--method qlora"),
    (("--method", "inference"), "fp8 inference"),
    (("--tp", "2", "--gpus", "2"), "--tp"),
    (("--fp8-backend", "te", "--grad-ckpt"), "--grad-ckpt"),
    (("--fp8-backend", "te", "--zero", "3", "--gpus", "2"), "ZeRO or FSDP"),
    (("--fp8-backend", "tensorrt"), "invalid choice: 'tensorrt'"),
])
def test_command_line_refuses_in_one_line(args, words):
    run = _cli(*args)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in run.stderr


def test_command_line_estimates_fp8_on_h100():
    run = _cli("--json")
    assert run.returncode == 0, run.stderr
    assert '"precision": "fp8"' in run.stdout


def test_compiled_training_needs_fp8():
    with pytest.raises(InputError, match="--compiled"):
        _w("bf16", compiled=True)


# ---------------------------------------------------------------- profiler


def test_profiler_skips_fp8_without_torchao(monkeypatch):
    """The profiler builds fp8 with torchao's convert_to_float8_training; without torchao the row is
    `skipped` naming it (never an error)."""
    pytest.importorskip("torch")
    import importlib.util

    from profiler import build
    from profiler.child import classify

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(build.MissingPackage) as info:
        build.check_packages(_w("fp8"))
    status, message = classify(info.value)
    assert status == "skipped" and message.startswith("torchao is not installed (needed for precision fp8")


def test_the_tracer_traces_fp8_as_torchao_runs_it():
    """torchao's own Float8Linear (convert_to_float8_training) traced on fake CPU tensors: the raw
    estimate of the peak and of the saved activations within 0.5 % (fp8 casts, scales, fp8 saves)."""
    from estimator.memory import estimate_memory, saved_activation_bytes
    from profiler.case import Case
    from profiler.trace.step import trace

    for settings in ({"batch": 1, "seq": 256}, {"batch": 2, "seq": 256, "grad_ckpt": True}):
        case = Case("llama-3.2-1b", {"method": "full", "precision": "fp8", **settings})
        w = case.workload()
        traced = trace(case)
        assert abs(estimate_memory(w, 0.0, 0).peak_allocated_bytes / traced.peak_allocated_bytes - 1) < 0.005
        assert abs(saved_activation_bytes(w) / traced.saved_activations_bytes - 1) < 0.005


# ---------------------------------------------------------------- Transformer Engine (--fp8-backend te)
# Hand counts from Transformer Engine's te.Linear as estimator/fp8.py's docstring reads it: each
# te.Linear saves a 1-byte column-wise copy of its input (q, k and v one each) and a 2-byte fp8 copy
# of its weight (row-wise + transposed on Hopper) until its backward; accelerate's convert_model
# converts the lm_head too (V and H multiples of 16) and unties a tied one; 5 quantizers per module
# with an fp32 amax history of 1024 rows and a scale each; its own 32 MiB + 1 KiB cuBLAS workspace.

PER_LAYER = 2 * H * H + 2 * H * KV + 3 * H * I


def _te(**kw) -> Workload:
    return _w("fp8", fp8_backend="te", **kw)


def test_te_saves_one_byte_inputs_per_linear_and_two_byte_weight_copies():
    """T = 512. bf16 under SDPA saves the normed input once for q, k, v (2 H), nothing more for o_proj
    (its input is SDPA's saved output), the normed input once for gate/up (2 H) and the product for
    down (2 I); TE: q, k, v 1 H each, o 1 H, gate and up 1 H each, down 1 I; the lm_head's input 2 H
    -> 1 H. Per token: L (2 H - I) + (-H). Plus every fp8 weight copy when the backward starts:
    2 (L x PER_LAYER + V H)."""
    from estimator.memory import saved_activation_bytes

    T = 512
    copies = 2 * (L * PER_LAYER + V * H)
    assert copies == 15_009_316_864
    expected = copies + (L * (2 * H - I) - H) * T
    assert saved_activation_bytes(_te(seq=T)) - saved_activation_bytes(_w("bf16", seq=T)) == expected
    assert expected == 14_906_556_416
    assert components(_te(seq=T)).autocast_weight_cache == copies   # the peak: the forward's loss


def test_te_scaling_state_workspace_and_untied_lm_head():
    """Llama-3.1-8B (untied): 32 x 7 + 1 = 225 te.Linear modules x 4 B x 5 x 1025 = 4,612,500 B of
    scaling state; its cuBLAS workspace 33,555,456 B on the H100. Llama-3.2-1B (tied, V x H =
    128,256 x 2,048): the untied lm_head adds a bf16 weight and gradient (525,336,576 B each) and
    no optimizer state; 16 x 7 + 1 modules of state."""
    bf16, te = (estimate(w, "h100-80gb", "none").memory for w in (_w("bf16"), _te()))
    assert te.weights_bytes - bf16.weights_bytes == 225 * 4 * 5 * 1025 == 4_612_500
    assert te.blas_workspace_bytes - bf16.blas_workspace_bytes == 32 * 2**20 + 1024
    small = load_spec("llama-3.2-1b")
    a = estimate(Workload(model=small).validate(), "h100-80gb", "none").memory
    b = estimate(Workload(model=small, precision="fp8", fp8_backend="te").validate(), "h100-80gb", "none").memory
    assert b.weights_bytes - a.weights_bytes == 2 * 128_256 * 2048 + 113 * 4 * 5 * 1025
    assert b.gradients_bytes - a.gradients_bytes == 2 * 128_256 * 2048 == 525_336_576
    assert b.optimizer_states_bytes == a.optimizer_states_bytes
    tied = estimate(Workload(model=small, precision="fp8", fp8_backend="te").validate(), "h100-80gb", "none")
    assert any("unties the lm_head" in n for n in tied.regime_notes)


def test_te_transients_are_the_hand_counted_casts():
    """T = 512: a decoder te.Linear's worst transient is gate/up's grad_output cast row- and
    column-wise, 2 T I; the lm_head's, at its own backward, 2 T V."""
    from estimator import fp8

    assert fp8.te_workspace_bytes(LLAMA, 512) == 2 * 512 * I == 14_680_064
    assert fp8.te_head_grad_cast_bytes(LLAMA, 512) == 2 * 512 * V == 131_334_144


def test_te_casts_are_fused_cast_transposes_and_the_lm_head_runs_fp8():
    """Per te.Linear and micro-batch: input T K, weight K N, grad_output T N, 4 B moved per element
    (read 2, write 1 row-wise + 1 column-wise); the lm_head (H x V) among them. GEMMs: every te.Linear
    at the fp8 peak."""
    gpu, T = tables.gpu("h100-80gb"), 512
    modules = [(H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)]
    elements = L * sum(T * k + k * n + T * n for k, n in modules) + (T * H + H * V + T * V)
    extra = (compute_parts(_te(seq=T), gpu, 0.4).elementwise_s - compute_parts(_w("bf16", seq=T), gpu, 0.4).elementwise_s)
    assert extra == pytest.approx(4 * elements / (H100_BW * ELEMENTWISE_FRACTION), rel=1e-9)
    off = frozenset({"gemm_size"})
    got = compute_parts(_te(seq=T), gpu, 0.4, off).gemm_s
    assert got == pytest.approx(6 * T * (V * H + L * PER_LAYER) / (H100_FP8 * 0.4), rel=1e-12)


@pytest.mark.parametrize("kw,words", [
    (dict(grad_ckpt=True), "--grad-ckpt"),
    (dict(zero=3, gpus=2), "ZeRO or FSDP"),
    (dict(fsdp="full", gpus=2), "ZeRO or FSDP"),
    (dict(activation_offload=True), "--activation-offload"),
    (dict(liger=True), "--liger"),
    (dict(compiled=True), "--compiled"),
    (dict(method="lora"), "--method lora"),
])
def test_te_refuses_what_it_does_not_model(kw, words):
    from estimator.workload import method_defaults

    with pytest.raises(InputError, match=words.replace("-", r"\-")):
        Workload(model=LLAMA, precision="fp8", fp8_backend="te", **method_defaults(kw)).validate()


@pytest.mark.parametrize("model,words", [("qwen1.5-moe-a2.7b", "MoE"), ("gpt2", "Conv1D")])
def test_te_refuses_models_it_does_not_model(model, words):
    with pytest.raises(InputError, match=words):
        Workload(model=load_spec(model), precision="fp8", fp8_backend="te").validate()


def test_te_backend_needs_fp8_and_the_profiler_skips_it():
    from profiler import build

    with pytest.raises(InputError, match="applies to --precision fp8"):
        Workload(model=LLAMA, fp8_backend="te").validate()
    with pytest.raises(build.MissingPackage, match="Transformer Engine"):
        build.check_packages(_te())
