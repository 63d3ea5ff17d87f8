"""One question, one answer: an estimate does not depend on what the process estimated before.

Fitting, compare, sweeps and the planners estimate thousands of workloads in one process, so every
memoisation must be keyed by exactly what it reads. A grid that varies every Workload field (each
base workload next to its one-field neighbours, so a cache that ignores a field meets two workloads
that differ in that field alone) is estimated in two shuffled orders, in one process and in two
fresh processes, and every answer (`Estimate.to_dict()` as JSON) must be the same to the byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

from estimator.api import estimate
from estimator.calibration import SCHEMA
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.params import ALL_LINEAR
from estimator.workload import (ADAMW_IMPLS, ATTENTIONS, METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTS,
                                ZERO_STAGES, FSDP_MODES, KBIT_PREPS, LOSSES, TRAINABLE_DTYPES, Workload)

ROOT = Path(__file__).resolve().parents[1]
GPU = "h100-80gb"
MODELS = ("llama-3.1-8b", "qwen1.5-moe-a2.7b", "gemma-2-2b", "gemma-3-1b", "gpt2", "phi-2", "falcon-7b",
          "opt-350m", "qwen3-0.6b", "bloomz-7b1", "gpt-oss-20b",   # gpt-oss: MXFP4
          "qwen2.5-vl-7b")                                          # a vision tower (--train-vision)
CHOICES = {
    "method": METHODS, "precision": PRECISIONS, "optimizer": OPTIMIZERS, "adamw_impl": ADAMW_IMPLS,
    "batch": (1, 2, 8), "seq": (64, 512, 4096), "new_tokens": (0, 16, 256), "grad_accum": (1, 4),
    "lora_rank": (8, 16, 256), "lora_targets": (("q_proj", "v_proj"), ALL_LINEAR, ("o_proj", "down_proj")),
    "dora": (False, True),
    "grad_ckpt": (False, True), "attn": ATTENTIONS, "quant": QUANTS, "double_quant": (True, False),
    "gpus": (1, 2, 8), "nodes": (1, 2), "zero": ZERO_STAGES, "offload": OFFLOADS, "tp": (1, 2), "pp": (1, 2), "ep": (1, 2),
    "fsdp": FSDP_MODES, "kbit_prep": KBIT_PREPS, "liger": (False, True), "activation_offload": (False, True),
    "compiled": (False, True), "train_vision": (False, True), "fp8_backend": ("torchao", "te"), "loss": LOSSES, "lora_dropout": (False, True), "padding_mask": (False, True), "trainable_dtype": TRAINABLE_DTYPES,
}
# A table with every factor, so the calibrated path (and its caches) is in the answers too.
TABLE = {"schema": SCHEMA, "gpu": GPU, "factors": {
    "cuda_context_bytes": 700 * 2**20, "non_pytorch_bytes": 150 * 2**20, "nccl_buffers_bytes": 500 * 2**20,
    "allocated_constant_bytes": 64 * 2**20,
    "reserve": {"full": {"fraction": 0.05, "bytes": 300 * 2**20}, "*": {"fraction": 0.2, "bytes": 100 * 2**20}},
    "activation_scale": {"llama|sdpa": 1.25, "*": 0.9}, "inference_activation_scale": {"*": 1.5},
    "logits_scale": 1.1, "optimizer_temporaries_scale": 2.0,
    "mfu": {"full|1-10B": 0.5, "lora": 0.3, "inference-prefill": 0.6}, "decode_bandwidth_fraction": 0.8}}


def _valid(w: Workload) -> bool:
    try:
        w.validate()
    except InputError:
        return False
    return True


def grid(bases: int = 60, seed: int = 17) -> list[Workload]:
    """Valid random base workloads and every valid workload one field away from each (the model
    is a field too), without duplicates, in a fixed order."""
    rng = random.Random(seed)
    specs = [load_spec(m) for m in MODELS]
    choices = {"model": specs, **CHOICES}
    assert set(choices) == {f.name for f in fields(Workload)}, "the grid must vary every Workload field"
    found: dict[str, Workload] = {}
    made = 0
    # one fixed expert-parallel base (MoE, 2 GPUs, no ZeRO/FSDP): random bases rarely admit --ep 2
    fixed = [Workload(model=specs[MODELS.index("qwen1.5-moe-a2.7b")], gpus=2, ep=2),
             # and GPT-OSS served with its MXFP4 experts (inference, eager): random bases never are
             Workload(model=specs[MODELS.index("gpt-oss-20b")], method="inference", attn="eager", quant="mxfp4"),
             # and a VL model's full fine-tune training its vision tower
             Workload(model=specs[MODELS.index("qwen2.5-vl-7b")], method="full", train_vision=True),
             # and fp8 through Transformer Engine (full fine-tune, no checkpointing, one GPU)
             Workload(model=specs[MODELS.index("llama-3.1-8b")], method="full", precision="fp8", fp8_backend="te"),
             # and a GPTQ checkpoint served (AWQ one field away)
             Workload(model=specs[MODELS.index("llama-3.1-8b")], method="inference", quant="gptq")]
    while made < bases:
        base = fixed.pop() if fixed else Workload(**{name: rng.choice(values) for name, values in choices.items()})
        if not _valid(base):
            continue
        made += 1
        found.setdefault(base.id, base)
        for name, values in choices.items():
            for value in values:
                other = replace(base, **{name: value})
                if other.id not in found and _valid(other):
                    found[other.id] = other
    return list(found.values())


def answers(order_seed: int, table_path: str) -> dict[str, str]:
    """Workload id -> the JSON of its uncalibrated and calibrated estimates, in a shuffled order."""
    work = grid()
    random.Random(order_seed).shuffle(work)
    out = {}
    for i, w in enumerate(work):
        calibration = table_path if i % 2 else "none"
        out[w.id + "|" + ("table" if i % 2 else "none")] = json.dumps(
            estimate(w, GPU, calibration).to_dict(), sort_keys=True)
        # the other calibration too, later in the order, so both paths see every workload
    for i, w in enumerate(reversed(work)):
        first = len(work) - 1 - i                     # its index in the first pass: now the other path
        calibration = "none" if first % 2 else table_path
        key = w.id + "|" + ("none" if first % 2 else "table")
        out[key] = json.dumps(estimate(w, GPU, calibration).to_dict(), sort_keys=True)
    return out


def _digests(found: dict[str, str]) -> dict[str, str]:
    return {k: hashlib.sha256(v.encode()).hexdigest() for k, v in found.items()}


def _fresh_process(order_seed: int, table_path: str) -> dict[str, str]:
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']\n"
            "from test_determinism import answers, _digests\n"
            "print(json.dumps(_digests(answers(int(sys.argv[2]), sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), str(order_seed), table_path],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_grid_varies_every_field_and_is_large():
    work = grid()
    assert len(work) > 1000
    for name in CHOICES:
        assert len({getattr(w, name) for w in work}) == len(CHOICES[name]), name
    assert len({w.model for w in work}) == len(MODELS)


def test_answers_do_not_depend_on_the_order_or_the_process(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(TABLE))
    first = answers(1, str(table))     # one process: order A, then order B, nothing cleared
    second = answers(2, str(table))
    assert first.keys() == second.keys()
    differ = [k for k in first if first[k] != second[k]]
    assert not differ, f"{len(differ)} answers depend on the order, e.g. {differ[:3]}"
    mine = _digests(first)
    for seed in (1, 2):                # fresh processes, each order from a cold start
        fresh = _fresh_process(seed, str(table))
        assert fresh.keys() == mine.keys()
        differ = [k for k in mine if fresh[k] != mine[k]]
        assert not differ, f"{len(differ)} answers differ from a fresh process (order {seed}), e.g. {differ[:3]}"


def test_a_spec_from_another_process_hashes_like_one_made_here():
    """ModelSpec caches its hash; a str hash differs between processes, so a spec pickled in
    another process (multiprocessing, a saved sweep) must not bring its cached hash along."""
    code = ("import pickle, sys; from estimator.configs import load_spec\n"
            "spec = load_spec('llama-3.1-8b'); hash(spec)\n"
            "sys.stdout.buffer.write(pickle.dumps(spec))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONHASHSEED": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, mine = pickle.loads(done.stdout), load_spec("llama-3.1-8b")
    assert theirs == mine and hash(theirs) == hash(mine)
    assert {mine: "found"}[theirs] == "found"
