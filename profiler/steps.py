"""The steps the profiler times and the tracer traces: one training step (grad_accum micro-batches,
backward, optimizer step) and one inference request (prefill plus decode with a KV cache).

Device-agnostic: the same functions run on cuda, cpu and fake tensors. No synchronisation here:
the caller (measure or trace) decides how to time and when to read memory.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from estimator.workload import Workload
from profiler.build import Batch, autocast_dtype


def _autocast(w: Workload, device_type: str):
    import torch

    dtype = autocast_dtype(w)
    return torch.autocast(device_type=device_type, dtype=dtype) if dtype is not None else nullcontext()


def train_step(model, optimizer, batch: Batch, w: Workload, device_type: str) -> None:
    """Forward and backward over `grad_accum` micro-batches (the same batch: values do not change
    memory or time), then the optimizer step and `zero_grad(set_to_none=True)`.

    With `--loss hf` (the default) only the loss outlives the forward, as in the HF Trainer (`compute_loss` returns the loss and
    drops the outputs): the half-precision logits are freed before the backward starts. Under
    DistributedDataParallel every micro-batch but the last runs in `model.no_sync()`, so gradients
    are all-reduced once per step, as the HF Trainer and accelerate accumulate."""
    forward_backward(model, batch, w, device_type)
    optimizer_step(optimizer)


MAX_GRAD_NORM = 1.0   # TrainingArguments.max_grad_norm's default


def clip_gradients(model) -> None:
    """What the HF Trainer runs between the last micro-batch and the optimizer step: the gradients
    clipped to max_grad_norm (transformers 5.23 trainer.py `_clip_grad_norm`: accelerate's
    clip_grad_norm_, torch.nn.utils.clip_grad_norm_ over every parameter). Timed on its own by the
    profiler (`clip_s`); not run by `train_step`, which the tracer traces (its few scalars of norms
    change no peak)."""
    import torch

    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_GRAD_NORM)


def clipped(row) -> bool:
    """Whether a measured training row's step ran the Trainer's gradient clipping: the profiler's
    own rows did exactly when they timed it (`clip_s`); a row from a real job (one naming its
    `source`, as the Trainer callback's do) ran the Trainer, which clips."""
    from profiler.record import measured_value

    return measured_value(row.get("clip_s")) is not None or bool(str(row.get("source") or "").strip())


def loop_step_s(time, clipped: bool) -> float:
    """What the profiler's training loop measures as `step_s`, predicted from an estimate's time
    (estimator.timing.TimeBreakdown): the loop runs no host work between steps (no data loader,
    scheduler or logging: the estimate's fixed `overhead_s`) and clips the gradients only where the
    row timed the clipping (`clip_s`: DeepSpeed's engine and the rows before it did not)."""
    return time.step_s - time.overhead_s - (0.0 if clipped else time.clip_s)


def optimizer_step(optimizer) -> None:
    """The optimizer step of `train_step`, timed on its own by the profiler (`optimizer_s`)."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def forward_backward(model, batch: Batch, w: Workload, device_type: str) -> None:
    """The forward and backward of every micro-batch of `train_step`."""
    micro_batches(model, batch, w, device_type, range(w.grad_accum))


def micro_batches(model, batch: Batch, w: Workload, device_type: str, indices) -> None:
    """The forward and backward of the micro-batches `indices` of `train_step` (0 .. grad_accum - 1;
    the last one reduces the gradients, the others run in no_sync): the profiler times the no_sync
    ones and the last apart (`reduction_timed_apart`)."""
    for index in indices:
        with _sync_context(model, last=index == w.grad_accum - 1):
            if w.loss == "model-dtype":
                _own_loss_step(model, batch, w, device_type)
                continue
            if w.loss == "hf-legacy":
                _legacy_loss_step(model, batch, w, device_type)
                continue
            if w.loss == "chunked":
                _chunked_loss_step(model, batch, w, device_type)
                continue
            with _autocast(w, device_type), _offload(model, w, device_type):
                loss = model(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask,
                             use_cache=False).loss
            (loss / w.grad_accum).backward()
            del loss


def reduction_timed_apart(w: Workload) -> bool:
    """Whether the profiler times `w`'s no_sync micro-batches and its reducing last one apart: a
    training step that accumulates on a model that reduces gradients in its backward and skips it
    under no_sync (DDP on several processes, FSDP; profiler.child builds them so), not DeepSpeed's
    engine. The comparison (profiler.compare) predicts those two times for the same runs."""
    return (w.training and w.grad_accum > 1 and not w.zero
            and (w.fsdp != "none" or w.world_size > 1))


def _own_loss_step(model, batch: Batch, w: Workload, device_type: str) -> None:
    """`--loss model-dtype`: a training loop's own loss, as universal-llm-trainer's models compute it
    (src/univlt/models/llama3.py `forward`): the model runs without labels, and cross_entropy takes
    the shifted logits in the dtype the model returns them (no fp32 upcast); the output is deleted
    before the backward, as its `del_logits_after_forward: True` (every config of the repository) does
    and as the HF Trainer keeps only the loss."""
    import torch.nn.functional as F

    with _autocast(w, device_type), _offload(model, w, device_type):
        output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logits = output.logits
        loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.size(-1)), batch.labels[:, 1:].reshape(-1))
    del logits, output
    (loss / w.grad_accum).backward()
    del loss


def _legacy_loss_step(model, batch: Batch, w: Workload, device_type: str) -> None:
    """`--loss hf-legacy`: transformers' loss before 4.46 in a loop that keeps the output to the
    backward (AnswerDotAI fsdp_qlora train.py `output = model(...)`; `output.loss.backward()`): the
    model's forward (4.37 LlamaForCausalLM) upcast the logits to fp32 (freeing the half ones) and
    returned them; its loss took `logits[..., :-1, :].contiguous()` into cross_entropy. The fp32
    logits stay referenced through the backward."""
    import torch.nn.functional as F

    with _autocast(w, device_type), _offload(model, w, device_type):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits.float()
        shifted = logits[..., :-1, :].contiguous()
        loss = F.cross_entropy(shifted.view(-1, logits.size(-1)), batch.labels[..., 1:].reshape(-1))
        del shifted
    (loss / w.grad_accum).backward()
    del loss, logits


def _chunked_loss_step(model, batch: Batch, w: Workload, device_type: str) -> None:
    """`--loss chunked`: torchtune's CEWithChunkedOutputLoss (torchtune modules/loss, num_output_chunks
    8) as its recipes run it: the decoder's last hidden state split in 8 along the sequence, the
    output projection applied to each chunk (`[model.output(chunk) for chunk in h.chunk(8, dim=1)]`),
    then per chunk `cross_entropy(chunk.float(), labels, reduction="sum")` on labels shifted left
    (no shifted copy of the logits), summed and divided by the labelled tokens; the chunks are
    deleted before the backward."""
    import torch

    from estimator.workload import CHUNKED_LOSS_CHUNKS

    causal = causal_lm(model)
    labels = torch.cat([batch.labels[:, 1:], torch.full_like(batch.labels[:, :1], -100)], dim=1)
    with _autocast(w, device_type), _offload(model, w, device_type):
        hidden = causal.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   use_cache=False).last_hidden_state
        head = causal.get_output_embeddings()
        logits = [head(chunk) for chunk in hidden.chunk(CHUNKED_LOSS_CHUNKS, dim=1)]
        del hidden
        loss = _chunked_cross_entropy(logits, labels)
    del logits
    (loss / w.grad_accum).backward()
    del loss


def causal_lm(model):
    """The CausalLM under peft's wrapper (the model itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _chunked_cross_entropy(logits: list, labels):
    """CEWithChunkedOutputLoss.forward: one chunk upcast at a time (its locals die with the call)."""
    import torch.nn.functional as F

    from estimator.workload import CHUNKED_LOSS_CHUNKS

    total = (labels != -100).sum()
    loss = 0.0
    for chunk, target in zip(logits, labels.chunk(CHUNKED_LOSS_CHUNKS, dim=1)):
        loss = loss + F.cross_entropy(chunk.reshape(-1, chunk.size(-1)).float(), target.reshape(-1),
                                      ignore_index=-100, reduction="sum")
    return loss / total


def _offload(model, w: Workload, device_type: str):
    """Activation offloading around the forward as TRL runs it (profiler.offload): saved tensors to
    host memory, pinned on cuda; under the tracer, fake tensors keep no host bytes."""
    if not w.activation_offload:
        return nullcontext()
    from profiler.offload import offload_activations, step_copy

    return offload_activations(model, device_type, step_copy(pin=device_type == "cuda"))


def _sync_context(model, last: bool):
    """On a micro-batch that is not the last: `model.no_sync()` for a DDP model (forward and backward
    both inside: DDP reads the flag in the forward), and for an FSDP2 model what accelerate's
    `no_sync` does (accelerate 1.15.0 accelerator.py line 1167): `set_requires_gradient_sync(False)`,
    so the unsharded gradients stay until the last micro-batch (the estimator's
    `_fsdp_unsharded_grads`); else nothing."""
    if last:
        return nullcontext()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def prefill(model, batch: Batch, w: Workload, device_type: str):
    """The prompt forward with a fresh KV cache; returns (next token ids, cache). Only the last
    position's logits are computed (`logits_to_keep=1`), as `generate()` does."""
    import torch

    with torch.no_grad(), _autocast(w, device_type):
        out = model(input_ids=batch.input_ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1), out.past_key_values


def decode(model, token, cache, w: Workload, device_type: str, steps: int):
    """`steps` greedy decode steps, one token each, growing `cache`; returns the last token."""
    import torch

    with torch.no_grad(), _autocast(w, device_type):
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            cache = out.past_key_values
    return token


def inference_step(model, batch: Batch, w: Workload, device_type: str) -> None:
    """One request: prefill the prompt, then generate `new_tokens` tokens."""
    token, cache = prefill(model, batch, w, device_type)
    if w.new_tokens > 1:
        decode(model, token, cache, w, device_type, w.new_tokens - 1)
