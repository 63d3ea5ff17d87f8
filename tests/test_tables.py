"""Schema and sanity tests of the shipped hardware/price/MFU/dtype tables and their loader."""

import csv
import math
import sys
from pathlib import Path

import pytest

# The package is not installed in the venv: make the repo root importable under plain `pytest`.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from estimator import tables  # noqa: E402
from estimator.errors import InputError  # noqa: E402

REQUIRED_SLUGS = [
    "a100-80gb", "a100-80gb-pcie", "a100-40gb", "a100-40gb-pcie", "h100-80gb", "h100-80gb-pcie",
    "h200-141gb", "l4-24gb", "l40s-48gb", "a10g-24gb", "a10-24gb", "rtx4090-24gb", "rtx3090-24gb",
    "v100-16gb", "v100-32gb", "t4-16gb",
]
PRICE_HEADER = "slug,provider,tier,region,multi_node,usd_per_gpu_hour,pricing,source,date\n"


def test_shipped_tables_validate():
    tables.validate_all()


def test_required_slugs_exist():
    missing = [s for s in REQUIRED_SLUGS if s not in tables.gpus()]
    assert not missing


def test_every_row_has_source_and_date():
    for rows in (tables.gpus().values(), tables.interconnects().values(), tables.prices(),
                 tables.unpriced().values()):
        for row in rows:
            assert row.source.strip() and row.date.strip()


def test_dense_not_sparse():
    # NVIDIA H100 datasheet: SXM BF16 1,979 TFLOPS *with sparsity* -> 989 dense.
    assert 900 <= tables.gpu("h100-80gb").dense_tflops("bf16") <= 1000
    # NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity).
    assert tables.gpu("a100-80gb").dense_tflops("bf16") == pytest.approx(312, abs=1)
    # NVIDIA H100 datasheet, PCIe column: BF16 1,513 with sparsity -> 756 dense.
    assert tables.gpu("h100-80gb-pcie").dense_tflops("bf16") == pytest.approx(756, abs=1)
    # NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity -> 121 dense.
    assert tables.gpu("l4-24gb").dense_tflops("bf16") == pytest.approx(121, abs=1)
    # HGX B200 datasheet: BF16 4.5 PFLOPS and TF32 2.2 PFLOPS with sparsity -> 2250 and 1100 dense.
    assert tables.gpu("b200-180gb").dense_tflops("bf16") == pytest.approx(2250, abs=1)
    assert tables.gpu("b200-180gb").tf32_dense_tflops == pytest.approx(1100, abs=1)
    # No dense 16-bit/TF32 peak of the GPUs before Blackwell reaches 1000 TFLOPS; a larger value is
    # a sparse figure.
    for spec in tables.gpus().values():
        if spec.slug.startswith("b200"):
            continue
        for dtype in ("bf16", "fp16", "tf32"):
            value = getattr(spec, f"{dtype}_dense_tflops")
            assert value is None or value < 1000, (spec.slug, dtype, value)


def test_bf16_absent_on_v100_and_t4():
    for slug in ("v100-16gb", "v100-32gb", "t4-16gb"):
        spec = tables.gpu(slug)
        assert spec.bf16_dense_tflops is None
        with pytest.raises(InputError, match="fp16"):
            spec.dense_tflops("bf16")
        assert spec.dense_tflops("fp16") > 0


def test_unknown_dtype_and_gpu():
    with pytest.raises(InputError, match="known:"):
        tables.gpu("b900")
    with pytest.raises(InputError):
        tables.gpu("a100-80gb").dense_tflops("fp64")
    with pytest.raises(InputError):
        tables.interconnect("smoke-signals")
    with pytest.raises(InputError):
        tables.dtype_bytes("fp3")


def test_lookup_is_case_insensitive():
    assert tables.gpu("A100-80GB") is tables.gpu("a100-80gb")


def test_memory_and_units():
    assert tables.gpu("a100-80gb").memory_bytes > tables.gpu("a100-40gb").memory_bytes
    assert tables.gpu("a100-80gb").memory_bytes == 81920 * 2**20
    for spec in tables.gpus().values():
        assert isinstance(spec.memory_bytes, int) and isinstance(spec.memory_bandwidth_bytes_per_s, int)
        assert 8 * 2**30 < spec.memory_bytes < 200 * 2**30
        assert 1e11 < spec.memory_bandwidth_bytes_per_s < 1e13
        assert tables.interconnect(spec.intra_node_interconnect).scope == "intra-node"


def test_interconnect_bandwidths_per_direction():
    # H100 datasheet: NVLink 900 GB/s total bidirectional -> 450e9 per direction.
    assert tables.interconnect("nvlink4").bandwidth_bytes_per_s == 450 * 10**9
    assert tables.interconnect("nvlink3").bandwidth_bytes_per_s == 300 * 10**9
    assert tables.interconnect("ib-ndr").scope == "inter-node"


# GPUs with no public on-demand price (a prices.csv row with an empty price, its source saying what was
# searched): a job on them gets a time and no cost. Adding one here needs that row; pricing one needs it gone.
UNPRICED = {"h20-96gb"}


def test_every_price_positive_and_every_gpu_priced():
    rows = tables.prices()
    assert all(p.usd_per_gpu_hour > 0 for p in rows)
    assert set(tables.unpriced()) == UNPRICED
    for slug in tables.gpus():
        if slug in UNPRICED:
            assert not [r for r in rows if r.slug == slug and r.pricing == "on-demand"]
            with pytest.raises(tables.NoPrice, match=f"no public on-demand price for '{slug}'"):
                tables.price(slug)
            continue
        p = tables.price(slug)
        assert p.pricing == "on-demand" and p.usd_per_gpu_hour > 0
        assert p.usd_per_gpu_hour == min(r.usd_per_gpu_hour for r in rows
                                         if r.slug == slug and r.pricing == "on-demand")


def test_price_by_provider():
    assert tables.price("h100-80gb", provider="AWS").provider == "aws"
    with pytest.raises(InputError, match="provider"):
        tables.price("h100-80gb", provider="nowhere")


def test_user_price_file_overrides(tmp_path):
    f = tmp_path / "my_prices.csv"
    f.write_text(PRICE_HEADER
                 + "a100-80gb,mycloud,cloud,unstated,unstated,0.5,on-demand,my contract,2026-01-02\n"
                 + "a100-80gb,mycloud,cloud,unstated,unstated,0.1,spot,my contract,2026-01-02\n")
    p = tables.price("a100-80gb", path=str(f))
    assert (p.provider, p.usd_per_gpu_hour) == ("mycloud", 0.5)
    assert len(tables.prices(str(f))) == 2
    assert tables.price("a100-80gb").provider != "mycloud"   # shipped table untouched
    with pytest.raises(InputError, match="no on-demand price for 'h100-80gb'"):
        tables.price("h100-80gb", path=str(f))
    # Editing the file is seen on the next call.
    f.write_text(PRICE_HEADER + "a100-80gb,mycloud,cloud,unstated,unstated,0.75,on-demand,my contract v2,2026-02-03\n")
    assert tables.price("a100-80gb", path=str(f)).usd_per_gpu_hour == 0.75


@pytest.mark.parametrize("body, row, column", [
    ("a100-80gb,mycloud,cloud,unstated,unstated,1.0,on-demand,,2026-01-02\n", 2, "source"),
    ("a100-80gb,mycloud,cloud,unstated,unstated,1.0,on-demand,x,2026-01-02\na100-80gb,mycloud,cloud,unstated,unstated,-1,on-demand,x,2026-01-02\n",
     3, "usd_per_gpu_hour"),
    ("a100-80gb,mycloud,cloud,unstated,unstated,abc,on-demand,x,2026-01-02\n", 2, "usd_per_gpu_hour"),
    ("a100-80gb,mycloud,cloud,unstated,unstated,1.0,on-demand,x,02/01/2026\n", 2, "date"),
    ("a100-80gb,mycloud,cloud,unstated,unstated,1.0,hourly,x,2026-01-02\n", 2, "pricing"),
    ("b900,mycloud,cloud,unstated,unstated,1.0,on-demand,x,2026-01-02\n", 2, "slug"),
])
def test_malformed_price_file_names_file_row_column(tmp_path, body, row, column):
    f = tmp_path / "bad.csv"
    f.write_text(PRICE_HEADER + body)
    with pytest.raises(InputError) as err:
        tables.prices(str(f))
    msg = str(err.value)
    assert str(f) in msg and f"row {row}" in msg and f"'{column}'" in msg


def test_bad_header(tmp_path):
    f = tmp_path / "bad_header.csv"
    f.write_text("slug,provider,price,pricing,source,date\na100-80gb,x,1,on-demand,x,2026-01-02\n")
    with pytest.raises(InputError, match=r"bad_header\.csv: row 1: header"):
        tables.price("a100-80gb", path=str(f))


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        tables.prices(str(tmp_path / "nope.csv"))


def _copy_gpus(tmp_path, edit):
    with open(tables.DATA_DIR / "gpus.csv", newline="") as f:
        rows = list(csv.reader(f))
    edit(rows)
    out = tmp_path / "gpus.csv"
    with open(out, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return out


def test_unknown_interconnect_names_row(tmp_path):
    col = tables.GPU_COLUMNS.index("intra_node_interconnect")
    path = _copy_gpus(tmp_path, lambda rows: rows[3].__setitem__(col, "nvlink9"))
    with pytest.raises(InputError, match=r"row 4, column 'intra_node_interconnect'.*nvlink9"):
        tables._load_gpus(path)


@pytest.mark.parametrize("column, value, problem", [
    ("memory_bytes", "80.5", "integer"),
    ("fp32_tflops", "-19.5", "positive"),
    ("slug", "a100-80gb", "duplicate"),
    ("date", "", "empty"),
])
def test_malformed_gpu_rows(tmp_path, column, value, problem):
    col = tables.GPU_COLUMNS.index(column)
    path = _copy_gpus(tmp_path, lambda rows: rows[2].__setitem__(col, value))
    with pytest.raises(InputError, match=rf"row 3, column '{column}'.*{problem}"):
        tables._load_gpus(path)


def test_dtype_bytes():
    assert tables.dtype_bytes("nf4") == 0.5
    assert tables.dtype_bytes("bf16") == 2
    assert tables.dtype_bytes("FP32") == 4
    assert tables.dtype_bytes("int64") == 8


def test_mfu_defaults():
    table = tables._mfu_table()
    assert table and all(0 < m.mfu < 1 for m in table.values() if m.method != "gemm")
    # a GEMM level is a measured matmul rate over the datasheet peak: a GeForce card boosting past its
    # rated clock passes 1 (RTX 3090: 75.48 of 71 TFLOPS)
    assert all(0 < m.mfu <= tables.GEMM_LEVEL_MAX for m in table.values())
    assert table[("gemm", "rtx3090-24gb")].mfu == 1.06
    for method in tables.GEMM_METHODS + ("gemm", "training", "decode-bandwidth"):
        assert 0 < tables.mfu_default(method, "t4-16gb").mfu < 1   # every kind has a '*' row
    # step time: every GEMM method takes the GPU's gemm row (MAMF: H100 SXM 794.5 of 989 TFLOPS)
    for method in tables.GEMM_METHODS:
        row = tables.mfu_default(method, "h100-80gb")
        assert (row.method, row.gpu_slug, row.mfu) == ("gemm", "h100-80gb", 0.803)
    assert tables.mfu_default("full", "t4-16gb").gpu_slug == "*"
    # --chinchilla: the end-to-end MFU of published runs, a different quantity from the GEMM level
    assert tables.mfu_default("training", "h100-80gb").mfu == 0.4
    assert tables.mfu_default("training", "a100-80gb").mfu == 0.55
    with pytest.raises(InputError, match="methods"):
        tables.mfu_default("dpo", "a100-80gb")


def test_a_method_row_overrides_the_gemm_row(tmp_path, monkeypatch):
    f = tmp_path / "mfu.csv"
    f.write_text("method,gpu_slug,mfu,source,date\ngemm,*,0.8,x,2026-01-02\nqlora,*,0.5,y,2026-01-02\n"
                 "gemm,h100-80gb,0.7,z,2026-01-02\n")
    monkeypatch.setattr(tables, "_mfu_table", lambda: tables._load_mfu(f))
    assert tables.mfu_default("lora", "h100-80gb").mfu == 0.7     # the GPU's gemm row before any '*'
    assert tables.mfu_default("qlora", "a100-80gb").mfu == 0.5    # the method's own row before gemm '*'
    assert tables.mfu_default("full", "a100-80gb").mfu == 0.8


def test_mfu_of_one_is_rejected(tmp_path):
    f = tmp_path / "mfu.csv"
    f.write_text("method,gpu_slug,mfu,source,date\nfull,*,1.0,x,2026-01-02\n")
    with pytest.raises(InputError, match=r"row 2, column 'mfu'"):
        tables._load_mfu(f)


def test_a_gemm_level_may_pass_a_rated_peak_a_little(tmp_path):
    # GeForce cards boost past the clock their datasheet peak is computed at: a measured matmul rate
    # may exceed it (RTX 3090: 76 of 71 TFLOPS); far above it is a typo
    f = tmp_path / "mfu.csv"
    f.write_text("method,gpu_slug,mfu,source,date\ngemm,rtx3090-24gb,1.06,x,2026-01-02\n")
    assert tables._load_mfu(f)[("gemm", "rtx3090-24gb")].mfu == 1.06
    f.write_text("method,gpu_slug,mfu,source,date\ngemm,rtx3090-24gb,1.5,x,2026-01-02\n")
    with pytest.raises(InputError, match=r"row 2, column 'mfu': a GEMM level must be in \(0, 1.15\], got 1.5"):
        tables._load_mfu(f)
    for bad in ("0", "-0.2"):
        f.write_text(f"method,gpu_slug,mfu,source,date\ngemm,rtx3090-24gb,{bad},x,2026-01-02\n")
        with pytest.raises(InputError, match=r"row 2, column 'mfu'"):
            tables._load_mfu(f)


def test_numbers_are_finite():
    for spec in tables.gpus().values():
        for field in ("bf16_dense_tflops", "fp16_dense_tflops", "tf32_dense_tflops", "fp32_tflops",
                      "int8_dense_tops"):
            v = getattr(spec, field)
            assert v is None or math.isfinite(v)


# ---- price rows a user can trust (issue 15 item 4) ----------------------------------------------

def _offers(tmp_path):
    f = tmp_path / "offers.csv"
    f.write_text(PRICE_HEADER
                 + "h100-80gb,cheaphost,community,unstated,unstated,1.5,on-demand,a,2026-01-02\n"
                 + "h100-80gb,bigcloud,cloud,us-east-1,yes,6.0,on-demand,b,2026-01-02\n"
                 + "h100-80gb,gpucloud,cloud,unstated,unstated,3.0,on-demand,c,2026-01-02\n"
                 + "h100-80gb,gpucloud,cloud,unstated,unstated,0.9,spot,d,2026-01-02\n")
    return str(f)


def test_price_kind_and_provider_choose_the_row(tmp_path):
    path = _offers(tmp_path)
    assert tables.price("h100-80gb", path).provider == "cheaphost"            # cheapest on-demand
    assert tables.price("h100-80gb", path, tier="cloud").provider == "gpucloud"
    assert tables.price("h100-80gb", path, provider="bigcloud").usd_per_gpu_hour == 6.0
    with pytest.raises(InputError, match="of tier 'secure'"):
        tables.price("h100-80gb", path, tier="secure")


def test_a_multi_node_job_is_priced_on_a_multi_node_offering(tmp_path):
    path = _offers(tmp_path)
    row = tables.price("h100-80gb", path, nodes=2)
    assert (row.provider, row.multi_node) == ("bigcloud", "yes")
    assert row.label() == "bigcloud cloud on-demand, us-east-1 (2026-01-02)"


def test_the_output_names_the_price_row(tmp_path, capsys):
    from tests.scripts_loader import call_main, load_script

    cli = load_script("estimate")
    code, out, err = call_main(cli, capsys, "--model", "llama-3.2-1b", "--samples", "1000", "--gpu", "h100-80gb",
                               "--price-table", _offers(tmp_path), "--price-kind", "cloud")
    assert code == 0, err
    assert "at $3.00/GPU-h (gpucloud cloud on-demand (2026-01-02))" in out


def test_an_empty_price_marks_a_gpu_unpriced_and_nothing_else(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text(PRICE_HEADER + "a100-80gb,none,cloud,unstated,unstated,,on-demand,searched x and y,2026-01-02\n"
                 + "h100-80gb,mycloud,cloud,unstated,unstated,2.0,on-demand,my contract,2026-01-02\n")
    assert [p.slug for p in tables.prices(str(f))] == ["h100-80gb"]          # never a price of 0
    assert tables.unpriced(str(f))["a100-80gb"].source == "searched x and y"
    with pytest.raises(tables.NoPrice, match="no public on-demand price for 'a100-80gb'"):
        tables.price("a100-80gb", str(f))
    f.write_text(PRICE_HEADER + "a100-80gb,none,cloud,unstated,unstated,,spot,x,2026-01-02\n")
    with pytest.raises(InputError, match="only on an on-demand row"):
        tables.prices(str(f))
    f.write_text(PRICE_HEADER + "a100-80gb,none,cloud,unstated,unstated,,on-demand,x,2026-01-02\n"
                 + "a100-80gb,mycloud,cloud,unstated,unstated,2.0,on-demand,y,2026-01-02\n")
    with pytest.raises(InputError, match="has an on-demand price and a row saying it has none"):
        tables.prices(str(f))


def test_a_job_on_an_unpriced_gpu_has_memory_time_and_no_price_never_zero(capsys):
    import json

    from tests.scripts_loader import call_main, load_script

    cli = load_script("estimate")
    argv = ("--model", "qwen3-8b", "--method", "lora", "--gpu", "h20-96gb", "--samples", "1000",
            "--calibration", "none")
    code, out, err = call_main(cli, capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["memory"]["device_used_bytes"] > 0 and data["time"]["step_s"] > 0
    job = data["job"]
    assert job["job_s"] > 0 and job["gpu_hours"] > 0
    assert job["usd_per_gpu_hour"] is None and job["cost_usd"] is None          # not 0, not made up
    assert job["price_row"].startswith("no price")
    code, out, err = call_main(cli, capsys, *argv)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("job "))
    assert "no price (no public on-demand price for h20-96gb" in line and "$" not in line
    code, out, err = call_main(cli, capsys, "--model", "qwen3-8b", "--method", "lora", "--samples", "100000",
                               "--cheapest", "--deadline-hours", "100", "--calibration", "none", "--json")
    assert code == 0, err
    setups = json.loads(out)["setups"]
    priced = [s["cost_usd"] for s in setups if s["cost_usd"] is not None]
    assert priced == sorted(priced) and setups[-1]["gpu"] == "h20-96gb" and setups[-1]["cost_usd"] is None


def test_host_link_of_an_sxm_board_is_its_datasheets_pcie():
    """An SXM board's peer link is NVLink and its host link PCIe (gpus.csv host_interconnect, from
    each datasheet): Gen5 on the H100 and H200, Gen4 on the A100, Gen3 on the V100; a PCIe board's
    host link is its peer link; where the datasheet at hand does not say, PCIe 4.0 x16."""
    from estimator.timing import host_link

    links = {slug: host_link(tables.gpu(slug)).name for slug in
             ("h100-80gb", "h200-141gb", "a100-80gb", "v100-32gb", "h100-80gb-pcie", "t4-16gb", "b200-180gb")}
    assert links == {"h100-80gb": "pcie5-x16", "h200-141gb": "pcie5-x16", "a100-80gb": "pcie4-x16",
                     "v100-32gb": "pcie3-x16", "h100-80gb-pcie": "pcie5-x16", "t4-16gb": "pcie3-x16",
                     "b200-180gb": "pcie4-x16"}


def test_a_host_link_that_is_not_pcie_names_its_row(tmp_path):
    col = tables.GPU_COLUMNS.index("host_interconnect")
    path = _copy_gpus(tmp_path, lambda rows: rows[1].__setitem__(col, "nvlink4"))
    with pytest.raises(InputError, match=r"row 2, column 'host_interconnect'.*not a PCIe link"):
        tables._load_gpus(path)
