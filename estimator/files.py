"""Atomic file writes, reading JSON the user gave us, and the UTC timestamp: the one copy every
package uses (standard library only).

`parse_json(raw, shown)` is how every JSON file a user hands us is read (configs, calibration
tables, sweep and run files): strict UTF-8, no NaN/Infinity literals, no integer longer than 400
digits, nesting at most 64 deep; anything else is one InputError line naming the file.

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


MAX_JSON_DEPTH = 64          # real configs and tables nest 4-6 deep
MAX_JSON_INT_DIGITS = 400


def _constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _depth(value, limit: int) -> int:
    """Nesting depth of a parsed value, iteratively (stops counting past `limit`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(raw: bytes | str, shown: str, what: str = "file"):
    """The JSON value of `raw` (bytes are decoded as strict UTF-8), or InputError: "malformed
    <what> <shown>: <reason>". Never raises anything else."""
    from estimator.errors import InputError

    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise InputError(f"malformed {what} {shown}: not UTF-8 text (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_constant, parse_int=_int)
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed {what} {shown}: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise InputError(f"malformed {what} {shown}: nested more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as exc:
        raise InputError(f"malformed {what} {shown}: {exc}") from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InputError(f"malformed {what} {shown}: nested more than {MAX_JSON_DEPTH} deep")
    return value


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


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


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
        os.chmod(tmp, _mode_for(path))          # mkstemp makes 0600: keep the target's, else the umask's
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
