"""`profile.py import FILE` (issue 12 item 1): measurements from anywhere in the profiler's row schema,
with their provenance; a malformed file is refused in one line and nothing is stored."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.bad_input import assert_refused
from tests.scripts_loader import call_main, load_script

from profiler import record

CLI = load_script("profile")
HEADER = "model,gpu_slug,metric,value,unit,source,locator,method,batch,seq,grad_ckpt,stated\n"
GOOD = ("llama-3.1-8b,a100-80gb,reserved,22.5,GiB,ms-swift,github.com/modelscope/ms-swift@d2b45ec8:"
        "Benchmark.md#L40,lora,2,2048,true,\"method,batch,seq\"\n")
OOM = "llama-3.1-8b,a100-80gb,oom,,,ms-swift,github.com/modelscope/ms-swift@d2b45ec8:x#L41,full,8,4096,,\n"


def _stored(folder: Path) -> list[dict]:
    with open(folder, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_are_stored_with_their_provenance_and_bytes(tmp_path, capsys):
    src = tmp_path / "swift.csv"
    src.write_text(HEADER + GOOD + OOM)
    code, out, err = call_main(CLI, capsys, "import", str(src), "--into", str(tmp_path / "m"))
    assert code == 0, err
    rows = _stored(tmp_path / "m" / "ms-swift" / "swift.csv")
    assert list(rows[0]) == record.COLUMN_NAMES                       # the profiler's own schema
    first, oom = rows
    assert int(first["peak_reserved_bytes"]) == round(22.5 * 2**30)   # GiB = 2^30 B
    assert first["conversion"] == f"22.5 GiB x {2**30} = {round(22.5 * 2**30)} B"
    assert (first["backend"], first["status"], first["metric"]) == ("published", "ok", "reserved")
    assert first["stated"] == "method,batch,seq" and first["grad_ckpt"] == "True"
    assert first["peak_allocated_bytes"] == "" and first["device_used_bytes"] == ""   # not measured
    assert (oom["status"], oom["metric"], oom["stated"]) == ("oom", "oom", "method,batch,seq")
    assert first["id"] == record.workload_from_row(first).id


def test_json_input_and_decimal_units(tmp_path, capsys):
    src = tmp_path / "card.json"
    src.write_text(json.dumps([{"model": "llama-3.2-1b", "gpu_slug": "h100-80gb", "metric": "device", "value": 9.5,
                                "unit": "GB", "source": "my-job", "locator": "run 42", "method": "full",
                                "torch": "2.13.0"}]))
    code, out, err = call_main(CLI, capsys, "import", str(src), "--into", str(tmp_path / "m"))
    assert code == 0, err
    (row,) = _stored(tmp_path / "m" / "my-job" / "card.csv")
    assert int(row["device_used_bytes"]) == 9_500_000_000 and row["torch"] == "2.13.0"


def test_malformed_rows_are_refused_and_nothing_is_stored(tmp_path, capsys):
    bad = {
        "unit.csv": (HEADER + GOOD.replace(",GiB,", ",gigs,"), "unit 'gigs'"),
        "metric.csv": (HEADER + GOOD.replace(",reserved,", ",peak,"), "metric 'peak'"),
        "value.csv": (HEADER + GOOD.replace(",22.5,", ",lots,"), "value 'lots'"),
        "negative.csv": (HEADER + GOOD.replace(",22.5,", ",-3,"), "positive memory size"),
        "gpu.csv": (HEADER + GOOD.replace("a100-80gb", "b900"), "unknown GPU"),
        "model.csv": (HEADER + GOOD.replace("llama-3.1-8b", "no-such-model-xyz"), "unknown model"),
        "workload.csv": (HEADER + GOOD.replace(",2,2048,", ",0,2048,"), "batch must be between"),
        "source.csv": (HEADER + GOOD.replace(",ms-swift,", ",../escape,"), "short name"),
        "missing.csv": (HEADER + GOOD.replace("github.com/modelscope/ms-swift@d2b45ec8:Benchmark.md#L40", ""),
                        "missing locator"),
        "column.csv": (HEADER.replace("stated", "whatever") + GOOD, "unknown columns whatever"),
        "stated.csv": (HEADER + GOOD.replace('"method,batch,seq"', "colour"), "stated names colour"),
        "second.csv": (HEADER + GOOD + GOOD.replace(",reserved,", ",bogus,"), "second.csv row 2"),
        "use.csv": (HEADER.replace("stated", "stated,use") + GOOD.replace("\n", ",maybe\n"), "must be 'fit' or 'skip"),
        "bareskip.csv": (HEADER.replace("stated", "stated,use") + GOOD.replace("\n", ",skip:\n"), "must be 'fit'"),
        "allskip.csv": (HEADER.replace("stated", "stated,use") + GOOD.replace("\n", ",skip: not expressible\n"),
                        "every row is marked"),
        "badskip.csv": (HEADER.replace("stated", "stated,use") + GOOD.replace("\n", ",\n")
                        + GOOD.replace(",22.5,", ",-1,").replace("\n", ",skip: x\n"), "badskip.csv row 2"),
        "window.csv": (HEADER.replace("stated", "stated,window") + GOOD.replace("\n", ",prefill\n"), "window 'prefill'"),
        "trainwindow.csv": (HEADER.replace("stated", "stated,window") + GOOD.replace("\n", ",decode\n"),
                            "window 'decode' is an inference peak"),
        "empty.csv": (HEADER, "holds no measurements"),
        "latin1.json": (None, "not UTF-8"),
        "object.json": ('{"model": "x"}', "JSON list of objects"),
    }
    for name, (text, _) in bad.items():
        if text is None:
            (tmp_path / name).write_bytes('[{"model": "caf\u00e9"}]'.encode("latin-1"))
        else:
            (tmp_path / name).write_text(text)
    (tmp_path / "m").mkdir()
    for name, (_, words) in bad.items():
        assert_refused(CLI, capsys, ["import", str(tmp_path / name), "--into", str(tmp_path / "m")], words,
                       "profile.py import", tmp_path)
    assert list((tmp_path / "m").iterdir()) == []


def test_an_earlier_import_is_kept_unless_forced(tmp_path, capsys):
    src = tmp_path / "swift.csv"
    src.write_text(HEADER + GOOD)
    into = ["--into", str(tmp_path / "m")]
    assert call_main(CLI, capsys, "import", str(src), *into)[0] == 0
    assert_refused(CLI, capsys, ["import", str(src), *into], "already imported", "profile.py import", tmp_path)
    src.write_text(HEADER + GOOD.replace(",22.5,", ",23.5,"))
    assert call_main(CLI, capsys, "import", str(src), *into, "--force")[0] == 0
    (row,) = _stored(tmp_path / "m" / "ms-swift" / "swift.csv")
    assert row["value_as_printed"] == "23.5"


def test_fitting_reads_a_folder_with_published_rows(tmp_path, capsys):
    from fitting.data import load

    src = tmp_path / "swift.csv"
    src.write_text(HEADER + GOOD)
    assert call_main(CLI, capsys, "import", str(src), "--into", str(tmp_path / "m"))[0] == 0
    data = load([tmp_path / "m" / "ms-swift" / "swift.csv"], "a100-80gb")
    assert any("published row" in reason for reason in data.skipped)


def test_rows_marked_skip_are_checked_kept_in_the_file_and_not_stored(tmp_path, capsys):
    src = tmp_path / "ladder.csv"
    src.write_text(HEADER.replace("stated", "stated,use") + GOOD.replace("\n", ",fit\n")
                   + GOOD.replace(",22.5,", ",30,").replace("\n", ",skip: the mask is not expressible\n")
                   + OOM.replace("\n", ",\n"))
    code, out, err = call_main(CLI, capsys, "import", str(src), "--into", str(tmp_path / "m"))
    assert code == 0, err
    rows = _stored(tmp_path / "m" / "ms-swift" / "ladder.csv")
    assert [r["metric"] for r in rows] == ["reserved", "oom"] and rows[0]["value_as_printed"] == "22.5"
    assert "left out 1 row marked skip: the mask is not expressible" in out


def test_a_peak_over_the_decode_alone_keeps_its_window(tmp_path, capsys):
    src = tmp_path / "qwen.csv"
    src.write_text("model,gpu_slug,metric,window,value,unit,source,locator,method,seq,new_tokens\n"
                   "qwen3-1.7b,h20-96gb,allocated,decode,6902,MiB,qwen,doc line 268,inference,30720,2048\n"
                   "qwen3-1.7b,h20-96gb,allocated,,6902,MiB,qwen,doc line 269,inference,30720,2048\n")
    code, out, err = call_main(CLI, capsys, "import", str(src), "--into", str(tmp_path / "m"))
    assert code == 0, err
    decode, whole = _stored(tmp_path / "m" / "qwen" / "qwen.csv")
    assert (decode["window"], whole["window"]) == ("decode", "")
    assert int(decode["peak_allocated_bytes"]) == 6902 * 2**20
