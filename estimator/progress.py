"""Quiet by default, but never silent for long (one owner): `after(seconds, message)` prints one
progress line on stderr when the work inside takes longer than `seconds` (Hub lookups, traces), and
`quiet_libraries()` keeps the libraries' warnings and log lines (transformers FutureWarnings,
bitsandbytes' missing-kernel notice) off the terminal unless the user asked for --verbose."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings

PATIENCE_S = 2.0
LIBRARY_LOGGERS = ("transformers", "torch", "peft", "bitsandbytes", "accelerate", "deepspeed", "huggingface_hub",
                   "urllib3", "datasets", "torchao")


@contextlib.contextmanager
def after(seconds: float, message: str):
    """Print `message` on stderr once if the block is still running after `seconds`."""
    timer = threading.Timer(seconds, lambda: print(message, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def quiet_libraries(verbose: bool = False):
    """Library warnings and log records below ERROR are dropped inside the block (not with verbose)."""
    if verbose:
        yield
        return
    saved = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
