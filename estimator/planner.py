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


def _levers(w: Workload) -> list[tuple[str, dict]]:
    """The cheap levers, cheapest first (issue 15): the same effective batch one sample at a time,
    checkpointing, an 8-bit optimizer, LoRA instead of full, QLoRA, ZeRO-3 over the GPUs of a node,
    and offload. Inference: 8-bit then 4-bit weights."""
    out = []
    if w.batch > 1:
        out.append((f"--batch 1 --grad-accum {w.grad_accum * w.batch}", dict(batch=1, grad_accum=w.grad_accum * w.batch)))
    if w.training and not w.grad_ckpt:
        out.append(("--grad-ckpt", dict(grad_ckpt=True)))
    if w.training and w.optimizer in ("adamw", "paged-adamw"):
        out.append(("--optimizer adamw-8bit", dict(optimizer="adamw-8bit")))
    if w.method == "full":
        out.append(("--method lora", dict(method="lora")))
    if w.method in ("full", "lora") and w.quant == "none":
        out.append(("--method qlora", dict(method="qlora", quant="nf4",
                                           precision="bf16" if w.precision.startswith("amp") else w.base_precision)))
    if w.training and w.fsdp == "none" and w.zero < 3 and w.world_size == 1:
        out.append((f"--zero 3 --gpus {GPUS_PER_NODE}", dict(zero=3, gpus=GPUS_PER_NODE)))
    if w.training and w.fsdp == "none" and w.offload == "none":
        out.append(("--zero 3 --offload optimizer+params", dict(zero=3, offload="optimizer+params")))
    if w.method == "inference" and w.quant == "none":
        out += [("--quant int8", dict(quant="int8")), ("--quant nf4", dict(quant="nf4"))]
    return out


def merged_flags(levers: list[str]) -> str:
    """Levers stacked in order as one command line: a flag a later lever sets again takes the later
    value in the earlier place ("--method lora", "--method qlora" -> "--method qlora")."""
    values: dict[str, str] = {}
    for lever in levers:
        tokens = lever.split()
        for i, token in enumerate(tokens):
            if token.startswith("--"):           # a flag, with its value unless it is a switch
                after = tokens[i + 1] if i + 1 < len(tokens) else "--"
                values[token] = "" if after.startswith("--") else after
    return " ".join(f"{name} {value}".strip() for name, value in values.items())


def _cost(base: Estimate, trial: Estimate) -> str:
    """What a lever costs in time, relative to the workload as given."""
    if base.workload.training:
        samples = lambda e: e.workload.batch * e.workload.grad_accum * e.workload.dp   # noqa: E731
        before, after = base.time.step_s / samples(base), trial.time.step_s / samples(trial)
        what = "time per sample"
    else:
        before, after = 1 / base.time.tokens_per_s, 1 / trial.time.tokens_per_s
        what = "time per token"
    change = after / before - 1
    text = f"{what} {change:+.0%}" if abs(change) >= 0.005 else f"{what} unchanged"
    n = trial.workload.world_size
    return text + (f" on {n} GPUs" if n != base.workload.world_size else "")


def advice(result: Estimate, calibration: str = "auto") -> list[str]:
    """When the safe bound does not fit: the levers (tried in order, each alone) that make it fit,
    each with its time cost; when none alone does, the first run of levers stacked in order that
    does; then the levers that fit only the estimate, said to be tight; last, how many GPUs it
    needs as it is."""
    if result.safe_fits:
        return []
    w, slug = result.workload, result.gpu.slug
    out, tight, stacked, applied = [], [], {}, []
    for flag, change in _levers(w):
        try:
            trial = estimate(w.with_(**change), slug, calibration)
        except InputError:
            continue
        if trial.safe_fits:
            out.append(f"{flag} ({_cost(result, trial)})")
        elif trial.verdict == "tight":
            tight.append(f"{flag} (tight: the estimate fits, its safe bound does not; {_cost(result, trial)})")
    if not out:
        for flag, change in _levers(w):           # stacked in order until the bound fits
            try:
                trial = estimate(w.with_(**{**stacked, **change}), slug, calibration)
            except InputError:
                continue
            stacked.update(change)
            applied.append(flag)
            if len(applied) > 1 and trial.safe_fits:
                out.append(merged_flags(applied) + f" ({_cost(result, trial)})")
                break
    out += tight                                 # what fits only the estimate, said as such
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
        except tables.NoPrice:
            price, row = None, "no price (no public on-demand price)"
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
    """Setups (GPU kind x count) that fit and finish the job by the deadline, cheapest first (those on a
    GPU without a public price last, their cost None)."""
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
    # a GPU with no public price cannot be ranked on cost: listed after the priced ones, by time
    return sorted(found, key=lambda e: (e.job.cost_usd is None, e.job.cost_usd or 0.0, e.job.job_s))


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
    mfu = mfu if mfu is not None else tables.mfu_default("training", slug).mfu
    if not 0 < mfu < 1:
        raise InputError("--mfu must be between 0 and 1")
    return Budget(slug, n_gpus, hours, mfu, compute_optimal(budget_flops(slug, n_gpus, hours, mfu)))


def budget_flops(slug: str, n_gpus: int, hours: float, mfu: float, dtype: str = "bf16") -> float:
    """Useful FLOPs of `n_gpus` GPUs of `slug` running `hours` at an achieved fraction `mfu`."""
    if n_gpus <= 0 or hours <= 0:
        raise InputError("GPU count and hours must be positive")
    return tables.gpu(slug).peak_flops(dtype) * mfu * n_gpus * hours * 3600.0
