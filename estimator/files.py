"""Atomic file writes and the UTC timestamp: the one copy every package uses (standard library only).

Atomic: the content goes to a temporary file in the target's folder, is flushed and fsync'ed,
then `os.replace`d over the target, and the folder is fsync'ed so the rename itself survives a
crash. A reader (or a killed sweep) sees the previous complete file or the new complete file,
never half of one; a failed write leaves the target as it was and no temporary file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second: 2026-01-01T12:00:00+00:00."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def utc_stamp() -> str:
    """The current UTC time as a compact, sortable file-name stamp: 20260101T120000Z."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; a platform without directory fds skips it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp_path)` to fill a temporary file next to `path` (a library that writes to a
    path itself: pandas, matplotlib), fsync it, replace `path`, fsync the folder. Returns `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path, text: str) -> Path:
    """Write `text` as UTF-8 atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, data, **dumps) -> Path:
    """Write `data` as JSON atomically (indent 2 and `default=str` unless `dumps` says otherwise),
    with a final newline."""
    options = {"indent": 2, "default": str, **dumps}
    return atomic_write_text(path, json.dumps(data, **options) + "\n")
