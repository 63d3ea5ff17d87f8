"""The library versions a measurement and a calibration table carry: the one list, and how they
are read (package metadata: nothing heavy is imported just to name its version).

`LIBRARIES` are the libraries whose version changes what a step costs; `VERSION_COLUMNS` adds the
driver and the CUDA runtime, as the record (profiler.record) and the calibration table
(fitting.calibration_table) store them. `RUN_PACKAGES` is the wider list a run folder's run.json
records. A library that is not installed has the version None (an empty cell in a file).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import metadata

LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed")
VERSION_COLUMNS = ("driver", "cuda") + LIBRARIES
RUN_PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "pandas",
                "nvidia-ml-py")


def package_version(name: str) -> str | None:
    """Installed version of a distribution, None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict:
    """{name: version or None} of every name, in order."""
    return {name: package_version(name) for name in names}


@lru_cache(maxsize=1)
def _installed() -> tuple:
    return tuple((k, v) for k, v in library_versions().items() if v is not None)


def installed_versions() -> dict:
    """{library: version} of the LIBRARIES installed here (missing ones left out), read once per
    process: what the estimator holds a calibration table's versions against."""
    return dict(_installed())
