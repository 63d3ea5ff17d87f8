"""fp8 training (`--precision fp8`): torchao float8 training as the libraries run it (docs/design.md
section "fp8 training").

Read in pytorch/ao 36027d82 (torchao/float8/float8_linear.py, config.py, float8_linear_utils.py,
float8_training_tensor.py, float8_utils.py) and huggingface/accelerate 16cb6eb8
(src/accelerate/utils/ao.py, utils/dataclasses.py `AORecipeKwargs`):

- `convert_to_float8_training` swaps `torch.nn.Linear` modules for `Float8Linear`; the weight stays
  the same high-precision Parameter (`new_mod.weight = mod.weight`), so parameters, gradients,
  master weights and optimizer states are those of the bf16 stack. Filters: dims divisible by 16
  (`_scaled_mm`; accelerate `filter_linear_layers`, torchao `_auto_filter_for_*`), the output
  projection left out (torchtitan `filter_fqns=["output"]`, accelerate's default filter skips the
  first and last nn.Linear: the lm_head). Modelled: every decoder-layer nn.Linear whose in and out
  features are multiples of 16; the lm_head, MoE experts (3-D grouped_mm parameters, not nn.Linear)
  and routers stay bf16. (accelerate also keeps the first layer's first projection in bf16: one
  linear, not modelled.)
- `matmul_with_hp_or_float8_args.forward` saves `input_hp, weight_hp_t` for backward: the
  *high-precision* input and weight (eager). Saved activations are the bf16 stack's; no fp8 tensor
  outlives its matmul. (Under torch.compile the partitioner may save the fp8 cast instead: training
  under compile is not modelled.)
- Each operand is cast by `hp_tensor_to_float8_dynamic`: amax = max(abs(x)) (tensorwise dynamic
  scaling: a scalar per tensor, no amax history, no buffers), then `_ToFloat8ConstrFunc.forward`:
  `x.to(float32) * scale`, `to_fp8_saturated` (clamp in fp32, `.to(float8)`). Eager, a cast of n
  elements holds the fp32 scaled tensor, the fp32 clamped tensor and the 1-byte result at once:
  9 B per element (`CAST_PEAK_BYTES`), and moves 33 B per element of a bf16 input
  (`CAST_TRAFFIC_BYTES`: abs 2+2, max 2, to fp32 2+4, x scale 4+4, clamp 4+4, to fp8 4+1).
- Forward: input (M x K) and weight (K x N) cast, `torch.mm`. Backward: grad_output cast (dim0),
  weight cast again (grad_input), grad_output cast again (dim1), input cast (grad_weight), each a
  local kept until `backward` returns. The extra working set of one linear beyond the bf16
  matmul is the largest of these moments (`linear_workspace_bytes`).
- Default recipe: tensorwise (`Float8LinearConfig()`), e4m3 input and weight, e5m2 grad_output.
  The rowwise recipes cast the same tensors (axiswise scales); rowwise_with_gw_hp keeps the
  grad_weight GEMM in high precision: not modelled separately.
- FSDP2: accelerate's AORecipeKwargs turns on `enable_fsdp_float8_all_gather` (fsdp_utils.py
  `WeightWithDynamicFloat8CastTensor`: `fsdp_pre_all_gather` casts the local shard to fp8, the
  all-gather moves fp8 and the unsharded weight is a Float8TrainingTensor, so
  `matmul_with_hp_or_float8_args` casts no weight). Modelled under `--fsdp`: the converted linears'
  gathered copies and all-gather traffic at 1 B per element, no weight cast in the workspace, one
  shard cast per gather.
- Transformer Engine (delayed scaling with an amax history per tensor, te.Linear) is not modelled.
"""

from __future__ import annotations

from estimator.model import ModelSpec
from estimator.params import Linear, ParamCounts, count_params

CAST_PEAK_BYTES = 9       # fp32 scaled + fp32 clamped + fp8 result, per element, during one eager cast
CAST_TRAFFIC_BYTES = 33   # bytes moved per element by one eager cast of a bf16 tensor (module docstring)
# torch.compile (`--compiled`; torchao's recipes are "built natively on top of torch.compile", docs/source/
# eager_tutorials/pretraining.rst line 127): Inductor fuses scale, clamp and cast into one kernel that
# writes only the fp8 result (1 B per element) after the amax reduction: 2 B read for amax, 2 B read
# and 1 B written by the cast
CAST_PEAK_BYTES_COMPILED = 1
CAST_TRAFFIC_BYTES_COMPILED = 5
FP8_ALIGN = 16            # torch._scaled_mm: both dims multiples of 16 (torchao/accelerate filters)
_CONV1D = ("gpt2",)       # transformers' Conv1D, not nn.Linear: convert_to_float8_training skips it


def converted(lin: Linear) -> bool:
    """Whether torchao's filter converts this decoder linear to Float8Linear."""
    return not lin.expert and lin.d_in % FP8_ALIGN == 0 and lin.d_out % FP8_ALIGN == 0


def converted_linears(spec: ModelSpec, params: ParamCounts | None = None) -> tuple[Linear, ...]:
    """The decoder-layer linears that run fp8 GEMMs (none for Conv1D models)."""
    if spec.model_type in _CONV1D:
        return ()
    params = params or count_params(spec)
    return tuple(lin for lin in params.linears if converted(lin))


def converted_weights(spec: ModelSpec, params: ParamCounts | None = None) -> int:
    """Weight elements of the converted linears in the whole model."""
    return sum(lin.weight_params for lin in converted_linears(spec, params))


def cast_bytes(compiled: bool) -> tuple[int, int]:
    """(bytes per element alive during one cast, bytes moved per element cast), eager or compiled."""
    if compiled:
        return CAST_PEAK_BYTES_COMPILED, CAST_TRAFFIC_BYTES_COMPILED
    return CAST_PEAK_BYTES, CAST_TRAFFIC_BYTES


def linear_workspace_bytes(m: float, k: int, n: int, c: int = CAST_PEAK_BYTES, weight_cast: bool = True) -> float:
    """Bytes beyond the bf16 matmul alive at the worst moment of one Float8Linear (M tokens, K in,
    N out), forward or backward (float8_linear.py `matmul_with_hp_or_float8_args`):
    forward: casting the input (9MK), then the weight beside the fp8 input (MK + 9KN);
    backward: grad_output dim0 (9MN); the weight beside it (MN + 9KN); grad_output dim1 beside both
    (MN + KN + 9MN); the input beside all three (2MN + KN + 9MK). `c`: bytes per element alive
    during a cast (9 eager; 1 compiled, the same lifetimes kept: an upper bound). `weight_cast`
    False: the weight arrives in fp8 (FSDP2's float8 all-gather; the gathered copy is FSDP's
    buffer), so neither matmul casts it: forward 9MK; backward 9MN, 10MN, 2MN + 9MK."""
    if not weight_cast:
        return max(c * m * k, m * n + c * m * n, 2 * m * n + c * m * k)
    forward = max(c * m * k, m * k + c * k * n)
    backward = max(c * m * n, m * n + c * k * n, m * n + k * n + c * m * n, 2 * m * n + k * n + c * m * k)
    return max(forward, backward)


def workspace_bytes(spec: ModelSpec, tokens: float, compiled: bool = False, weight_cast: bool = True) -> float:
    """The largest `linear_workspace_bytes` over the converted linears for `tokens` rows."""
    c = cast_bytes(compiled)[0]
    return max((linear_workspace_bytes(tokens, lin.d_in, lin.d_out, c, weight_cast)
                for lin in converted_linears(spec)), default=0.0)


def cast_elements(spec: ModelSpec, tokens: float, recompute: bool, weight_casts: float | None = None) -> float:
    """Elements cast to fp8 in one micro-batch over all converted linears: forward input and weight,
    backward grad_output twice, weight and input once each; a recomputed forward casts again.
    `weight_casts`: how many whole weights are cast per micro-batch when not 2 (+1 recomputed):
    FSDP2's float8 all-gather casts each rank's shard once per gather (gathers / shard group)."""
    if weight_casts is None:
        weight_casts = 3.0 if recompute else 2.0
    total = 0.0
    for lin in converted_linears(spec):
        mk, kn, mn = tokens * lin.d_in, lin.d_in * lin.d_out, tokens * lin.d_out
        per = mk * (3.0 if recompute else 2.0) + 2 * mn + kn * weight_casts
        total += per * lin.count
    return total


def refusal(w) -> str:
    """One line saying why `w` cannot be an fp8 training estimate, or "" when it can."""
    if w.method == "inference":
        return ("--precision fp8 is torchao float8 training (convert_to_float8_training); fp8 inference "
                "(torchao quantize_ with float8 configs) is not modelled: use --precision bf16")
    if w.method != "full":
        return (f"--precision fp8 with --method {w.method} is not modelled: torchao float8 training converts "
                "full-precision nn.Linear for full fine-tuning (torchtitan, accelerate's AO recipe); no torchao, "
                "accelerate or TRL recipe trains peft adapters or a bitsandbytes base in fp8: use --method full "
                "or --precision bf16")
    if w.tp > 1:
        return ("--precision fp8 with --tp is not modelled (torchao float8 tensor parallel needs torchtitan's "
                "Float8 parallel plans): use --tp 1")
    if not converted_linears(w.model):
        return (f"--precision fp8: {w.model.name} has no nn.Linear with dims divisible by 16 for torchao to "
                "convert (GPT-2's Conv1D is not nn.Linear): use --precision bf16")
    return ""


def gpu_refusal(gpu) -> str:
    """One line when the GPU has no fp8 tensor cores (gpus.csv fp8_dense_tflops empty), else ""."""
    if gpu.fp8_dense_tflops is None:
        return (f"--precision fp8 needs fp8 tensor cores (Ada, Hopper or newer): {gpu.name} ({gpu.slug}) has "
                "none; use --precision bf16")
    return ""


def notes(w) -> tuple[str, ...]:
    """The regime lines fp8 adds."""
    n = len(converted_linears(w.model))
    mode = "torch.compile fusing the casts" if w.compiled else "eager casts; --compiled for torch.compile"
    lines = [f"fp8 (torchao float8 training, tensorwise dynamic scaling, {mode}): {n} linear shapes of the decoder "
             "layers run fp8 GEMMs; lm_head, attention, norms and experts stay bf16; weights, gradients and "
             "optimizer states are the bf16 stack's and Float8Linear saves its bf16 input for backward"]
    if w.fsdp != "none":
        lines.append("fp8 with FSDP2: converted weights all-gathered in fp8 (accelerate's default "
                     "enable_fsdp_float8_all_gather): half the gathered copies and traffic, no weight cast per matmul")
    return tuple(lines)
