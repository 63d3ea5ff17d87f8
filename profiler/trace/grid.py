"""The estimator-versus-trace grid: the tracer is the oracle of the analytic estimator.

`grid()` lists the configurations (6 families, one MoE; full, LoRA, QLoRA and inference;
gradient checkpointing on and off; eager and SDPA; three batch x sequence sizes; bf16 and AMP),
`compare(case)` traces one and sets the estimator's numbers beside it, `summary(rows)` gives the
median and worst |error|. `scripts/bench_tracer.py` prints the whole grid;
`tests/test_estimator_vs_trace.py` checks `TEST_SUBSET`.

Compared quantities (same names on both sides, bytes):
- peak_allocated_bytes: the estimator's raw prediction (no calibration, reserve 0) against the
  traced peak (what `torch.cuda.max_memory_allocated()` would report for the step);
- saved activations (training): what autograd holds when the backward starts, against
  `estimator.memory.saved_activation_bytes`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from estimator.lora_targets import LINEAR_ROUTER, is_all_linear
from estimator.memory import estimate_memory, saved_activation_bytes
from profiler.case import Case
from profiler.trace.layers import first_layers
from profiler.trace.step import trace

SIZES = ((1, 512), (2, 1024), (4, 2048))            # (micro-batch, sequence)
PRECISIONS = ("bf16", "amp-bf16")
NEW_TOKENS = 16

# model, methods traced, attention kernels it supports, precisions it trains in
_FAMILIES = (
    ("meta-llama/Llama-3.2-1B", ("full", "lora"), ("sdpa", "eager"), PRECISIONS),
    ("Qwen/Qwen2.5-0.5B-Instruct", ("full", "lora"), ("sdpa", "eager"), PRECISIONS),
    ("microsoft/phi-2", ("full", "lora"), ("sdpa", "eager"), PRECISIONS),
    ("google/gemma-2-2b", ("full", "lora"), ("eager",), PRECISIONS),        # no SDPA in transformers 5
    ("openai-community/gpt2-medium", ("full",), ("sdpa", "eager"), PRECISIONS),  # fused qkv: no LoRA roles
    ("Qwen/Qwen1.5-MoE-A2.7B", ("full", "lora"), ("sdpa", "eager"), ("bf16",)),  # grouped_mm needs bf16
)
_QLORA = ("meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B-Instruct", "microsoft/phi-2", "google/gemma-2-2b")


def _training() -> list[Case]:
    cases, k = [], 0
    for model, methods, attns, precisions in _FAMILIES:
        for method in methods:
            for ckpt in (False, True):
                for attn in attns:
                    batch, seq = SIZES[k % len(SIZES)]
                    precision = precisions[(k // len(SIZES)) % len(precisions)]
                    cases.append(Case(model, dict(method=method, precision=precision, batch=batch, seq=seq,
                                                  grad_ckpt=ckpt, attn=attn), warmup=1, steps=1))
                    k += 1
    return cases


def _inference() -> list[Case]:
    cases, k = [], 0
    for model, _, attns, precisions in _FAMILIES:
        for attn in attns:
            for batch, seq in SIZES:
                precision = precisions[k % len(precisions)]
                cases.append(Case(model, dict(method="inference", precision=precision, batch=batch, seq=seq,
                                              new_tokens=NEW_TOKENS, attn=attn), warmup=0, steps=1))
                k += 1
    return cases


def _qlora() -> list[Case]:
    cases = []
    for i, model in enumerate(_QLORA):
        batch, seq = SIZES[i % len(SIZES)]
        attn = "eager" if "gemma-2" in model else "sdpa"
        cases.append(Case(model, dict(method="qlora", quant="nf4", precision=PRECISIONS[i % 2], batch=batch,
                                      seq=seq, grad_ckpt=bool(i % 2), attn=attn), warmup=1, steps=1))
    return cases


def _stacks() -> list[Case]:
    """Single-process regimes of the training stacks (issue 13): QLoRA without peft's kbit
    preparation (TRL's path), LoRA targets given as the model's own module names, all-linear,
    a regular expression and lm_head (peft's matching), a training loop's own loss, and TRL's
    activation offloading."""
    cases = []
    for i, model in enumerate(_QLORA):
        batch, seq = SIZES[(i + 1) % len(SIZES)]
        attn = "eager" if "gemma-2" in model else "sdpa"
        cases.append(Case(model, dict(method="qlora", quant="nf4", kbit_prep="off", batch=batch, seq=seq,
                                      grad_ckpt=not i % 2, attn=attn), warmup=1, steps=1))
    for model, settings in (
            ("openai-community/gpt2-medium", dict(lora_targets="c_attn", batch=2, seq=1024)),
            ("openai-community/gpt2-medium", dict(lora_targets="all-linear", grad_ckpt=True)),
            ("microsoft/phi-2", dict(lora_targets="all-linear")),
            ("meta-llama/Llama-3.2-1B", dict(lora_targets=r".*\.(q|v)_proj", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(lora_targets="q_proj,v_proj,lm_head", batch=4, seq=2048)),
            # Phi-3's fused qkv_proj: the values, a view of its output, keep the whole output saved
            ("microsoft/Phi-3-mini-4k-instruct", dict(lora_targets="qkv_proj,o_proj", batch=2, seq=1024))):
        cases.append(Case(model, dict(method="lora", **settings), warmup=1, steps=1))
    # a training loop's own cross_entropy on the model's logits (--loss model-dtype)
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=2, seq=1024, grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", batch=2, seq=1024, grad_ckpt=True)),
            ("google/gemma-2-2b", dict(method="lora", batch=1, seq=512, attn="eager")),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", precision="amp-bf16", batch=2, seq=1024))):
        cases.append(Case(model, dict(loss="model-dtype", **settings), warmup=1, steps=1))
    # torchtune's chunked cross-entropy (--loss chunked): the output projection and the loss per chunk
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=1, seq=2048)),
            ("meta-llama/Llama-3.2-1B", dict(method="lora", precision="amp-bf16", batch=2, seq=1024)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="qlora", quant="nf4", batch=2, seq=1024, grad_ckpt=True)),
            ("openai-community/gpt2-medium", dict(method="full", batch=2, seq=1024))):
        cases.append(Case(model, dict(loss="chunked", **settings), warmup=1, steps=1))
    # transformers before 4.46 in a loop that keeps the output (--loss hf-legacy, fsdp_qlora's train.py)
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=2, seq=1024, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="qlora", quant="nf4", kbit_prep="off", batch=2, seq=1024))):
        cases.append(Case(model, dict(loss="hf-legacy", **settings), warmup=1, steps=1))
    # peft's lora_dropout > 0 (--lora-dropout): each adapter's dropped-out copy of its input and mask
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", lora_targets="all-linear", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="lora", lora_targets="all-linear", trainable_dtype="model",
                                             batch=2, seq=1024)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="qlora", quant="nf4", batch=2, seq=1024, grad_ckpt=True))):
        cases.append(Case(model, dict(lora_dropout=True, **settings), warmup=1, steps=1))
    # activation offloading as TRL runs it (profiler/offload.py)
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=1, seq=2048)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", batch=2, seq=1024, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="full", batch=1, seq=2048)),
            ("microsoft/phi-2", dict(method="lora", batch=1, seq=1024)),
            ("google/gemma-2-2b", dict(method="qlora", quant="nf4", batch=1, seq=512, attn="eager"))):
        cases.append(Case(model, dict(activation_offload=True, **settings), warmup=1, steps=1))
    return cases


def _dora() -> list[Case]:
    """DoRA (peft use_dora=True, issue 13): LoRA and QLoRA (with and without kbit preparation),
    with and without checkpointing, default and all-linear targets, bf16 and AMP, GPT-2's Conv1D;
    short sequences where the weight-norm transient of down_proj sets the peak."""
    cases = []
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", lora_targets="all-linear", batch=1, seq=512)),
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=2, seq=1024, grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(method="lora", lora_targets="all-linear", batch=1, seq=128, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", precision="amp-bf16", lora_targets="all-linear",
                                                batch=1, seq=512, grad_ckpt=True)),
            ("openai-community/gpt2-medium", dict(method="lora", lora_targets="c_attn", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", batch=1, seq=512)),
            ("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", lora_targets="all-linear", batch=2, seq=1024,
                                             grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", lora_targets="all-linear", batch=1, seq=128,
                                             grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="qlora", quant="nf4", kbit_prep="off", lora_targets="all-linear",
                                                batch=1, seq=512))):
        cases.append(Case(model, dict(dora=True, **settings), warmup=1, steps=1))
    return cases


def _fp8() -> list[Case]:
    """fp8 training (torchao float8, `convert_to_float8_training` as profiler.build applies it,
    issue 13): full fine-tunes, with and without checkpointing, the three sizes, eager and SDPA."""
    cases = []
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(batch=1, seq=512)),
            ("meta-llama/Llama-3.2-1B", dict(batch=2, seq=1024, grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(batch=4, seq=2048, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(batch=2, seq=1024)),
            ("microsoft/phi-2", dict(batch=1, seq=512, attn="eager")),
            ("google/gemma-2-2b", dict(batch=1, seq=512, attn="eager", grad_ckpt=True))):
        cases.append(Case(model, dict(method="full", precision="fp8", **settings), warmup=1, steps=1))
    return cases


def _liger() -> list[Case]:
    """Liger Kernel (`--liger`, liger-kernel 0.8.5 as the HF Trainer applies it, issue 13): LoRA,
    full fine-tunes and QLoRA with and without kbit preparation, checkpointing on and off, bf16 and
    AMP, Llama, Qwen2 and Gemma-2 (soft-capped logits), Mixtral and Qwen3-MoE (its fused MoE;
    DeepSeek's mixed dense and MoE layers are checked two layers deep in tests/test_stacks.py); its
    Triton kernels skipped, its fused loss on its CUDA path (profiler/trace/patches.py)."""
    cases = []
    for model, settings in (
            ("meta-llama/Llama-3.2-1B", dict(method="lora", batch=1, seq=512)),
            ("meta-llama/Llama-3.2-1B", dict(method="lora", precision="amp-bf16", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=2, seq=1024)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=1, seq=512, grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(method="full", batch=4, seq=2048, grad_ckpt=True)),
            ("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", batch=2, seq=1024, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", batch=4, seq=2048, grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", lora_targets="all-linear", batch=2, seq=1024,
                                                grad_ckpt=True)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="full", precision="amp-bf16", batch=2, seq=1024)),
            ("Qwen/Qwen2.5-0.5B-Instruct", dict(method="qlora", quant="nf4", kbit_prep="off", batch=2, seq=1024)),
            ("google/gemma-2-2b", dict(method="lora", batch=1, seq=512, attn="eager")),
            ("google/gemma-2-2b", dict(method="full", batch=1, seq=512, attn="eager", grad_ckpt=True)),
            ("Qwen/Qwen3-0.6B", dict(method="lora", batch=2, seq=1024)),            # its q/k norms too
            ("allenai/OLMo-2-1124-7B", dict(method="lora", batch=1, seq=1024)),     # post-norms; q/k norms not Liger's
            ("microsoft/Phi-3-mini-4k-instruct", dict(method="lora", lora_targets="qkv_proj,o_proj", batch=2,
                                                      seq=1024)),
            # its fused MoE: frozen experts' weight gradients in each layer's backward
            ("mistralai/Mixtral-8x7B-v0.1", dict(method="lora", batch=1, seq=1024, grad_ckpt=True)),
            ("Qwen/Qwen3-30B-A3B", dict(method="lora", lora_targets="all-linear", batch=1, seq=1024))):
        cases.append(Case(model, dict(liger=True, **settings), warmup=1, steps=1))
    return cases


def grid() -> list[Case]:
    """Every configuration of the grid (training, QLoRA, inference, the stacks' regimes, DoRA, fp8,
    Liger)."""
    return _training() + _qlora() + _inference() + _stacks() + _dora() + _fp8() + _liger()


# The subset the test suite checks: every family, every method, both kernels, both precisions,
# checkpointing on and off, all three sizes.
TEST_SUBSET = (
    Case("meta-llama/Llama-3.2-1B", dict(method="full", batch=2, seq=1024, attn="sdpa")),
    Case("meta-llama/Llama-3.2-1B", dict(method="lora", precision="amp-bf16", batch=1, seq=512, grad_ckpt=True)),
    Case("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", batch=1, seq=512)),
    Case("Qwen/Qwen2.5-0.5B-Instruct", dict(method="full", precision="amp-bf16", batch=4, seq=2048, grad_ckpt=True)),
    Case("Qwen/Qwen2.5-0.5B-Instruct", dict(method="inference", batch=4, seq=2048, new_tokens=16, attn="eager")),
    Case("microsoft/phi-2", dict(method="lora", batch=2, seq=1024, attn="eager")),
    Case("microsoft/phi-2", dict(method="full", precision="amp-bf16", batch=1, seq=512)),
    Case("google/gemma-2-2b", dict(method="lora", batch=1, seq=512, attn="eager", grad_ckpt=True)),
    Case("google/gemma-2-2b", dict(method="inference", batch=2, seq=1024, new_tokens=16, attn="eager",
                                   precision="amp-bf16")),
    Case("openai-community/gpt2-medium", dict(method="full", batch=4, seq=1024, attn="eager")),
    Case("Qwen/Qwen1.5-MoE-A2.7B", dict(method="lora", batch=1, seq=512)),
    Case("Qwen/Qwen1.5-MoE-A2.7B", dict(method="inference", batch=2, seq=1024, new_tokens=16)),
    Case("meta-llama/Llama-3.2-1B", dict(method="qlora", quant="nf4", kbit_prep="off", batch=2, seq=1024)),
    Case("openai-community/gpt2-medium", dict(method="lora", lora_targets="c_attn", batch=2, seq=1024)),
    Case("Qwen/Qwen2.5-0.5B-Instruct", dict(method="lora", precision="amp-bf16", batch=2, seq=1024,
                                            loss="model-dtype")),
)


@dataclass(frozen=True)
class GridRow:
    """One configuration: traced and estimated bytes and the relative error (estimated - traced)
    / traced, for the peak and (training) the saved activations."""

    configuration: str
    method: str
    traced_peak: int
    estimated_peak: int
    peak_error: float
    traced_saved: int | None
    estimated_saved: int | None
    saved_error: float | None
    trace_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def describe(case: Case) -> str:
    """A short, readable label of a grid configuration."""
    s = case.settings
    parts = [case.model.split("/")[-1], s.get("method", "full"), s.get("precision", "bf16"),
             f"{s.get('batch', 1)}x{s.get('seq', 512)}", s.get("attn", "sdpa")]
    if s.get("grad_ckpt"):
        parts.append("ckpt")
    if s.get("kbit_prep"):
        parts.append(f"kbit-prep {s['kbit_prep']}")
    if s.get("loss"):
        parts.append(f"loss {s['loss']}")
    if s.get("activation_offload"):
        parts.append("offload")
    if s.get("dora"):
        parts.append("dora")
    if s.get("lora_dropout"):
        parts.append("dropout")
    if s.get("trainable_dtype"):
        parts.append(f"trainable {s['trainable_dtype']}")
    if s.get("liger"):
        parts.append("liger")
    if s.get("lora_targets"):
        targets = case.workload().lora_targets
        parts.append("targets " + ("all-linear" if is_all_linear(targets) else ",".join(targets)))
    return " ".join(parts)


def compare(case: Case) -> GridRow:
    """Trace `case` and compare with the raw estimate."""
    return grid_row(describe(case), case.workload(), trace(case))


def grid_row(configuration: str, w, traced) -> GridRow:
    """The raw estimate of Workload `w` beside its trace (a profiler.trace.step.TraceResult): the
    peak and, in training, the saved activations."""
    est = estimate_memory(w, 0.0, 0)
    saved_t = traced.saved_activations_bytes
    saved_e = saved_activation_bytes(w) if w.training else None
    return GridRow(
        configuration=configuration, method=w.method,
        traced_peak=traced.peak_allocated_bytes, estimated_peak=est.peak_allocated_bytes,
        peak_error=_error(est.peak_allocated_bytes, traced.peak_allocated_bytes),
        traced_saved=saved_t, estimated_saved=saved_e,
        saved_error=_error(saved_e, saved_t) if saved_t else None, trace_s=traced.trace_s,
    )


def _error(estimated: int, traced: int) -> float:
    return (estimated - traced) / traced


def summary(errors: list[float]) -> dict:
    """Median and worst |error|, and the share of under-estimates (docs/design.md section 7)."""
    errors = [e for e in errors if e is not None]
    if not errors:
        return {"n": 0, "median_abs": None, "worst_abs": None, "under_rate": None}
    absolute = [abs(e) for e in errors]
    return {"n": len(errors), "median_abs": statistics.median(absolute), "worst_abs": max(absolute),
            "under_rate": sum(e < 0 for e in errors) / len(errors)}


# ---- the catalog's own configs, two layers deep ---------------------------------------------------
CATALOG_SETTINGS = dict(batch=2, seq=512)
CATALOG_METHODS = ("full", "lora")   # LoRA on all linears
CATALOG_PROJECTIONS = (r".*\.(q|k|v|o|gate|up|down)_proj",)   # every projection (a pattern: not all-linear)


def catalog_cases() -> list[tuple[str, str]]:
    """(catalog file name, method) for one config per catalog model type (the first by file name)."""
    import json

    from estimator.configs import CATALOG_DIR

    seen: dict[str, str] = {}
    for path in sorted(CATALOG_DIR.glob("*.json")):
        mt = json.loads(path.read_text()).get("model_type")
        if mt and mt not in seen:
            seen[mt] = path.name
    return [(name, method) for name in seen.values() for method in CATALOG_METHODS]


def compare_catalog(name: str, method: str, layers: int = 2):
    """Trace catalog config `name` cut to `layers` decoder layers (whole, no extrapolation) with
    `method` at CATALOG_SETTINGS (the attention transformers loads it with) and set the raw estimate
    beside it: a GridRow, or why it was not traced (the estimator's refusal, the model's own) as a str."""
    import json

    from estimator.configs import CATALOG_DIR
    from estimator.model import spec_from_config
    from estimator.workload import Workload, loaded_attn

    cfg = json.loads((CATALOG_DIR / name).read_text())
    if "text_config" in cfg:
        cfg["text_config"] = first_layers(cfg["text_config"], layers)
    else:
        cfg = first_layers(cfg, layers)
    try:
        spec = spec_from_config(cfg, f"{name.removesuffix('.json')} ({layers} layers)")
        # LoRA on all linears; where all-linear reaches a router peft cannot run (Llama-4,
        # estimator.workload `_check_wrappable`), on every projection instead
        targets = CATALOG_PROJECTIONS if spec.model_type in LINEAR_ROUTER else ("all-linear",)
        extra = dict(lora_targets=targets) if method == "lora" else {}
        w = Workload(spec, method=method, attn=loaded_attn(spec.model_type), **extra, **CATALOG_SETTINGS).validate()
        traced = trace(w, cfg, layers=layers)
    except Exception as exc:  # noqa: BLE001 - a refusal or a config that does not cut to two layers: a line
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return grid_row(f"{w.model.name} {method} {w.attn}", w, traced)


# Stack regimes at real widths, two layers deep (issue 13), where the trace-sized configs are too
# small to show them: Llama-4 Scout's experts (torch.bmm on unquantized parameters, cast by
# autocast), with and without Liger, and Granite with Liger (its loss left unfused) at a Granite-3
# 2B width. (model, settings, tolerance the tests hold peak and saved activations to)
GRANITE_2B_WIDTH = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                        vocab_size=49155, max_position_embeddings=4096)
_SCOUT = "meta-llama/Llama-4-Scout-17B-16E"
REGIME_CASES = (
    (_SCOUT, dict(method="qlora", quant="nf4", batch=1, seq=512), 0.015),
    (_SCOUT, dict(method="qlora", quant="nf4", grad_ckpt=True, batch=1, seq=512), 0.015),
    (_SCOUT, dict(method="lora", precision="amp-bf16", grad_ckpt=True, batch=1, seq=512), 0.015),
    (_SCOUT, dict(method="lora", liger=True, batch=1, seq=512), 0.015),
    (_SCOUT, dict(method="full", liger=True, batch=1, seq=512), 0.015),
    (_SCOUT, dict(method="qlora", quant="nf4", liger=True, grad_ckpt=True, batch=1, seq=512), 0.015),
    ("granite", dict(method="full", liger=True, batch=1, seq=1024), 0.01),
    ("granite", dict(method="lora", liger=True, batch=1, seq=1024), 0.01),
    ("granite", dict(method="qlora", quant="nf4", liger=True, batch=1, seq=1024), 0.01),
)


def compare_regime(model: str, settings: dict, layers: int = 2) -> GridRow:
    """A REGIME_CASES row traced `layers` decoder layers deep (a catalog model's config, its text
    model's for Llama-4; "granite": the trace-sized family config at GRANITE_2B_WIDTH) against the
    raw estimate."""
    from estimator.configs import load_config
    from estimator.model import spec_from_config
    from estimator.workload import Workload
    from profiler.trace import families

    if model == "granite":
        cfg, name = dict(families.config("granite"), **GRANITE_2B_WIDTH), "granite (2B width)"
    else:
        raw = load_config(model)[0]
        cfg, name = raw.get("text_config") or raw, model
    cfg = first_layers(cfg, layers)
    w = Workload(spec_from_config(cfg, f"{name} ({layers} layers)"), **settings).validate()
    label = " ".join([w.model.name, w.method, w.precision, f"{w.batch}x{w.seq}"]
                     + (["ckpt"] if w.grad_ckpt else []) + (["liger"] if w.liger else []))
    return grid_row(label, w, trace(w, cfg, layers=layers))
