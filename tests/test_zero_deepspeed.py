"""ZeRO model-state memory of `estimator.memory.estimate_memory` against DeepSpeed 0.19.8.

Independent sources:
- DeepSpeed's own numeric estimators, called with the parameter count transformers builds
  (tests/data/catalog_param_counts.csv) and the largest layer measured on a meta-device model with
  DeepSpeed's own definition (stage3.model_to_params: most parameters held directly by one module);
- where that estimator leaves out a buffer DeepSpeed allocates, the allocation in DeepSpeed's
  source (file and line cited next to each test), the value the test then expects;
- the ZeRO paper's 16 bytes per parameter for mixed-precision Adam.

DeepSpeed's formulas (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, 0.19.8):
  zero2, no offload: gpu = 2P + int(18P/N), 18 = 2 bf16 grads + 4 fp32 grads + 4 fp32 master + 8 Adam
  zero2, offload:    gpu = 2P;             cpu = P * max(4 N, 16) * 1.5 (per node)
  zero3, no offload: gpu = 4L + int(18P/N); (cpu = 4L * gpus_per_node * 1.5 with zero.Init: loading)
  zero3, offload optimizer: gpu = 4L + int(2P/N);  cpu = 16P / nodes * 1.5
  zero3, offload optimizer+params: gpu = 4L;       cpu = 18P / nodes * 1.5
with P parameters, L the largest layer's parameters, N GPUs in all, 1.5 = additional_buffer_factor.
"""

import csv
import warnings
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from estimator.configs import load_config, load_spec
from estimator.defaults import overhead
from estimator.memory import estimate_memory
from estimator.params import count_params
from estimator.workload import Workload

transformers.logging.set_verbosity_error()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import model_to_params as ds_model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default
# DeepSpeed ZeRO config defaults (deepspeed/runtime/zero/config.py): reduce_bucket_size 5e8,
# stage3_prefetch_bucket_size 5e7, sub_group_size 1e9, contiguous_gradients True.
REDUCE_BUCKET = 500_000_000
SUB_GROUP = 1_000_000_000

MODELS = [
    "meta-llama/Llama-2-7b-hf",      # dense MHA; largest layer = embedding / lm_head
    "mistralai/Mixtral-8x7B-v0.1",   # MoE; largest layer = one layer's fused experts (1.4B)
    "Qwen/Qwen2.5-0.5B-Instruct",    # tied embeddings; fewer params than one reduce bucket
]
TOPOLOGIES = [(1, 1), (2, 1), (8, 1), (8, 2)]  # (GPUs per node, nodes): N = 1, 2, 8, 16
CASES = [(m, g, n) for m in MODELS for g, n in TOPOLOGIES]
CASE_IDS = [f"{m.split('/')[1]}-{g * n}gpu" for m, g, n in CASES]


def _table_total(hub_id: str) -> int:
    path = Path(__file__).with_name("data") / "catalog_param_counts.csv"
    with path.open(newline="") as f:
        return next(int(r["params_total"]) for r in csv.DictReader(f) if r["hub_id"] == hub_id)


@lru_cache(maxsize=None)
def _meta_sizes(hub_id: str) -> tuple[int, int, int]:
    """(total params from the transformers table, DeepSpeed's largest layer and the largest
    single parameter tensor, both read off a meta-device transformers model)."""
    cfg, _ = load_config(hub_id)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    model.tie_weights()
    _, largest = ds_model_to_params(model)  # its total de-duplicates by data_ptr: wrong on meta
    largest_param = max(p.numel() for p in model.parameters())
    return _table_total(hub_id), largest, largest_param


def _ds_inputs(hub_id: str) -> tuple[int, int]:
    total, largest, _ = _meta_sizes(hub_id)
    return total, largest


def _mem(hub_id: str, zero: int, gpus: int, nodes: int, offload: str = "none"):
    w = Workload(model=load_spec(hub_id), method="full", precision="bf16", zero=zero,
                 gpus=gpus, nodes=nodes, offload=offload).validate()
    return estimate_memory(w, 0.0, 0)


def _states(m) -> int:
    return m.weights_bytes + m.gradients_bytes + m.optimizer_states_bytes + m.master_weights_bytes




def _hf_auto(hub_id: str, stage: int) -> dict:
    """The zero_optimization section the HF Trainer resolves from "auto" values for this model
    (transformers' own HfTrainerDeepSpeedConfig.trainer_config_finalize, sized from hidden_size)."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    cfg, _ = load_config(hub_id)
    config = HfTrainerDeepSpeedConfig({"zero_optimization": {
        "stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}})
    hidden = AutoConfig.for_model(**cfg).hidden_size
    config.trainer_config_finalize(SimpleNamespace(get_warmup_steps=lambda n: 0),
                                   SimpleNamespace(config=SimpleNamespace(hidden_size=hidden)), 1)
    return config.config["zero_optimization"]


def _buckets(hub_id: str, stage: int) -> int:
    """bf16 bytes of the reduce bucket (and, stage 3, the prefetch bucket) as resolved by the HF Trainer."""
    zero = _hf_auto(hub_id, stage)
    return 2 * zero["reduce_bucket_size"] + (2 * zero["stage3_prefetch_bucket_size"] if stage == 3 else 0)


@pytest.mark.parametrize("hub_id", MODELS)
def test_inputs_agree_with_our_counts(hub_id):
    # Precondition of every comparison below: the same P and L on both sides.
    total, largest = _ds_inputs(hub_id)
    p = count_params(load_spec(hub_id))
    assert p.total == total
    assert p.largest_layer == largest


# --- golden: ZeRO paper ------------------------------------------------------------------------

@pytest.mark.parametrize("hub_id", MODELS)
def test_mixed_precision_adam_bytes_per_param(hub_id):
    # Rajbhandari et al. 2020 (ZeRO), section 3.1: mixed-precision Adam keeps 2 (fp16/bf16 params)
    # + 2 (fp16/bf16 grads) + 12 (fp32 master, momentum, variance) = 16 bytes per parameter.
    # DeepSpeed also materialises an fp32 copy of the gradient partition for the update, 4 more
    # bytes, and the bf16 gradients are still alive when it does: stage_1_and_2.py step() runs
    # `single_grad_partition = flat_grad_partition.to(fp32)` before
    # `free_grad_in_param_list(self.params_in_partition[i])` / `averaged_gradients[i] = None`, so
    # source and copy coexist (and `flat_grad_partition` is itself a flattened bf16 copy unless the
    # gradients were pre-flattened). Model states at that instant: 2 + 2 + 4 + 4 + 8 = 20 B/param,
    # which is also what DeepSpeed's estimator gives at N=1 (2P + 18P; its "18" excludes the bf16
    # params). The often quoted "18 B counting fp32 gradients during the update" drops the bf16
    # gradients that are live during the cast (docs/design.md section 3).
    P = _table_total(hub_id)
    m = _mem(hub_id, zero=1, gpus=1, nodes=1)
    assert m.weights_bytes == 2 * P
    assert m.optimizer_states_bytes == 8 * P       # Adam momentum + variance, fp32
    assert m.master_weights_bytes == 4 * P
    assert m.gradients_bytes == 2 * P + 4 * P      # bf16 grads + fp32 gradient partition
    assert _states(m) - 4 * P == 16 * P            # the ZeRO paper's 16 B without the fp32 copy
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, 1, 1, cpu_offload=False)
    assert ds_gpu == 20 * P
    assert _states(m) == ds_gpu


# --- ZeRO-2 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero2_states_equal_deepspeed(hub_id, gpus, nodes):
    # DeepSpeed: 2P (bf16 params, not partitioned in stage 2) + 18P/N (bf16 grads 2 + fp32 grads 4
    # + fp32 master 4 + Adam 8). The bf16 gradient partition and its fp32 copy are live together
    # at the cast in step() (see the golden test above), so the mechanism agrees with its 18.
    P, _ = _ds_inputs(hub_id)
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=False)
    m = _mem(hub_id, 2, gpus, nodes)
    assert abs(_states(m) - ds_gpu) <= 4  # int() truncation of each field
    assert m.host_bytes == 0


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero12_reduce_bucket(hub_id, gpus, nodes, zero):
    # DeepSpeed's estimator leaves out the contiguous-gradient reduce bucket. Stages 1 and 2 (both
    # DeepSpeedZeroOptimizer) allocate it as torch.empty(reduce_bucket_size) in the bf16 model
    # dtype (stage_1_and_2.py setup_buckets, `buf_0`) whatever the model size; a second one only
    # with overlap_comm, which defaults to False below stage 3 (zero/config.py overlap_comm_valid).
    # Checked on CPU with DeepSpeed 0.19.8, stages 1 and 2, reduce_bucket_size 1e6 on a model of
    # 202,048 params: one bf16 buffer of 1,000,000 elements. Expected: 2 B x the size the HF Trainer
    # resolves for "auto" (hidden^2; DeepSpeed's 5e8 default applies only without the integration).
    m = _mem(hub_id, zero, gpus, nodes)
    # Size: the HF integration's "auto" (hidden^2 elements), not DeepSpeed's 5e8 default.
    assert m.zero_buffers_bytes == _buckets(hub_id, zero) < 2 * REDUCE_BUCKET


@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero2_offload_gpu_states(hub_id, gpus, nodes):
    # With offload_optimizer the GPU keeps the bf16 params only (DeepSpeed: gpu = 2P): gradients
    # go from the reduce bucket straight into the fp32 CPU partition
    # (stage_1_and_2.py copy_grads_in_partition: the cpu_offload branch returns before
    # `grads_in_partition` is allocated; async_inplace_copy_grad_to_fp32_buffer_from_gpu).
    P, _ = _ds_inputs(hub_id)
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=True)
    m = _mem(hub_id, 2, gpus, nodes, "optimizer")
    assert m.optimizer_states_bytes == m.master_weights_bytes == 0
    assert m.gradients_bytes == 0
    assert _states(m) == ds_gpu


@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero2_offload_host(hub_id, gpus, nodes):
    # DeepSpeed's host figure is 1.5 x P x max(4N, 16): the larger of two phases, loading (each of
    # the N processes holds an fp32 copy of the model, 4P each, before partitioning) and training
    # (16P: fp32 master 4 + Adam 8 + fp32 gradients 4, not divided over nodes), times a 1.5 safety
    # factor. Per GPU process in training that is 16P/N.
    # What stage_1_and_2.py allocates on the host with offload_optimizer besides those 16P/N:
    # - a bf16 staging copy of the partition, param_buffer_of_bit16_for_cpu_offload_groups
    #   (torch.full(weights_partition.shape, dtype=bf16, device=weights_partition.device = cpu)):
    #   2P/N;
    # - temp_grad_buffer_for_cpu_offload, torch.zeros(largest_param_numel, dtype=bf16, cpu).
    # Expected: at least 16P/N + 2P/N + 2 x largest parameter, and within DeepSpeed's own budget
    # (with its 1.5 factor) where its training term is the one that counts (N <= 4).
    P, _, largest_param = _meta_sizes(hub_id)
    N = gpus * nodes
    ds_cpu, _ = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=True)
    assert ds_cpu == int(P * max(4 * N, 16) * BUFFER_FACTOR)
    m = _mem(hub_id, 2, gpus, nodes, "optimizer")
    assert m.host_bytes >= 16 * P / N - 1                     # the states DeepSpeed counts
    if 4 * N <= 16:
        assert m.host_bytes <= ds_cpu / gpus                  # DeepSpeed's budget, 1.5 included
    assert m.host_bytes >= 18 * P / N + 2 * largest_param - 1  # mechanism: + staging buffers


# --- ZeRO-3 -------------------------------------------------------------------------------------

# Cases whose whole per-GPU partition fits in one DeepSpeed sub-group (P/N <= sub_group_size),
# where the fp32 gradient of the update covers the whole partition.
ONE_SUB_GROUP = [c for c in CASES if _table_total(c[0]) / (c[1] * c[2]) <= SUB_GROUP]
ONE_SUB_GROUP_IDS = [CASE_IDS[CASES.index(c)] for c in ONE_SUB_GROUP]


@pytest.mark.parametrize("hub_id,gpus,nodes", ONE_SUB_GROUP, ids=ONE_SUB_GROUP_IDS)
def test_zero3_states_vs_deepspeed(hub_id, gpus, nodes):
    # DeepSpeed's estimator counts 18 B/param/N for stage 3. Stage 3 allocates per GPU: bf16 param
    # partition 2 (fp16_partitioned_groups_flat), bf16 gradient partition 2 (stage3.py
    # grad_partitions_flat_buffer: torch.zeros at optimizer init, never freed; dtype =
    # grad_accum_dtype = the bf16 model dtype by default, engine.get_data_types), fp32 master 4,
    # Adam 8, and during the step the fp32 gradient of the sub-group being updated, 4
    # (_prepare_fp32_grad_for_sub_group). Checked on CPU with DeepSpeed 0.19.8 ZeRO-3:
    # grad_partitions_flat_buffer is bf16 with numel == params. That is 20, so the expectation is
    # DeepSpeed's figure plus the 2 B/param/N its 18 leaves out.
    P, L = _ds_inputs(hub_id)
    N = gpus * nodes
    _, ds_gpu, ds_largest = estimate_zero3_model_states_mem_needs(
        P, L, gpus, nodes, cpu_offload=False, cpu_offload_params=False)
    assert ds_largest == 4 * L
    m = _mem(hub_id, 3, gpus, nodes)
    assert abs(_states(m) - (ds_gpu - ds_largest) - 2 * P / N) <= 5


@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero3_fp32_gradient_is_one_sub_group(hub_id, gpus, nodes):
    # Stage 3 converts gradients to fp32 one sub-group at a time and frees each after its step
    # (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group). Sub-groups close once
    # their partition numel reaches sub_group_size (1e9, _create_fp16_sub_groups), so the fp32
    # gradient held at once is at most 4 x (1e9 + one parameter's partition) bytes, not 4P/N when
    # P/N is larger (7B at N <= 2, Mixtral at every N up to 16).
    P, L = _ds_inputs(hub_id)
    N = gpus * nodes
    m = _mem(hub_id, 3, gpus, nodes)
    bf16_partition = 2 * P / N
    fp32_bound = 4 * min(P / N, SUB_GROUP + L / N)
    assert m.gradients_bytes <= bf16_partition + fp32_bound + 1


@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero3_gather_working_set_and_buckets(hub_id, gpus, nodes):
    # Largest-layer working set as DeepSpeed estimates it (4L: bf16 params + grads of the largest
    # layer), plus two allocations its estimator leaves out:
    # - the prefetch bucket, stage3_prefetch_bucket_size x 2 B (documented in overheads.csv);
    # - the contiguous-gradient reduce bucket, allocated at optimizer init whatever the offload:
    #   stage3.py _setup_for_real_optimizer, `bucket.buffer = torch.empty(self.reduce_bucket_size,
    #   dtype=<bf16>, device=current_device)` when contiguous_gradients (default True). Checked on
    #   CPU with DeepSpeed 0.19.8 ZeRO-3: ipg_buckets[bf16].buffer.numel() == reduce_bucket_size.
    P, L = _ds_inputs(hub_id)
    _, _, ds_largest = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes, cpu_offload=False)
    m = _mem(hub_id, 3, gpus, nodes)
    assert m.zero_buffers_bytes == ds_largest + _buckets(hub_id, 3)


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero3_offload_gpu_states(hub_id, gpus, nodes, offload):
    # With offload_optimizer, stage 3 sets self.device = cpu (stage3.py, `self.device = ... if not
    # self.offload_optimizer else OffloadDeviceEnum.cpu`) and allocates the bf16 gradient partition
    # there (grad_partitions_flat_buffer, device=self.device). The GPU keeps only the bf16 param
    # partition (none with param offload): DeepSpeed's gpu figure minus its 4L working set.
    P, L = _ds_inputs(hub_id)
    _, ds_gpu, ds_largest = estimate_zero3_model_states_mem_needs(
        P, L, gpus, nodes, cpu_offload=True, cpu_offload_params=(offload == "optimizer+params"))
    m = _mem(hub_id, 3, gpus, nodes, offload)
    assert m.optimizer_states_bytes == m.master_weights_bytes == 0
    assert m.gradients_bytes == 0
    assert abs(_states(m) - (ds_gpu - ds_largest)) <= 2


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero3_offload_host(hub_id, gpus, nodes, offload):
    # DeepSpeed (zero.Init): cpu = (16 or 18) x P / nodes x 1.5 per node, i.e. 16P/N per GPU
    # (fp32 master 4 + Adam 8 + fp32 gradients 4, stage3.py subgroup_gradient_buffer on cpu) and
    # + 2P/N for the offloaded bf16 params. Its estimator leaves out the bf16 gradient partition,
    # which offload_optimizer also puts on the host (grad_partitions_flat_buffer on self.device =
    # cpu): 2P/N more. Smaller host buffers (gradient_buffer of the largest sub-group partition,
    # pinned staging) come on top, so the mechanism gives a lower bound; DeepSpeed's own figure,
    # 1.5 factor included, is the upper one.
    P, L = _ds_inputs(hub_id)
    N = gpus * nodes
    ds_cpu, _, _ = estimate_zero3_model_states_mem_needs(
        P, L, gpus, nodes, cpu_offload=True, cpu_offload_params=(offload == "optimizer+params"))
    ds_per_gpu = ds_cpu / BUFFER_FACTOR / gpus
    m = _mem(hub_id, 3, gpus, nodes, offload)
    assert m.host_bytes <= ds_cpu / gpus
    assert m.host_bytes >= ds_per_gpu + 2 * P / N - 2


@pytest.mark.parametrize("hub_id,gpus,nodes", CASES, ids=CASE_IDS)
def test_zero3_offload_host_matches_deepspeed_on_the_states_it_counts(hub_id, gpus, nodes):
    # The part DeepSpeed's estimator does count must agree whatever happens to the gradient
    # partition: host minus any bf16 gradient partition kept there = DeepSpeed's 16P/N.
    P, L = _ds_inputs(hub_id)
    N = gpus * nodes
    ds_cpu, _, _ = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes, cpu_offload=True,
                                                         cpu_offload_params=False)
    m = _mem(hub_id, 3, gpus, nodes, "optimizer")
    on_host_grads = 2 * P / N - m.gradients_bytes  # 0 if ours keeps them on the GPU
    assert abs(m.host_bytes - on_host_grads - ds_cpu / BUFFER_FACTOR / gpus) <= 3
