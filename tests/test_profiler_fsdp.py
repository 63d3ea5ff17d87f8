"""The profiler builds FSDP2 (`fully_shard`), DDP and activation offloading for real (profiler/fsdp.py),
run through the child (profiler/child.py) on CPU under gloo.

Expectations come from torch's own rules, not from the code under test: FSDP2 shards every
parameter on dim 0 into `torch.chunk(world)` pieces padded to chunk 0's size
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py `_init_sharded_param`), counted on a meta
build of the same model; and the estimator's shard bytes (estimator/fsdp.py) must equal them.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from estimator.configs import load_spec
from estimator.states import model_states, states_key
from estimator.workload import Workload
from profiler import build, offload, steps
from profiler import fsdp as pfsdp
from profiler.case import Case
from profiler.runner import free_port, launch_command

from tests.tiny_configs import ODD, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny-llama.json"


def _odd_config(folder: Path) -> str:
    """tiny-llama with odd sizes, so FSDP's padding of the last chunk matters."""
    return str(tiny_llama(folder, "odd", **ODD))


def _padded_shard_elements(case: Case, world: int) -> int:
    """Elements rank 0 stores: ceil(dim0 / world) rows of every parameter (meta build, no FSDP)."""
    w = case.with_(fsdp="none", offload="none", gpus=1).workload()
    model = build.build_model(case.config(), w, "meta")
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.parameters())


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _run_child(tmp_path: Path, case: Case, world: int) -> list[dict]:
    case_path, out = tmp_path / "case.json", tmp_path / "R.json"
    case_path.write_text(case.to_json())
    base = [sys.executable, "-m", "profiler.child", "--case", str(case_path), "--out", str(out), "--backend", "cpu"]
    cmd = launch_command(base, world, 0, free_port())
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if world == 1:
        return [json.loads(out.read_text())[0]]
    return [json.loads((tmp_path / f"R.rank{r}.json").read_text())[0] for r in range(world)]


@pytest.mark.parametrize("mode", ["full", "grad-op"])
def test_fsdp_two_gloo_ranks_hold_the_padded_shards(tmp_path, mode):
    case = Case(_odd_config(tmp_path), {"fsdp": mode, "gpus": 2, "seq": 16, "precision": "bf16"}, 1, 1)
    rows = _run_child(tmp_path, case, 2)
    per_rank = _padded_shard_elements(case, 2)
    w = case.workload()
    estimated = model_states(states_key(w))
    for rank, row in enumerate(rows):
        assert (row["status"], row["rank"], row["world_size"]) == ("ok", rank, 2), row.get("message")
        # accelerate's recipe: fp32 sharded master copies of what trains, padded to chunk 0's size
        assert row["weights_bytes"] == 4 * per_rank
    assert estimated.weights == rows[0]["weights_bytes"]
    # about half the model each (the padding is at most one row per parameter)
    full = _padded_shard_elements(case, 1)
    assert full / 2 <= per_rank < full / 2 + full / 10


def test_fsdp_cpu_offload_puts_params_grads_and_adam_shards_on_the_host(tmp_path):
    case = Case(_odd_config(tmp_path), {"fsdp": "full", "offload": "optimizer+params", "gpus": 2, "seq": 16,
                                        "precision": "bf16"}, 1, 1)
    rows = _run_child(tmp_path, case, 2)
    per_rank = _padded_shard_elements(case, 2)
    for row in rows:
        assert row["status"] == "ok", row.get("message")
    # rank 1's Adam states are zeros_like its unpadded chunk: rank 0 (full chunks) is the busiest
    assert 0 < rows[1]["host_offload_bytes"] <= rows[0]["host_offload_bytes"]
    for row in rows[:1]:
        # read after the step: fp32 shard 4 + Adam exp_avg, exp_avg_sq 8 (the fp32 gradient shard
        # was freed by the step's zero_grad(set_to_none=True))
        assert row["host_offload_bytes"] == 12 * per_rank


def test_fsdp_hybrid_is_a_skipped_row_saying_why(tmp_path):
    case = Case(str(TINY), {"fsdp": "hybrid", "gpus": 1, "nodes": 2, "seq": 16, "precision": "bf16"}, 1, 1)
    with pytest.raises(build.MissingPackage, match="2 nodes"):
        build.check_packages(case.workload())


def _saved_count(model, batch, w):
    """(saves TRL offloads, saves it keeps on the device), counted by our own hook (no offload):
    outside the output head, of >= 1 KiB, not a parameter's storage, the first save of each
    storage region (a later save of an offloaded region stays on the device)."""
    head, inside = model.get_output_embeddings(), [False]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, count = set(), [0, 0]
    pre = head.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    post = head.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def pack(t):
        if inside[0]:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype)
        moved = (t.element_size() * t.nelement() >= 1024 and key not in seen
                 and t.untyped_storage().data_ptr() not in params)
        seen.add(key) if moved else None
        count[0 if moved else 1] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False).loss.backward()
    pre.remove()
    post.remove()
    model.zero_grad(set_to_none=True)
    return tuple(count)


def test_activation_offload_moves_the_saved_tensors_and_keeps_the_gradients():
    case = Case(str(TINY), {"activation_offload": True, "seq": 16}, 1, 1)
    w = case.workload()
    torch.manual_seed(0)
    model = build.build_model(case.config(), w, "cpu")
    batch = build.make_batch(w, 1000, "cpu")
    moved, kept = _saved_count(model, batch, w)
    ref = model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False).loss
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with offload.offload_activations(model, "cpu", offload.host_copy(pin=False)) as off:
        loss = model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False).loss
    # every save is moved or kept; a storage saved again after it left the forward stash moves again
    # (TRL >= 1.8.0 forgets it then), so more may move than the count that remembers every storage
    assert off.moved + off.kept == moved + kept and off.moved >= moved > 0 and 0 < off.kept <= kept
    assert len(off.fwd_stash) <= offload.FORWARD_STASH
    loss.backward()
    assert not off.tracker and not off.bwd_stash and not off.fwd_stash   # all unpacked, all let go
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


def _dedupe_run(legacy: bool) -> tuple:
    """Saves packed by hand on fake tensors whose device addresses the test chooses: `a` saved twice
    in a row, `c` and `d` once, five other tensors (so all leave the forward stash), `d` and `a`
    again, then `b`, which the allocator put where the freed `c` was; then a view that does not
    start its storage. Returns (moved, kept, whether the view's stashed tensor is a copy)."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    from profiler import offload

    addresses = {}

    def place(t, address):
        addresses[t.untyped_storage()._cdata] = address
        return t

    with FakeTensorMode(), offload.fake_addresses(lambda t: addresses.get(t.untyped_storage()._cdata)), \
            (offload.legacy_dedupe() if legacy else nullcontext()):
        off = offload.Offloader(torch.nn.Linear(2, 2), "cpu", offload.metadata_copy)
        a = place(torch.empty(1024), 1 << 30)
        c = place(torch.empty(1024), 2 << 30)
        d = place(torch.empty(1024), 3 << 30)
        off.pack(a), off.pack(a), off.pack(c), off.pack(d)
        for i in range(5):
            off.pack(place(torch.empty(1024), (4 + i) << 30))
        off.pack(d), off.pack(a)
        del c                                   # freed: its block goes to the next tensor of its size
        off.pack(place(torch.empty(1024), 2 << 30))
        base = place(torch.empty(2048), 9 << 30)
        number = off.pack(base[1024:])
        return off.moved, off.kept, off.fwd_stash[number].untyped_storage()._cdata != base.untyped_storage()._cdata


def test_trl_forgets_an_offloaded_storage_when_it_leaves_the_forward_stash():
    """TRL >= 1.8.0 (huggingface/trl#6241): a storage's key is tracked while its tensor is in the
    forward stash or kept so until the backward unpacks it: `a` saved right again stays on the
    device, and so does its third save; `d`, saved again after five more, moves again, and so does
    `b` at the address of the freed `c`. TRL 0.25.0-1.7.x kept every key to the end of the forward:
    `d` and `b` stayed too. TRL >= 1.8.0 also copies a view that does not start its storage before
    the host copy (the copy is what the stash holds)."""
    assert _dedupe_run(legacy=False) == (11, 2, True)
    assert _dedupe_run(legacy=True) == (9, 4, False)


def test_activation_offload_row_is_ok_in_one_process(tmp_path):
    case = Case(str(TINY), {"activation_offload": True, "seq": 16}, 1, 1)
    row = _run_child(tmp_path, case, 1)[0]
    assert (row["status"], row["world_size"]) == ("ok", 1), row.get("message")


def test_activation_offload_is_traced_and_the_estimate_follows():
    """The tracer runs TRL's offloading on fake tensors (host copies keep no bytes, a tensor brought
    back is a new device allocation, addresses from its model of the caching allocator): the traced
    peak falls; the estimate (one whole layer in flight, the later saves TRL keeps) is not under it
    and at most 3% over, and its uncalibrated safe bound covers it."""
    from estimator.api import estimate
    from profiler.trace import trace

    for settings in ({"method": "lora", "batch": 2, "seq": 1024}, {"method": "full", "batch": 1, "seq": 2048}):
        on = Case("meta-llama/Llama-3.2-1B", {**settings, "activation_offload": True}, 1, 1)
        off = Case("meta-llama/Llama-3.2-1B", settings, 1, 1)
        traced_on, traced_off = trace(on).peak_allocated_bytes, trace(off).peak_allocated_bytes
        assert traced_on < traced_off
        est = estimate(on.workload(), "h100-80gb", "none", cpu_trace=True)
        assert est.memory.offloaded_activations_bytes > 0
        assert traced_on <= est.memory.peak_allocated_bytes <= 1.03 * traced_on
        assert est.safe["peak_allocated_bytes"] >= traced_on
        assert any("activation offloading" in n for n in est.regime_notes)


def test_fsdp2_gradient_accumulation_keeps_gradients_unsharded_until_the_last_micro_batch():
    """accelerate's no_sync for FSDP2 (accelerator.py line 1167): set_requires_gradient_sync(False)
    on every micro-batch but the last, True again after it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        assert isinstance(model, FSDPModule)
        seen = []
        model.set_requires_gradient_sync = lambda flag, **kw: seen.append(flag)
        for last in (False, True):
            with steps._sync_context(model, last=last):
                seen.append("step")
        assert seen == [False, "step", True, "step"]
    finally:
        dist.destroy_process_group()


def test_fsdp_gradient_accumulation_row_is_ok(tmp_path):
    case = Case(_odd_config(tmp_path), {"fsdp": "full", "gpus": 2, "seq": 16, "precision": "bf16",
                                        "grad_accum": 2}, 1, 1)
    rows = _run_child(tmp_path, case, 2)
    assert [row["status"] for row in rows] == ["ok", "ok"], rows[0].get("message")


@pytest.mark.parametrize("parallel", [{}, {"fsdp": "full"}])
def test_two_ranks_accumulating_time_the_reducing_micro_batch_apart(tmp_path, parallel):
    # DDP and FSDP under accumulation: the micro-batches in no_sync and the last one (whose backward
    # reduces the gradients across the ranks) are timed apart, the same work in the same order
    settings = {"gpus": 2, "seq": 16, "grad_accum": 3, "precision": "bf16", **parallel}
    rows = _run_child(tmp_path, Case(str(TINY), settings, 1, 2), 2)
    for row in rows:
        assert row["status"] == "ok", row.get("message")
        assert row["nosync_microbatch_s"] > 0 and row["sync_microbatch_s"] > 0
        assert 0 < row["optimizer_s"] < row["step_s"]
        assert 2 * row["nosync_microbatch_s"] + row["sync_microbatch_s"] < row["step_s_max"] * 1.5


def test_one_process_or_no_accumulation_leaves_the_reduction_unmeasured(tmp_path):
    # one process reduces nothing; two ranks without accumulation have no no_sync micro-batch
    (one,) = _run_child(tmp_path, Case(str(TINY), {"seq": 16, "grad_accum": 2}, 1, 1), 1)
    rows = _run_child(tmp_path, Case(str(TINY), {"gpus": 2, "seq": 16}, 1, 1), 2)
    for row in [one] + rows:
        assert row["status"] == "ok", row.get("message")
        assert row["nosync_microbatch_s"] is None and row["sync_microbatch_s"] is None
        assert row["optimizer_s"] > 0
