"""Answers built on `estimate()`: which GPUs fit and how many, the largest batch or sequence that
fits, the cheapest setup that meets a deadline, the changes that would make a workload fit, and
the compute-optimal model size for a budget. Each returns a result object; estimator/report.py
renders them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator import tables
from estimator.api import Estimate, JobSpec, estimate
from estimator.errors import InputError
from estimator.workload import Workload

GPUS_PER_NODE = 8
_MAX_GPUS = 1024


def _spread(w: Workload, n: int) -> Workload:
    """`w` on `n` GPUs: data parallel for training, tensor parallel for inference."""
    gpus, nodes = min(n, GPUS_PER_NODE), math.ceil(n / GPUS_PER_NODE)
    if w.training:
        return w.with_(gpus=gpus, nodes=nodes, tp=1, pp=1)
    return w.with_(gpus=gpus, nodes=nodes, tp=n, pp=1)


def _counts():
    n = 1
    while n <= _MAX_GPUS:
        yield n
        n *= 2


def gpus_needed(w: Workload, slug: str, calibration: str = "auto") -> Estimate | None:
    """The smallest power-of-two GPU count on which `w` fits, or None.

    Training spreads over data parallel with the workload's ZeRO stage (ZeRO 0 replicates
    everything, so more GPUs never help); inference spreads over tensor parallel while the
    kv heads allow it.
    """
    for n in _counts():
        try:
            candidate = _spread(w, n)
        except InputError:
            return None  # tensor parallel no longer divides the heads
        result = estimate(candidate, slug, calibration)
        if result.safe_fits:
            return result
        if w.training and w.zero == 0 and w.offload == "none":
            return None
    return None


PLANNED_ON = ("the safe bound of device used memory (the estimate x its bound factor: the calibration's "
              "held-out coverage, or the uncalibrated default; estimator/bounds.py)")


@dataclass(frozen=True)
class FitRow:
    gpu: str
    gpus_needed: int | None
    device_used_bytes: int | None
    memory_bytes: int
    step_s: float | None
    usd_per_gpu_hour: float | None
    safe_device_used_bytes: int | None = None
    price_row: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def advice(result: Estimate, calibration: str = "auto") -> list[str]:
    """Changes that would make a workload's safe bound fit (tried one at a time), as command-line
    flags, when it does not; last, how many GPUs it needs."""
    if result.safe_fits:
        return []
    w, slug = result.workload, result.gpu.slug
    tries = []
    if w.training and not w.grad_ckpt:
        tries.append(("--grad-ckpt", dict(grad_ckpt=True)))
    if w.batch > 1:
        tries.append((f"--batch {max(1, w.batch // 2)} --grad-accum {w.grad_accum * 2}",
                      dict(batch=max(1, w.batch // 2), grad_accum=w.grad_accum * 2)))
    if w.batch > 2:   # the same samples per step, one at a time
        tries.append((f"--batch 1 --grad-accum {w.grad_accum * w.batch}",
                      dict(batch=1, grad_accum=w.grad_accum * w.batch)))
    if w.training and w.batch > 1 and not w.grad_ckpt:
        tries.append((f"--grad-ckpt --batch 1 --grad-accum {w.grad_accum * w.batch}",
                      dict(grad_ckpt=True, batch=1, grad_accum=w.grad_accum * w.batch)))
    if w.method == "full":
        tries.append(("--method lora", dict(method="lora")))
        tries.append(("--method qlora", dict(method="qlora", quant="nf4", precision="bf16")))
        if w.optimizer == "adamw":
            tries.append(("--optimizer adamw-8bit", dict(optimizer="adamw-8bit")))
    if w.method == "lora":
        tries.append(("--method qlora", dict(method="qlora", quant="nf4")))
    if w.method == "inference" and w.quant == "none":
        tries.append(("--quant nf4", dict(quant="nf4")))
    out, tight = [], []
    for flag, change in tries:
        if flag.startswith("--batch") and any(o.startswith("--batch") for o in out):
            continue                      # halving the batch already fits: batch 1 is not news
        try:
            trial = estimate(w.with_(**change), slug, calibration)
        except InputError:
            continue
        if trial.safe_fits:
            out.append(flag)
        elif trial.verdict == "tight":
            tight.append(f"{flag} (tight: fits, its safe bound does not)")
    if not out:
        out += tight
    need = gpus_needed(w, slug, calibration)
    if need is not None:
        out.append(f"{need.workload.world_size} x {slug}"
                   + (f" (--gpus {need.workload.gpus} --nodes {need.workload.nodes})" if w.training else ""))
    return out


def fit_table(w: Workload, calibration: str = "auto", price_path: str | None = None,
              provider: str | None = None, price_kind: str | None = None) -> list[FitRow]:
    """For every GPU of the table: how many are needed for `w`, at what memory and speed, and the
    price row used (the cheapest of the provider / tier asked for; none when it has no such row)."""
    rows = []
    for slug, gpu in tables.gpus().items():
        try:
            result = gpus_needed(w, slug, calibration)
        except InputError:
            result = None  # e.g. bf16 on a GPU without bf16
        try:
            offer = tables.price(slug, price_path, provider, price_kind,
                                 result.workload.nodes if result is not None else 1)
            price, row = offer.usd_per_gpu_hour, offer.label()
        except InputError:
            price, row = None, "no such price row"
        if result is None:
            rows.append(FitRow(slug, None, None, gpu.memory_bytes, None, price, None, row))
        else:
            rows.append(FitRow(slug, result.workload.world_size, result.memory.device_used_bytes,
                               gpu.memory_bytes, result.time.step_s, price, result.safe["device_used_bytes"], row))
    return rows


def _largest(fits, low: int, high: int) -> int:
    """Largest x in [low, high] with fits(x), assuming monotone; 0 if none. Doubling then bisection."""
    if not fits(low):
        return 0
    good, bad = low, None
    while bad is None:
        trial = good * 2
        if trial > high:
            if fits(high):
                return high
            bad = high
        elif fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def max_batch(w: Workload, slug: str, calibration: str = "auto", limit: int = 1 << 16) -> int:
    """Largest micro-batch of `w` that fits one GPU of `slug` (0 if even 1 does not)."""
    return _largest(lambda b: estimate(w.with_(batch=b), slug, calibration).safe_fits, 1, limit)


def max_seq(w: Workload, slug: str, calibration: str = "auto", limit: int = 1 << 21) -> int:
    """Longest sequence (prompt for inference) of `w` that fits one GPU of `slug`."""
    return _largest(lambda s: estimate(w.with_(seq=s), slug, calibration).safe_fits, 1, limit)


def cheapest(w: Workload, job: JobSpec, deadline_s: float, calibration: str = "auto") -> list[Estimate]:
    """Setups (GPU kind x count) that fit and finish the job by the deadline, cheapest first."""
    found = []
    for slug in tables.gpus():
        for n in _counts():
            if n > 64:
                break
            try:
                result = estimate(_spread(w, n), slug, calibration, job)
            except InputError:
                break
            if result.safe_fits and result.job.job_s <= deadline_s:
                found.append(result)
                break  # more of the same GPU only costs more per unit of work or the same
    return sorted(found, key=lambda e: e.job.cost_usd)


# Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models": approaches 1 and 2 give
# about 20 training tokens per parameter (Table 3: 70B params <-> 1.4T tokens for Chinchilla);
# approach 3 fits L(N, D) = E + A / N^alpha + B / D^beta with the constants of their equation 10.
CHINCHILLA_TOKENS_PER_PARAM = 20.0
CHINCHILLA_FIT = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
CHINCHILLA_SOURCE = "Hoffmann et al. 2022, Training Compute-Optimal Large Language Models (arXiv:2203.15556)"


@dataclass(frozen=True)
class ComputeOptimal:
    flops: float
    params: float
    tokens: float
    params_parametric: float
    tokens_parametric: float
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def compute_optimal(flops: float) -> ComputeOptimal:
    """Compute-optimal parameters and tokens for a budget of `flops` (C = 6 N D)."""
    if not flops > 0:
        raise InputError("the compute budget must be positive")
    params = math.sqrt(flops / (6.0 * CHINCHILLA_TOKENS_PER_PARAM))
    f = CHINCHILLA_FIT
    g = (f["alpha"] * f["A"] / (f["beta"] * f["B"])) ** (1.0 / (f["alpha"] + f["beta"]))
    a = f["beta"] / (f["alpha"] + f["beta"])
    b = f["alpha"] / (f["alpha"] + f["beta"])
    n3 = g * (flops / 6.0) ** a
    d3 = (flops / 6.0) ** b / g
    return ComputeOptimal(flops, params, params * CHINCHILLA_TOKENS_PER_PARAM, n3, d3, CHINCHILLA_SOURCE)


@dataclass(frozen=True)
class Budget:
    """A compute budget (GPUs x hours at an achieved MFU) and its compute-optimal model."""

    gpu: str
    gpus: int
    hours: float
    mfu: float
    optimal: ComputeOptimal

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "gpus": self.gpus, "hours": self.hours, "mfu": self.mfu,
                **self.optimal.to_dict()}


def chinchilla(slug: str, n_gpus: int, hours: float | None, mfu: float | None = None) -> Budget:
    """The compute-optimal model for `n_gpus` GPUs of `slug` over `hours` (MFU: the table's for a
    full fine-tune unless given)."""
    if hours is None:
        raise InputError("--chinchilla needs --hours (wall-clock budget) with --gpu and --gpus")
    mfu = mfu if mfu is not None else tables.mfu_default("full", slug).mfu
    if not 0 < mfu < 1:
        raise InputError("--mfu must be between 0 and 1")
    return Budget(slug, n_gpus, hours, mfu, compute_optimal(budget_flops(slug, n_gpus, hours, mfu)))


def budget_flops(slug: str, n_gpus: int, hours: float, mfu: float, dtype: str = "bf16") -> float:
    """Useful FLOPs of `n_gpus` GPUs of `slug` running `hours` at an achieved fraction `mfu`."""
    if n_gpus <= 0 or hours <= 0:
        raise InputError("GPU count and hours must be positive")
    return tables.gpu(slug).peak_flops(dtype) * mfu * n_gpus * hours * 3600.0
