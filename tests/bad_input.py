"""Shared checks of the bad-input tables (tests/test_bad_input_*.py): a refused command exits 2 with
exactly one line on stderr (the program's name, "error:", the reason), prints nothing on stdout,
shows no traceback, and leaves the file tree byte for byte as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.scripts_loader import call_main


def snapshot(*roots: Path) -> dict[str, str]:
    """path -> sha256 of every file (and '<dir>' for every folder) under `roots`."""
    out = {}
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            out[str(path)] = "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def assert_refused(module, capsys, argv: list[str], words: str, prog: str, *roots: Path) -> str:
    """Run `module.main(argv)` in-process and check the refusal; returns the error line."""
    before = snapshot(*roots)
    code, out, err = call_main(module, capsys, *argv)
    assert code == 2, (argv, code, err)
    assert out == "", (argv, out)
    assert err.count("\n") == 1 and err.endswith("\n"), (argv, err)
    assert err.startswith(f"{prog}: error: "), (argv, err)
    assert "Traceback" not in err, (argv, err)
    assert words.lower() in err.lower(), (argv, words, err)
    assert snapshot(*roots) == before, (argv, "the file tree changed")
    return err
