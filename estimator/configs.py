"""Find a model's config: a local path, a name in the shipped catalog, or a Hugging Face Hub id.

Resolution order: an existing file (or a folder holding config.json), then the catalog (hub id
or alias, case-insensitive), then the Hub through transformers' AutoConfig (imported lazily, so
the estimator itself never imports torch or transformers).
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from estimator.errors import InputError
from estimator.files import parse_json
from estimator.model import ModelSpec, spec_from_config

CATALOG_DIR = Path(__file__).with_name("catalog")


@lru_cache(maxsize=1)
def catalog() -> dict[str, dict]:
    """Lower-case hub id or alias -> index row (hub_id, file, aliases, source, date)."""
    index = {}
    with (CATALOG_DIR / "index.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            index[row["hub_id"].lower()] = row
            for alias in filter(None, row["aliases"].split(";")):
                index[alias.strip().lower()] = row
    return index


def catalog_ids() -> list[str]:
    """Hub ids of every catalog model, in file order."""
    seen = []
    for row in catalog().values():
        if row["hub_id"] not in seen:
            seen.append(row["hub_id"])
    return seen


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read config {path}: {exc.strerror}") from None


def _parse_json(raw: bytes, shown: str) -> dict:
    cfg = parse_json(raw, shown, "config")
    if not isinstance(cfg, dict):
        raise InputError(f"malformed config {shown}: not a JSON object")
    return cfg


def _read_json(path: Path) -> dict:
    return _parse_json(_read_bytes(path), str(path))


def _quiet_hub_logging() -> None:
    """The hub client logs retries and warnings on stderr; the user gets our one line instead."""
    import logging

    for name in ("huggingface_hub", "transformers", "urllib3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        from transformers.utils import logging as tf_logging
        tf_logging.set_verbosity_error()
    except ImportError:
        pass


HUB_PROBE_S = 1.5     # how long to wait for a TCP connection to the Hub before calling it offline
HUB_PATIENCE_S = 3.0  # after this, a lookup still running says what it waits for


def _hub_reachable(timeout_s: float = HUB_PROBE_S) -> bool:
    """Whether a TCP connection to the Hub (HF_ENDPOINT, default huggingface.co:443) opens within
    `timeout_s`. Name resolution has no timeout of its own, so the probe runs in a daemon thread."""
    import os
    import socket
    import threading
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    result = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def _from_cache(model_id: str) -> dict:
    """The config.json of `model_id` in the local Hugging Face cache (no network), or InputError."""
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(model_id, "config.json")
    except ImportError:
        cached = None
    except Exception as exc:  # an invalid repo id, a broken cache folder: one line either way
        raise InputError(f"cannot look up '{model_id}' in the Hugging Face cache: {exc}") from None
    if not isinstance(cached, str):
        raise InputError(f"cannot load config of '{model_id}': the Hugging Face Hub is unreachable (offline) "
                         f"and the id is not in the local cache nor the catalog; pass its config.json as a path")
    return _read_json(Path(cached))


def _from_hub(model_id: str) -> dict:
    """AutoConfig from the Hub, or the local cache when the Hub is unreachable (checked in at most
    HUB_PROBE_S); every failure becomes one clear line; a slow answer says what it waits for."""
    if not _hub_reachable():
        return _from_cache(model_id)
    try:
        from transformers import AutoConfig  # lazy: only hub ids pay for it
    except ImportError:
        raise InputError(f"unknown model '{model_id}': not a file, not in the catalog, and "
                             "transformers is not installed to ask the Hub") from None
    _quiet_hub_logging()
    try:
        cfg = _waiting(lambda: AutoConfig.from_pretrained(model_id, trust_remote_code=False),
                       f"waiting for the Hugging Face Hub to answer for '{model_id}' (Ctrl-C stops)")
    except ValueError as exc:
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise InputError(f"'{model_id}' needs remote code, which is not run; pass its "
                                 "config.json as a path instead") from None
        raise InputError(f"cannot load config of '{model_id}': {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = "gated, misspelled, or the Hub is unreachable (offline)"
        raise InputError(f"cannot load config of '{model_id}' ({hint}): {first}") from None
    except Exception as exc:  # network stacks raise many types; the user needs one line
        raise InputError(f"cannot load config of '{model_id}': {type(exc).__name__}: {exc}") from None
    return cfg.to_dict()


def _waiting(call, message: str):
    """call(), printing `message` on stderr once if it takes longer than HUB_PATIENCE_S."""
    from estimator.progress import after

    with after(HUB_PATIENCE_S, message):
        return call()


def _source(model: str) -> tuple[Path | None, str]:
    """(config file, display name) of a path or catalog name; (None, hub id) for a hub id."""
    if not model or not model.strip():
        raise InputError("--model is empty")
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path, path.parent.name if path.name == "config.json" else path.stem
    row = catalog().get(model.lower())
    if row is not None:
        return CATALOG_DIR / row["file"], row["hub_id"]
    if model.endswith(".json") or model.startswith((".", "/")):
        raise InputError(f"config file not found: {model}")
    if "/" not in model:
        raise InputError(f"unknown model '{model}': not a file and not in the catalog "
                             "(try a catalog alias such as llama-3.1-8b, or a Hub id org/name)")
    return None, model


def load_config(model: str) -> tuple[dict, str]:
    """(config dict, display name) for a path, catalog name or hub id."""
    path, name = _source(model)
    return (_read_json(path) if path is not None else _from_hub(model)), name


def load_spec(model: str) -> ModelSpec:
    """The ModelSpec of a path, catalog name or hub id. Memoised on what is read: a config file's
    bytes (read again each call, so an edited file or another working folder counts), a hub id's
    config (asked once per process)."""
    path, name = _source(model)
    if path is None:
        return _hub_spec(model)
    return _spec_of(_read_bytes(path), name, str(path))


@lru_cache(maxsize=256)
def _spec_of(raw: bytes, name: str, shown: str) -> ModelSpec:
    return spec_from_config(_parse_json(raw, shown), name)


@lru_cache(maxsize=64)
def _hub_spec(model_id: str) -> ModelSpec:
    return spec_from_config(_from_hub(model_id), model_id)
