#!/usr/bin/env python
"""Count the operators one micro-batch dispatches for every model type of the catalog and write
estimator/data/op_counts.csv (the launch floor of estimator.timing, issue 11).

Each model type is counted on one config: the trace-sized one of profiler/trace/families.py when
there is one (the large MoE families), else the catalog's smallest member, with its vocabulary cut
to 512 entries (the count does not depend on widths or vocabulary; a smaller build is faster). Per
type: full training and LoRA (the LoRA targets named in the row), each with and without activation
checkpointing, and the inference prefill. The `*` rows are increments measured on Llama-3.2-1B:
one LoRA adapter (LoRA on q_proj only against all-linear, per adapted module) and autocast
(amp-bf16 against bf16, per decoder linear).

  .venv/bin/python scripts/count_ops.py [--only MODEL_TYPE ... ('*': the increments)] [--check]

--check recounts and exits 1 when a count differs from the committed file (tests/test_ops.py runs it
on GPT-2).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# scripts/ holds profile.py, which would shadow the standard library module cProfile imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]

from estimator.files import atomic_write_text, utc_now  # noqa: E402
from estimator.lora_targets import matched  # noqa: E402
from estimator.errors import InputError  # noqa: E402
from estimator.model import spec_from_config  # noqa: E402
from estimator.workload import Workload  # noqa: E402

OUT = ROOT / "estimator" / "data" / "op_counts.csv"
CATALOG = ROOT / "estimator" / "catalog"
COLUMNS = ("model_type", "method", "grad_ckpt", "phase", "per_layer", "outside", "lora_targets", "counted_on",
           "source", "date")
VOCAB = 512
WIDTH = 256
WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size",
          "n_inner")
# LoRA targets counted per family: peft's defaults where q_proj/v_proj do not exist
LORA = {"gpt2": ("c_attn",), "gpt_bigcode": ("c_attn",), "falcon": ("query_key_value",), "bloom": ("query_key_value",),
        "gpt_neox": ("query_key_value",), "phi3": ("qkv_proj",)}
REFERENCE = "meta-llama--Llama-3.2-1B.json"


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def configs() -> dict[str, tuple[str, dict]]:
    """model_type -> (name, config) to count on."""
    from profiler.trace.families import FAMILIES, config

    out: dict[str, tuple[str, dict]] = {}
    sized = {}
    for f in sorted(CATALOG.glob("*.json")):
        cfg = json.loads(f.read_text())
        spec = spec_from_config(cfg, f.stem)
        mt = spec.model_type   # the key estimator.ops looks up
        size = spec.num_layers * spec.hidden_size
        if mt not in sized or size < sized[mt]:
            sized[mt] = size
            out[mt] = (f.name, cfg)
    trace_sized = {}
    for name in FAMILIES:
        cfg = config(name)
        mt = spec_from_config(cfg, name).model_type
        trace_sized.setdefault(mt, (f"profiler/trace/families.py:{name}", cfg))
    for mt in out:
        if mt in trace_sized:
            out[mt] = trace_sized[mt]
    for mt, (name, cfg) in out.items():
        cfg = json.loads(json.dumps(cfg))
        text = _text(cfg)
        if not name.startswith("profiler/"):
            text["vocab_size"] = VOCAB
            for key in WIDTHS:   # MLP and expert widths: Mixtral's 2 layers would be 11 GB of experts
                if isinstance(text.get(key), int) and text[key] > WIDTH:
                    text[key] = WIDTH
            for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
                if isinstance(text.get(key), int) and text[key] >= VOCAB:
                    text[key] = 0
                if isinstance(text.get(key), list):
                    text[key] = [t if t < VOCAB else 0 for t in text[key]]
        out[mt] = (name, cfg)
    return out


def _targets(spec) -> tuple[str, ...]:
    from profiler.trace.families import LORA as FAMILY_LORA

    for targets in (LORA.get(spec.model_type), FAMILY_LORA.get(spec.model_type), ("q_proj", "v_proj"),
                    ("all-linear",)):
        if targets:
            try:
                matched(spec, targets)
                return targets
            except InputError:
                continue
    return ("all-linear",)


def count_type(mt: str, name: str, cfg: dict) -> list[dict]:
    """The rows of one model type: SDPA attention, or eager where transformers has no SDPA path for
    it (Bloom, Gemma 2, GPT-J, GPT-OSS in transformers 5.23)."""
    from profiler.opcount import count
    from profiler.trace.families import attn

    spec = spec_from_config(cfg, name)
    targets = _targets(spec)
    rows = []
    cases = [("full", False), ("full", True), ("lora", False), ("lora", True), ("inference", False)]
    kernel = "eager" if mt in ("bloom", "gemma2") else attn(mt)   # no SDPA path in transformers 5.23
    for method, ckpt in cases:
        w = Workload(spec, method=method, grad_ckpt=ckpt, lora_targets=targets, attn=kernel,
                     new_tokens=1 if method == "inference" else 0).validate()
        for phase, (per_layer, outside) in sorted(count(w, cfg).items()):
            if per_layer <= 0:   # the layers were not reduced (a config nesting them deeper)
                raise ValueError(f"{phase}: {per_layer} operators per layer: the layer count did not change")
            rows.append(dict(model_type=mt, method=method, grad_ckpt=int(ckpt), phase=phase, per_layer=per_layer,
                             outside=outside, lora_targets=",".join(targets) if method == "lora" else "",
                             counted_on=name))
    return rows


def increments() -> list[dict]:
    """Operators per adapted module and per autocast decoder linear, with and without checkpointing
    (its recompute runs them again, and saves through hooks), on the reference Llama."""
    from profiler.opcount import count

    cfg = json.loads((CATALOG / REFERENCE).read_text())
    cfg["vocab_size"] = VOCAB
    cfg["bos_token_id"], cfg["eos_token_id"] = 0, 0
    spec = spec_from_config(cfg, REFERENCE)
    linears = len(matched(spec, ("all-linear",))) // spec.num_layers
    rows = []
    for ckpt in (False, True):
        one = count(Workload(spec, method="lora", lora_targets=("q_proj",), grad_ckpt=ckpt).validate(), cfg)
        every = count(Workload(spec, method="lora", lora_targets=("all-linear",), grad_ckpt=ckpt).validate(), cfg)
        bf16 = count(Workload(spec, method="full", grad_ckpt=ckpt).validate(), cfg)
        amp = count(Workload(spec, method="full", precision="amp-bf16", grad_ckpt=ckpt).validate(), cfg)
        for phase in ("forward", "backward"):
            rows.append(dict(model_type="*", method="lora-adapter", grad_ckpt=int(ckpt), phase=phase,
                             per_layer=round((every[phase][0] - one[phase][0]) / (linears - 1), 3), outside=0,
                             lora_targets="per adapted module", counted_on=REFERENCE))
            rows.append(dict(model_type="*", method="autocast-linear", grad_ckpt=int(ckpt), phase=phase,
                             per_layer=round((amp[phase][0] - bf16[phase][0]) / linears, 3), outside=0,
                             lora_targets="per decoder linear", counted_on=REFERENCE))
    return rows


def main(argv=None) -> int:
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="model types to count (default: every catalog type)")
    p.add_argument("--check", action="store_true", help="recount and compare with the committed file")
    args = p.parse_args(argv)
    found = configs()
    wanted = [mt for mt in args.only if mt != "*"] if args.only else sorted(found)
    source = (f"counted by scripts/count_ops.py (profiler/opcount.py: aten ops under TorchDispatchMode, real "
              f"tensors on CPU) with torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}")
    rows = []
    for mt in wanted:
        name, cfg = found[mt]
        print(f"{mt}: {name}", file=sys.stderr, flush=True)
        try:
            rows += count_type(mt, name, cfg)
        except Exception as exc:  # noqa: BLE001 - one type that cannot be built is reported, not fatal
            print(f"{mt}: not counted ({type(exc).__name__}: {str(exc)[:160]}); the estimator falls back to "
                  f"llama's counts", file=sys.stderr, flush=True)
    if not args.only or "*" in args.only:
        rows += increments()
    if args.check:
        committed = {(r["model_type"], r["method"], r["grad_ckpt"], r["phase"]): (float(r["per_layer"]), int(r["outside"]))
                     for r in csv.DictReader(OUT.open())}
        bad = [r for r in rows if committed.get((r["model_type"], r["method"], str(r["grad_ckpt"]), r["phase"]))
               != (float(r["per_layer"]), r["outside"])]
        for r in bad:
            print(f"differs: {r}")
        return 1 if bad else 0
    date = utc_now()[:10]
    if args.only and OUT.exists():   # replace the rows of these types, keep the others
        kept = [r for r in csv.DictReader(OUT.open()) if r["model_type"] not in set(args.only)]
        rows = kept + [dict(r, source=source, date=date) for r in rows]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        r = {"source": source, "date": date, **r}
        writer.writerow([r[c] for c in COLUMNS])
    atomic_write_text(OUT, text.getvalue())
    print(f"wrote {OUT.relative_to(ROOT)}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
