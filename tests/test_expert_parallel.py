"""--ep (expert parallel): the routed experts of every MoE layer split over ep ranks, the rest replicated.
Expected values are worked by hand from the catalog config's raw numbers and the meta-build total
(tests/data/catalog_param_counts.csv, transformers 5.23), never from the estimator's own counts."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.configs import CATALOG_DIR, load_spec
from estimator.errors import InputError
from estimator.memory import components
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


def _meta_total(hub_id: str) -> int:
    with (Path(__file__).with_name("data") / "catalog_param_counts.csv").open(newline="") as f:
        return int(next(r for r in csv.DictReader(f) if r["hub_id"] == hub_id)["params_total"])


def test_qwen3_30b_a3b_experts_split_eight_ways_hand_worked():
    raw = json.loads((CATALOG_DIR / "Qwen--Qwen3-30B-A3B.json").read_text())
    layers, experts, hidden, width = (raw["num_hidden_layers"], raw["num_experts"], raw["hidden_size"],
                                      raw["moe_intermediate_size"])
    assert (layers, experts, hidden, width) == (48, 128, 2048, 768)
    routed = layers * experts * 3 * hidden * width          # gate, up, down of every routed expert
    assert routed == 28_991_029_248
    total = _meta_total("Qwen/Qwen3-30B-A3B")                 # 30,532,122,624
    per_gpu = total - routed + routed // 8                  # 1/8 of the experts, everything else whole
    assert per_gpu == 5_164_972_032
    spec = load_spec("qwen3-30b-a3b")
    one = components(Workload(spec, method="full", precision="bf16", gpus=8).validate())
    ep8 = components(Workload(spec, method="full", precision="bf16", gpus=8, ep=8).validate())
    assert one.weights == 2 * total                         # bf16 weights, no expert parallel
    assert ep8.weights == 2 * per_gpu                       # bf16 weights
    assert ep8.gradients == 2 * per_gpu                     # bf16 gradients
    assert ep8.optimizer_states == one.optimizer_states * per_gpu / total   # Adam states follow the elements
    # LoRA: the frozen experts are split the same way; adapters (q_proj, v_proj) are not experts
    lora1 = components(Workload(spec, method="lora", gpus=4).validate())
    lora4 = components(Workload(spec, method="lora", gpus=4, ep=4).validate())
    assert lora1.weights - lora4.weights == 2 * (routed - routed // 4)
    # inference holds a quarter of the experts' bytes per GPU with ep 4
    inf = components(Workload(spec, method="inference", gpus=4, ep=4).validate())
    assert inf.weights == 2 * (total - routed + routed // 4)


def test_ep_must_divide_experts_and_gpus_and_need_a_moe_model():
    spec = load_spec("qwen3-30b-a3b")
    for bad, words in (({"gpus": 8, "ep": 3}, "divide the 128 experts"), ({"gpus": 4, "ep": 8}, "divide the 4 GPUs"),
                       ({"gpus": 4, "ep": 4, "zero": 2}, "without ZeRO"), ({"gpus": 8, "ep": 8, "tp": 2}, "divide the 8 GPUs")):
        with pytest.raises(InputError, match=words):
            Workload(spec, **bad).validate()
    with pytest.raises(InputError, match="has none"):
        Workload(load_spec("llama-3.1-8b"), gpus=2, ep=2).validate()
    with pytest.raises(InputError):
        Workload(spec, ep=0).validate()


@pytest.mark.parametrize("args,words", [
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--ep", "3"], "--ep 3 must divide the 128 experts"),
    (["--model", "qwen3-30b-a3b", "--gpus", "2", "--ep", "4"], "--ep 4 must divide the 2 GPUs"),
    (["--model", "llama-3.1-8b", "--gpus", "2", "--ep", "2"], "has none"),
    (["--model", "qwen3-30b-a3b", "--ep", "-1"], "ep")])
def test_bad_ep_is_one_stderr_line_and_exit_2(args, words):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "estimate.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("estimate.py: error: ") and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
