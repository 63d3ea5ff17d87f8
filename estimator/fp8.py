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

Transformer Engine (`--fp8-backend te`): accelerate (huggingface/accelerate 16cb6eb8) with
mixed_precision="fp8" and the TE backend (accelerator.py: it picks torchao first when both are
installed) runs `convert_model` (utils/transformer_engine.py) before training: every nn.Linear whose
weight dims are multiples of 16 becomes a te.Linear, the lm_head included, and each gets a *new*
weight the old one is copied into, so a tied lm_head comes out untied (its own weight and gradient;
the optimizer, remapped by the old parameter names, never holds it); the step runs under
fp8_autocast with TERecipeKwargs' DelayedScaling (HYBRID, amax_history_len 1024). Read in
NVIDIA/TransformerEngine d0067d0d (pytorch/module/linear.py `_linear_forward`, `Linear.forward`;
tensor/float8_tensor.py; quantization.py `DelayedScalingRecipeState`; cpp_extensions/gemm.py):
- te.Linear casts its input to fp8 row-wise and column-wise, runs the GEMM, then keeps only the
  column-wise data for the weight gradient (`update_usage(rowwise_usage=False)`): it saves 1 B per
  input element of its own, whether or not another op saves that input (q, k and v: three copies);
- it casts its weight on every forward (`cache_name` is None: HF never passes is_first_microbatch),
  row-wise and column-wise, and saves that copy for the input gradient: on Hopper and Ada, which
  have no non-TN fp8 GEMM (`is_non_tn_fp8_gemm_supported`), the column-wise data is a transposed
  copy, so 2 B per weight element live from the linear's forward to its backward, every layer's at
  the backward's start (Blackwell keeps one buffer for both, 1 B: the estimate is over there);
- forward transient: the input's row-wise data (1 B per element) until the GEMM is done; backward:
  grad_output cast row- and column-wise (2 B per element) beside the bf16 input gradient;
- DelayedScaling's state per te.Linear: an fp32 amax history of 1024 rows x 3 forward quantizers
  (input, weight, output) and x 2 backward ones (grad_output, grad_input), and a scale each;
- one cuBLAS workspace of its own (`get_cublas_workspace`): 32 MiB + 1 KiB from compute capability
  9, 4 MiB below.
Modelled for a full fine-tune of a dense model whose decoder linears all convert (convert_model
stops converting a module's remaining children at the first nn.Linear it cannot), without
checkpointing (torch's checkpoint recomputes te.Linear outside accelerate's fp8_autocast), ZeRO,
FSDP, activation offloading, Liger or torch.compile: the rest is refused in one line.
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
# Transformer Engine (module docstring)
TE_SAVED_INPUT_BYTES = 1      # the column-wise fp8 copy of a te.Linear's input, saved for the weight gradient
TE_WEIGHT_COPY_BYTES = 2      # row-wise + transposed column-wise fp8 weight, saved for the input gradient
TE_GRAD_OUTPUT_BYTES = 2      # grad_output cast row- and column-wise in the backward
TE_AMAX_HISTORY = 1024        # accelerate TERecipeKwargs amax_history_len default
TE_QUANTIZERS = 5             # 3 forward (input, weight, output) + 2 backward (grad_output, grad_input)
TE_CAST_TRAFFIC_BYTES = 4     # a fused cast-transpose: reads 2 B, writes 1 B row-wise and 1 B column-wise
TE_CUBLAS_WORKSPACE_BYTES = (32 * 2**20 + 1024, 4 * 2**20)   # (compute capability >= 9, below)


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


def te_head_converted(spec: ModelSpec) -> bool:
    """Whether accelerate's convert_model makes the lm_head a te.Linear (dims multiples of 16)."""
    return spec.vocab_size % FP8_ALIGN == 0 and spec.hidden_size % FP8_ALIGN == 0


def te_modules(spec: ModelSpec) -> tuple[tuple[int, int, int], ...]:
    """(in, out, count) of every te.Linear of the model: the decoder linears and the lm_head."""
    out = tuple((lin.d_in, lin.d_out, lin.count) for lin in converted_linears(spec))
    if te_head_converted(spec):
        out += ((spec.hidden_size, spec.vocab_size, 1),)
    return out


def te_scaling_state_bytes(spec: ModelSpec) -> int:
    """DelayedScaling's per-module state: fp32 amax history and scale of each quantizer (bytes)."""
    modules = sum(n for _, _, n in te_modules(spec))
    return modules * 4 * TE_QUANTIZERS * (TE_AMAX_HISTORY + 1)


def te_untied_head_elements(spec: ModelSpec) -> int:
    """Elements of the lm_head weight convert_model unties from a tied embedding (0 when untied
    already or not converted): a second bf16 weight, with its own gradient."""
    return spec.vocab_size * spec.hidden_size if spec.tied_embeddings and te_head_converted(spec) else 0


def te_cublas_workspace_bytes(compute_capability_major: int) -> int:
    """Transformer Engine's own cuBLAS workspace (cpp_extensions/gemm.py)."""
    return TE_CUBLAS_WORKSPACE_BYTES[0 if compute_capability_major >= 9 else 1]


def te_workspace_bytes(spec: ModelSpec, tokens: float) -> float:
    """The largest transient of one decoder te.Linear beyond the bf16 stack's (bytes): its input's
    row-wise fp8 data in the forward GEMM, or grad_output's row- and column-wise casts in the
    backward (the lm_head's: `te_head_grad_cast_bytes`, at its own backward)."""
    return max((max(tokens * lin.d_in, TE_GRAD_OUTPUT_BYTES * tokens * lin.d_out) for lin in converted_linears(spec)),
               default=0.0)


def te_head_grad_cast_bytes(spec: ModelSpec, tokens: float) -> float:
    """The lm_head te.Linear's backward: the logits' gradient cast row- and column-wise (bytes)."""
    return TE_GRAD_OUTPUT_BYTES * tokens * spec.vocab_size if te_head_converted(spec) else 0.0


def te_cast_elements(spec: ModelSpec, tokens: float) -> float:
    """Elements cast to fp8 in one micro-batch (each cast fused with its transpose): every
    te.Linear's input and weight in the forward, its grad_output in the backward."""
    return sum((tokens * d_in + d_in * d_out + tokens * d_out) * n for d_in, d_out, n in te_modules(spec))


def _te_refusal(w) -> str:
    spec = w.model
    if spec.is_moe:
        return ("--fp8-backend te on a MoE model is not modelled: convert_model converts nn.Linear only, and "
                "transformers 5's fused experts run bf16 beside the fp8 linears; use --fp8-backend torchao")
    params = count_params(spec)
    if spec.model_type in _CONV1D or len(converted_linears(spec, params)) < len(params.linears):
        return (f"--fp8-backend te: {spec.name} has decoder linears convert_model cannot convert (Conv1D, or dims "
                "not multiples of 16, where it stops converting their module's other linears): not modelled")
    for flag, why in ((w.grad_ckpt, "--grad-ckpt (torch's checkpoint recomputes te.Linear outside accelerate's "
                                    "fp8_autocast; TE's own checkpoint is another stack)"),
                      (w.zero or w.fsdp != "none", "ZeRO or FSDP (TE re-quantizes gathered weights its own way)"),
                      (w.activation_offload, "--activation-offload"), (w.liger, "--liger"),
                      (w.compiled, "--compiled")):
        if flag:
            return f"--fp8-backend te with {why} is not modelled: drop it or use --fp8-backend torchao"
    return ""


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
    if w.te_fp8:
        return _te_refusal(w)
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
    if w.te_fp8:
        lines = [f"fp8 (Transformer Engine through accelerate: te.Linear under fp8_autocast, delayed scaling, amax "
                 f"history {TE_AMAX_HISTORY}): {n} linear shapes of the decoder layers"
                 + (" and the lm_head" if te_head_converted(w.model) else "") + " run fp8 GEMMs; each te.Linear "
                 "saves a 1-byte copy of its input and a 2-byte fp8 copy of its weight (row-wise + transposed, "
                 "Hopper/Ada) to its backward; weights, gradients and optimizer states are the bf16 stack's"]
        if te_untied_head_elements(w.model):
            lines.append("fp8 with Transformer Engine unties the lm_head (convert_model copies it into a new te.Linear): "
                         "a second bf16 weight and its gradient, outside the optimizer")
        return tuple(lines)
    mode = "torch.compile fusing the casts" if w.compiled else "eager casts; --compiled for torch.compile"
    lines = [f"fp8 (torchao float8 training, tensorwise dynamic scaling, {mode}): {n} linear shapes of the decoder "
             "layers run fp8 GEMMs; lm_head, attention, norms and experts stay bf16; weights, gradients and "
             "optimizer states are the bf16 stack's and Float8Linear saves its bf16 input for backward"]
    if w.fsdp != "none":
        lines.append("fp8 with FSDP2: converted weights all-gathered in fp8 (accelerate's default "
                     "enable_fsdp_float8_all_gather): half the gathered copies and traffic, no weight cast per matmul")
    return tuple(lines)
