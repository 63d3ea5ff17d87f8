"""profiler/steps.py on CPU: gradient accumulation under DistributedDataParallel all-reduces once
per optimizer step (the HF Trainer and accelerate wrap every micro-batch but the last in
`model.no_sync()`).

DDP is real (gloo, one process): a communication hook counts the bucket all-reduces the reducer
launches; with `no_sync` the reducer launches none for the first micro-batches.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from profiler import build, steps
from profiler.case import Case

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama.json")


@pytest.fixture
def gloo_world1(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_all_reduces(grad_accum: int) -> tuple[int, int]:
    """(bucket all-reduces in one train_step with `grad_accum` micro-batches, buckets per backward)."""
    case = Case(TINY, {"method": "full", "precision": "fp32", "batch": 1, "seq": 8, "grad_accum": grad_accum})
    w = case.workload()
    torch.manual_seed(0)
    model = build.build_model(case.config(), w, "cpu")
    optimizer = build.make_optimizer(model, w)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())  # world 1: the mean is the gradient itself
        return fut

    ddp.register_comm_hook(None, hook)
    steps.train_step(ddp, optimizer, build.make_batch(w, 1000, "cpu"), w, "cpu")
    return len(calls), len(set(calls))


def test_gradient_accumulation_all_reduces_once_per_step(gloo_world1):
    calls, buckets = _ddp_all_reduces(grad_accum=3)
    assert buckets >= 1
    assert calls == buckets  # the last micro-batch only (without no_sync: 3 x buckets)


def test_without_accumulation_the_one_micro_batch_syncs(gloo_world1):
    calls, buckets = _ddp_all_reduces(grad_accum=1)
    assert calls == buckets >= 1


def test_a_plain_model_accumulates_without_no_sync():
    # the tracer and one-process runs pass the bare model: no DDP, no no_sync
    case = Case(TINY, {"method": "full", "precision": "fp32", "batch": 1, "seq": 8, "grad_accum": 2})
    w = case.workload()
    model = build.build_model(case.config(), w, "cpu")
    optimizer = build.make_optimizer(model, w)
    before = [p.detach().clone() for p in model.parameters()]
    steps.train_step(model, optimizer, build.make_batch(w, 1000, "cpu"), w, "cpu")
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_padding_mask_batch_reaches_the_model_with_its_zeros():
    # --padding-mask: rows padded to --seq, the last quarter masked (8 tokens: positions 6 and 7)
    case = Case(TINY, {"method": "full", "precision": "fp32", "batch": 2, "seq": 8, "padding_mask": True})
    w = case.workload()
    batch = build.make_batch(w, 1000, "cpu")
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]] * 2
    assert build.make_batch(case.workload().with_(padding_mask=False), 1000, "cpu").attention_mask is None
    torch.manual_seed(0)
    model = build.build_model(case.config(), w, "cpu")
    seen = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs.get("attention_mask")),
                                    with_kwargs=True)
    steps.train_step(model, build.make_optimizer(model, w), batch, w, "cpu")
    assert seen and seen[0] is batch.attention_mask
