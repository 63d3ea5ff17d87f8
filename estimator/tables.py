"""Hardware, price, MFU and dtype tables: load the CSVs in estimator/data once, validate, look up.

Units: bytes are int (memory_bytes, bandwidth in bytes/s), throughput in TFLOPS = 1e12 FLOP/s
(dense, never the 2:4-sparse figure), latency in seconds, prices in USD per GPU-hour. Every row
carries `source` and an ISO `date`. Loaders parse once (functools caches), so after the first call
`gpu(slug)` is a dict lookup. Any malformed table raises InputError naming file, row and column.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from estimator.errors import InputError
from estimator.units import TFLOPS

DATA_DIR = Path(__file__).resolve().parent / "data"

GPU_COLUMNS = ("slug", "name", "memory_bytes", "bf16_dense_tflops", "fp16_dense_tflops",
               "tf32_dense_tflops", "fp32_tflops", "int8_dense_tops", "fp8_dense_tflops",
               "memory_bandwidth_bytes_per_s", "intra_node_interconnect", "host_interconnect", "compute_capability",
               "source", "date")
INTERCONNECT_COLUMNS = ("name", "bandwidth_bytes_per_s", "latency_s", "scope", "source", "date")
PRICE_COLUMNS = ("slug", "provider", "tier", "region", "multi_node", "usd_per_gpu_hour", "pricing", "source", "date")
# tier: what kind of offering (RunPod's Community Cloud is third-party hosts; Secure Cloud its data
# centres; serverless per-second workers; cloud: a hyperscaler or GPU cloud's instance);
# multi_node: "yes" where the instance type is documented for multi-node clusters (AWS p4d/p4de/p5/
# p3dn with EFA), else "unstated"
TIERS = ("community", "secure", "serverless", "cloud")
MULTI_NODE = ("yes", "no", "unstated")
MFU_COLUMNS = ("method", "gpu_slug", "mfu", "source", "date")
OP_COUNT_COLUMNS = ("model_type", "method", "grad_ckpt", "phase", "per_layer", "outside", "lora_targets", "counted_on",
                    "source", "date")
OP_COUNT_METHODS = ("full", "lora", "inference", "lora-adapter", "autocast-linear")
OP_COUNT_PHASES = ("forward", "backward", "prefill")
DTYPE_COLUMNS = ("name", "bytes_per_element", "source", "date")

SCOPES = ("intra-node", "inter-node")
PRICINGS = ("on-demand", "spot", "reserved")
GEMM_LEVEL_MAX = 1.15   # the highest measured matmul rate over a datasheet peak we accept (boost clocks)
MFU_METHODS = ("gemm", "training", "full", "lora", "qlora", "inference-prefill", "decode-bandwidth")
# methods whose step time is a roofline of GEMMs and the rest: their GEMMs run at the `gemm` rows
GEMM_METHODS = ("full", "lora", "qlora", "inference-prefill")
_DENSE_FIELDS = {"bf16": "bf16_dense_tflops", "fp16": "fp16_dense_tflops",
                 "tf32": "tf32_dense_tflops", "fp32": "fp32_tflops", "fp8": "fp8_dense_tflops"}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. TFLOPS are dense tensor-core peaks (None: the GPU lacks that tensor mode)."""

    slug: str
    name: str
    memory_bytes: int                 # usable device memory, bytes
    bf16_dense_tflops: float | None
    fp16_dense_tflops: float | None   # fp16 inputs, fp32 accumulate
    tf32_dense_tflops: float | None
    fp32_tflops: float                # non-tensor FP32
    int8_dense_tops: float | None
    memory_bandwidth_bytes_per_s: int
    intra_node_interconnect: str      # a name in interconnects.csv
    source: str
    date: str
    # fp8 (e4m3/e5m2) tensor-core dense peak with fp32 accumulate, what torch._scaled_mm runs
    # (None: no fp8 tensor cores); its datasheet figure is quoted in `source`
    fp8_dense_tflops: float | None = None
    compute_capability: str = ""      # CUDA compute capability "major.minor" (NVIDIA's CUDA GPUs list)
    # the link to host memory, a PCIe name in interconnects.csv, when the peer link is not it (an
    # SXM board's NVLink); "" where the datasheet at hand does not state it (estimator.timing.host_link)
    host_interconnect: str = ""

    @property
    def compute_capability_major(self) -> int:
        return int(self.compute_capability.split(".")[0])

    def dense_tflops(self, dtype: str) -> float:
        """Dense peak in TFLOPS (1e12 FLOP/s) for dtype in bf16, fp16, tf32, fp32, fp8."""
        field = _DENSE_FIELDS.get(dtype)
        if field is None:
            raise InputError(f"unknown compute dtype '{dtype}'; known: {', '.join(_DENSE_FIELDS)}")
        value = getattr(self, field)
        if value is None:
            hint = "; use fp16" if dtype == "bf16" and self.fp16_dense_tflops is not None else ""
            raise InputError(f"{self.name} ({self.slug}) has no {dtype} tensor cores{hint}")
        return value

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for dtype (`dense_tflops` x 1e12): the one conversion every
        step time, MFU and compute budget divides by."""
        return self.dense_tflops(dtype) * TFLOPS


@dataclass(frozen=True)
class Interconnect:
    """A link: per-GPU, per-direction bandwidth in bytes/s and per-message latency in seconds."""

    name: str
    bandwidth_bytes_per_s: int
    latency_s: float
    scope: str                        # "intra-node" or "inter-node"
    source: str
    date: str


@dataclass(frozen=True)
class Price:
    """Price of one GPU for one hour, USD."""

    slug: str
    provider: str
    usd_per_gpu_hour: float
    pricing: str                      # "on-demand", "spot" or "reserved"
    source: str
    date: str
    tier: str = "cloud"               # TIERS
    region: str = "unstated"
    multi_node: str = "unstated"      # MULTI_NODE

    def label(self) -> str:
        """The row a price came from, in words: provider, tier, pricing, region, date."""
        region = "" if self.region == "unstated" else f", {self.region}"
        return f"{self.provider} {self.tier} {self.pricing}{region} ({self.date})"


@dataclass(frozen=True)
class Unpriced:
    """A GPU the price table marks as having no public on-demand price: what was searched, and when."""

    slug: str
    source: str
    date: str


class NoPrice(InputError):
    """The price table marks the GPU as having no public on-demand price (`unpriced`): a job on it
    has a time but no cost."""

    def __init__(self, message: str, row: Unpriced):
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class MfuDefault:
    """Default achieved fraction of dense peak FLOP/s (or of peak bandwidth, for decode-bandwidth)."""

    method: str
    gpu_slug: str                     # a GPU slug or "*" (fallback)
    mfu: float
    source: str
    date: str


# ---------------------------------------------------------------- parsing helpers


class _Row:
    """One data row; its parsers raise InputError naming file, row and column."""

    def __init__(self, path: Path, line: int, values: dict[str, str]):
        self.path, self.line, self.values = path, line, values

    def fail(self, column: str, problem: str) -> InputError:
        return InputError(f"{self.path}: row {self.line}, column '{column}': {problem}")

    def text(self, column: str) -> str:
        value = self.values[column].strip()
        if not value:
            raise self.fail(column, "must not be empty")
        return value

    def number(self, column: str, optional: bool = False) -> float | None:
        raw = self.values[column].strip()
        if not raw and optional:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise self.fail(column, f"'{raw}' is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise self.fail(column, f"must be a positive number, got '{raw}'")
        return value

    def integer(self, column: str) -> int:
        raw = self.values[column].strip()
        try:
            value = int(raw)
        except ValueError:
            raise self.fail(column, f"'{raw}' is not an integer") from None
        if value <= 0:
            raise self.fail(column, f"must be a positive integer, got '{raw}'")
        return value

    def choice(self, column: str, allowed: tuple[str, ...]) -> str:
        value = self.text(column)
        if value not in allowed:
            raise self.fail(column, f"'{value}' is not one of {', '.join(allowed)}")
        return value

    def provenance(self) -> tuple[str, str]:
        source, date = self.text("source"), self.text("date")
        try:
            datetime.date.fromisoformat(date)
        except ValueError:
            raise self.fail("date", f"'{date}' is not an ISO date (YYYY-MM-DD)") from None
        return source, date


def _read(path: Path, columns: tuple[str, ...]) -> list[_Row]:
    """Rows of a CSV whose header must be exactly `columns`; blank lines are skipped."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or tuple(h.strip() for h in header) != columns:
                raise InputError(f"{path}: row 1: header must be exactly "
                                     f"'{','.join(columns)}', got '{','.join(header or [])}'")
            rows = []
            for fields in reader:
                if not any(x.strip() for x in fields):
                    continue
                if len(fields) != len(columns):
                    raise InputError(f"{path}: row {reader.line_num}: expected {len(columns)} "
                                         f"columns, got {len(fields)}")
                rows.append(_Row(path, reader.line_num, dict(zip(columns, fields))))
            return rows
    except OSError as e:
        raise InputError(f"cannot read table {path}: {e.strerror or e}") from None
    except csv.Error as e:
        raise InputError(f"{path}: malformed CSV: {e}") from None


def _lookup(kind: str, key: str, table: dict):
    """The row of `key` (as given, else lower-cased), or InputError listing the known keys."""
    row = table.get(key)
    if row is None:
        row = table.get(key.lower())
    if row is None:
        raise _unknown(kind, key, table)
    return row


def _unknown(kind: str, name: str, known) -> InputError:
    return InputError(f"unknown {kind} '{name}'; known: {', '.join(known)}")


# ---------------------------------------------------------------- loaders


def _load_interconnects(path: Path) -> dict[str, Interconnect]:
    out: dict[str, Interconnect] = {}
    for r in _read(path, INTERCONNECT_COLUMNS):
        name = r.text("name")
        if name in out:
            raise r.fail("name", f"duplicate interconnect '{name}'")
        out[name] = Interconnect(name, r.integer("bandwidth_bytes_per_s"), r.number("latency_s"),
                                 r.choice("scope", SCOPES), *r.provenance())
    return out


def _load_gpus(path: Path) -> dict[str, GpuSpec]:
    links = interconnects()
    out: dict[str, GpuSpec] = {}
    for r in _read(path, GPU_COLUMNS):
        slug = r.text("slug")
        if slug != slug.lower():
            raise r.fail("slug", f"'{slug}' must be lower case")
        if slug in out:
            raise r.fail("slug", f"duplicate slug '{slug}'")
        link = r.text("intra_node_interconnect")
        capability = r.text("compute_capability")
        if not re.fullmatch(r"\d+\.\d+", capability):
            raise r.fail("compute_capability", f"'{capability}' is not major.minor (e.g. 9.0)")
        if link not in links:
            raise r.fail("intra_node_interconnect", f"unknown interconnect '{link}'; known: {', '.join(links)}")
        if links[link].scope != "intra-node":
            raise r.fail("intra_node_interconnect", f"'{link}' is not an intra-node link")
        host = r.values["host_interconnect"].strip()
        if host and (host not in links or not host.startswith("pcie")):
            raise r.fail("host_interconnect", f"'{host}' is not a PCIe link of interconnects.csv "
                                              f"({', '.join(n for n in links if n.startswith('pcie'))})")
        out[slug] = GpuSpec(
            slug, r.text("name"), r.integer("memory_bytes"),
            r.number("bf16_dense_tflops", optional=True), r.number("fp16_dense_tflops", optional=True),
            r.number("tf32_dense_tflops", optional=True), r.number("fp32_tflops"),
            r.number("int8_dense_tops", optional=True), r.integer("memory_bandwidth_bytes_per_s"),
            link, *r.provenance(), fp8_dense_tflops=r.number("fp8_dense_tflops", optional=True),
            compute_capability=capability, host_interconnect=host)
    return out


def _load_prices(path: Path) -> tuple[tuple[Price, ...], dict[str, Unpriced]]:
    """The priced rows, and the GPUs the file marks as having no public on-demand price (a row whose
    `usd_per_gpu_hour` is empty: its source says what was searched; such a GPU has no other on-demand
    row in the file)."""
    known = gpus()
    out, unpriced = [], {}
    for r in _read(path, PRICE_COLUMNS):
        slug = r.text("slug").lower()
        if slug not in known:
            raise r.fail("slug", f"unknown GPU '{slug}'; known: {', '.join(known)}")
        price = r.number("usd_per_gpu_hour", optional=True)
        if price is None:
            if r.choice("pricing", PRICINGS) != "on-demand":
                raise r.fail("usd_per_gpu_hour", "may be empty (no public price) only on an on-demand row")
            unpriced[slug] = Unpriced(slug, *r.provenance())
            continue
        from estimator.limits import limit  # estimator.limits reads its CSV through this module
        if price > limit("usd_per_gpu_hour"):
            raise r.fail("usd_per_gpu_hour", f"{price:g} USD per GPU-hour is beyond sense (limit "
                                              f"{limit('usd_per_gpu_hour'):g}, estimator/data/limits.csv)")
        out.append(Price(slug, r.text("provider"), price, r.choice("pricing", PRICINGS), *r.provenance(),
                         tier=r.choice("tier", TIERS), region=r.text("region"),
                         multi_node=r.choice("multi_node", MULTI_NODE)))
    both = sorted(slug for slug in unpriced if any(p.slug == slug and p.pricing == "on-demand" for p in out))
    if both:
        raise InputError(f"{path}: GPU '{both[0]}' has an on-demand price and a row saying it has none")
    return tuple(out), unpriced


def _load_mfu(path: Path) -> dict[tuple[str, str], MfuDefault]:
    known = gpus()
    out: dict[tuple[str, str], MfuDefault] = {}
    for r in _read(path, MFU_COLUMNS):
        method, slug = r.choice("method", MFU_METHODS), r.text("gpu_slug").lower()
        if slug != "*" and slug not in known:
            raise r.fail("gpu_slug", f"unknown GPU '{slug}' (use a slug or '*')")
        value = r.number("mfu")
        if method == "gemm":
            # a measured matmul rate over the datasheet peak: GeForce cards boost past the rated clock
            # the datasheet computes their peak at (RTX 3090: 1.06); more than that is a typo
            if not 0 < value <= GEMM_LEVEL_MAX:
                raise r.fail("mfu", f"a GEMM level must be in (0, {GEMM_LEVEL_MAX}], got {value}")
        elif not value < 1:
            raise r.fail("mfu", f"must be below 1, got {value}")
        if (method, slug) in out:
            raise r.fail("gpu_slug", f"duplicate row for ({method}, {slug})")
        out[(method, slug)] = MfuDefault(method, slug, value, *r.provenance())
    return out


@dataclass(frozen=True)
class OpCount:
    """Aten operators one micro-batch dispatches (scripts/count_ops.py): `per_layer` per decoder
    layer and `outside` the layers (may be negative: a one-layer model is not exactly a layer plus
    the rest, e.g. LoRA's first layer needs no input gradient). A `*` row is an increment:
    `per_layer` operators per adapted module or per autocast linear (an average: may be fractional)."""

    model_type: str
    method: str
    grad_ckpt: bool
    phase: str
    per_layer: float
    outside: int
    lora_targets: str
    counted_on: str
    source: str
    date: str


def _signed_int(r: _Row, column: str) -> int:
    raw = r.values[column].strip()
    try:
        return int(raw)
    except ValueError:
        raise r.fail(column, f"'{raw}' is not an integer") from None


def _load_op_counts(path: Path) -> dict[tuple[str, str, bool, str], OpCount]:
    out: dict[tuple[str, str, bool, str], OpCount] = {}
    for r in _read(path, OP_COUNT_COLUMNS):
        method, phase = r.choice("method", OP_COUNT_METHODS), r.choice("phase", OP_COUNT_PHASES)
        ckpt = r.choice("grad_ckpt", ("0", "1")) == "1"
        model_type = r.text("model_type")
        if model_type == "*":   # an increment per adapted module or per linear: a positive number
            per_layer = r.number("per_layer")
        else:
            per_layer = _signed_int(r, "per_layer")
            if per_layer <= 0:
                raise r.fail("per_layer", f"must be a positive count, got {per_layer}")
        key = (model_type, method, ckpt, phase)
        if key in out:
            raise r.fail("model_type", f"duplicate row for {key}")
        out[key] = OpCount(model_type, method, ckpt, phase, per_layer, _signed_int(r, "outside"),
                           r.values["lora_targets"].strip(), r.text("counted_on"), *r.provenance())
    return out


@lru_cache(maxsize=None)
def op_counts() -> dict[tuple[str, str, bool, str], OpCount]:
    """(model_type, method, grad_ckpt, phase) -> OpCount of estimator/data/op_counts.csv (cached)."""
    return _load_op_counts(DATA_DIR / "op_counts.csv")


def _load_dtypes(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in _read(path, DTYPE_COLUMNS):
        name = r.text("name").lower()
        if name in out:
            raise r.fail("name", f"duplicate dtype '{name}'")
        value = r.number("bytes_per_element")
        r.provenance()
        out[name] = value
    return out


@lru_cache(maxsize=None)
def interconnects() -> dict[str, Interconnect]:
    """All links of interconnects.csv by name, in file order (cached; do not mutate)."""
    return _load_interconnects(DATA_DIR / "interconnects.csv")


@lru_cache(maxsize=None)
def gpus() -> dict[str, GpuSpec]:
    """All GPUs of gpus.csv by slug, in file order (cached; do not mutate)."""
    return _load_gpus(DATA_DIR / "gpus.csv")


@lru_cache(maxsize=None)
def _mfu_table() -> dict[tuple[str, str], MfuDefault]:
    return _load_mfu(DATA_DIR / "mfu.csv")


@lru_cache(maxsize=None)
def _dtype_table() -> dict[str, float]:
    return _load_dtypes(DATA_DIR / "dtypes.csv")


_PriceFile = tuple[tuple[Price, ...], dict[str, tuple[Price, ...]], dict[str, "Unpriced"]]


@lru_cache(maxsize=64)
def _price_file(path: str, _mtime_ns: int, _size: int) -> _PriceFile:
    """Rows of one price file, its on-demand rows per slug (cheapest first), and the GPUs it marks
    as having no public price."""
    rows, unpriced = _load_prices(Path(path))
    index: dict[str, list[Price]] = {}
    for p in rows:
        if p.pricing == "on-demand":
            index.setdefault(p.slug, []).append(p)
    return rows, {slug: tuple(sorted(ps, key=lambda p: p.usd_per_gpu_hour)) for slug, ps in index.items()}, unpriced


@lru_cache(maxsize=None)
def _shipped_prices() -> _PriceFile:
    file = DATA_DIR / "prices.csv"
    st = os.stat(file)
    return _price_file(str(file), st.st_mtime_ns, st.st_size)


def _prices(path: str | None) -> _PriceFile:
    if path is None:
        return _shipped_prices()
    file = os.path.abspath(path)
    try:
        st = os.stat(file)
    except OSError as e:
        raise InputError(f"cannot read price file {file}: {e.strerror or e}") from None
    return _price_file(file, st.st_mtime_ns, st.st_size)   # re-read when the file changes


# ---------------------------------------------------------------- lookups


def gpu(slug: str) -> GpuSpec:
    """The GPU with this slug (case-insensitive)."""
    return _lookup("GPU", slug, gpus())


def interconnect(name: str) -> Interconnect:
    """The link with this name (case-insensitive)."""
    return _lookup("interconnect", name, interconnects())


def prices(path: str | None = None) -> list[Price]:
    """All price rows: the shipped table, or a user's CSV with the same columns (replaces it)."""
    return list(_prices(path)[0])


def unpriced(path: str | None = None) -> dict[str, Unpriced]:
    """The GPUs a price table marks as having no public on-demand price, by slug."""
    return dict(_prices(path)[2])


def price(slug: str, path: str | None = None, provider: str | None = None, tier: str | None = None,
          nodes: int = 1) -> Price:
    """The cheapest on-demand price row for the GPU, of one provider and/or tier when given. A job
    over several nodes is priced on a row documented for multi-node clusters when one exists (else
    the cheapest, whose label then says multi-node is unstated)."""
    spec = gpu(slug)
    _, index, unknown = _prices(path)
    offers = index.get(spec.slug, ())
    where = "the shipped price table" if path is None else path
    if spec.slug in unknown:
        raise NoPrice(f"no public on-demand price for '{spec.slug}' in {where} (searched {unknown[spec.slug].date}; "
                      f"a price of your own goes in --price-table)", unknown[spec.slug])
    if tier is not None and tier not in TIERS:
        raise InputError(f"price kind must be one of {', '.join(TIERS)}; got {tier!r}")
    chosen = [p for p in offers if (provider is None or p.provider.lower() == provider.lower())
              and (tier is None or p.tier == tier)]
    if not chosen:
        asked = " ".join(x for x in (provider and f"from provider '{provider}'", tier and f"of tier '{tier}'") if x)
        have = sorted({f"{p.provider} ({p.tier})" for p in offers}) or ["none"]
        if not offers:
            raise InputError(f"no on-demand price for '{spec.slug}' in {where}; add a row "
                             f"'{spec.slug},<provider>,<tier>,<region>,<multi_node>,<usd_per_gpu_hour>,on-demand,"
                             f"<source>,<date>'")
        raise InputError(f"no on-demand price for '{spec.slug}' {asked} in {where}; offers: {', '.join(have)}")
    if nodes > 1:
        clusters = [p for p in chosen if p.multi_node == "yes"]
        chosen = clusters or [p for p in chosen if p.multi_node != "no"] or chosen
    return chosen[0]


def mfu_default(method: str, gpu_slug: str) -> MfuDefault:
    """Default achieved fraction for (method, GPU) from estimator/data/mfu.csv.

    Three kinds of row (issue 11, one convention):
    - `gemm`: the fraction of dense peak the GEMMs reach (HFU on GEMM FLOPs), what the step-time
      roofline (estimator.compute_time) divides GEMM FLOPs by; full training, LoRA, QLoRA and prefill
      run the same GEMMs (their adapters, dequantization, attention and elementwise work are charged
      separately), so a method without a row of its own takes the `gemm` row;
    - `training`: end-to-end MFU (model FLOPs / (step x peak)) of published training runs, which
      already includes everything besides the GEMMs: the `--chinchilla` budget only;
    - `decode-bandwidth`: the fraction of peak memory bandwidth decode reaches.
    Lookup: (method, GPU), then (gemm, GPU) for a GEMM method, then (method, *), then (gemm, *)."""
    table = _mfu_table()
    slug = gpu_slug.lower()
    gemm = method in GEMM_METHODS
    row = (table.get((method, slug)) or (gemm and table.get(("gemm", slug)))
           or table.get((method, "*")) or (gemm and table.get(("gemm", "*"))) or None)
    if row is None:
        methods = sorted({m for m, _ in table} | set(GEMM_METHODS))
        raise InputError(f"no default MFU for method '{method}' on '{gpu_slug}'; "
                             f"methods: {', '.join(methods)}")
    return row


def dtype_bytes(name: str) -> float:
    """Bytes per element of a storage dtype (may be fractional: nf4 = 0.5)."""
    return _lookup("dtype", name, _dtype_table())


def validate_all() -> None:
    """Load every shipped table (full schema checks) and check cross-table rules."""
    known = gpus()
    _, priced, unknown = _prices(None)
    for slug in known:
        if slug not in priced and slug not in unknown:
            raise InputError(f"{DATA_DIR / 'prices.csv'}: no on-demand price row for GPU '{slug}' of gpus.csv "
                             f"(nor a row with an empty price saying none is public)")
    _mfu_table()
    op_counts()
    _dtype_table()
