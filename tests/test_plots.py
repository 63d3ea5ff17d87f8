"""--plot (issue 15 item 5): the --fit-gpus bars and the --max-batch/--max-seq curves are written as
valid PNG files of the stated size; a bad target is one line, exit 2, nothing written."""

from __future__ import annotations

import struct

import pytest

from tests.bad_input import assert_refused
from tests.scripts_loader import call_main, load_script

from estimator.plots import DPI, HEIGHT_IN, WIDTH_IN

CLI = load_script("estimate")


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("ask", [["--fit-gpus"], ["--max-batch", "--gpu", "a100-80gb"],
                                 ["--max-seq", "--gpu", "a10g-24gb"]])
def test_plots_are_pngs_of_the_stated_size(tmp_path, capsys, ask):
    out = tmp_path / "answer.png"
    code, text, err = call_main(CLI, capsys, "--model", "llama-3.1-8b", "--method", "lora", *ask,
                                "--calibration", "none", "--plot", str(out))
    assert code == 0, err
    assert f"plot: {out}" in text
    assert _png_size(out) == (int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))
    assert out.stat().st_size > 10_000                  # drawn, not blank
    assert [p.name for p in tmp_path.iterdir()] == ["answer.png"]   # no temporary left


def test_bad_plot_targets_are_refused(tmp_path, capsys):
    m = ["--model", "llama-3.1-8b", "--method", "lora"]
    assert_refused(CLI, capsys, m + ["--fit-gpus", "--plot", str(tmp_path / "a.jpg")], "ending in .png",
                   "estimate.py", tmp_path)
    assert_refused(CLI, capsys, m + ["--fit-gpus", "--plot", str(tmp_path / "no" / "a.png")], "does not exist",
                   "estimate.py", tmp_path)
    assert_refused(CLI, capsys, m + ["--plot", str(tmp_path / "a.png")], "--plot draws the answer",
                   "estimate.py", tmp_path)


def test_written_files_get_ordinary_permissions(tmp_path):
    import os

    from estimator.files import atomic_write_text

    umask = os.umask(0o022)
    try:
        new = atomic_write_text(tmp_path / "new.txt", "x")
        assert new.stat().st_mode & 0o777 == 0o644           # not mkstemp's 0600
        kept = tmp_path / "kept.txt"
        kept.write_text("old")
        kept.chmod(0o600)
        atomic_write_text(kept, "new")
        assert kept.stat().st_mode & 0o777 == 0o600           # an existing file keeps its mode
    finally:
        os.umask(umask)
