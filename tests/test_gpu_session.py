"""The GPU session's wheel fetcher: pins that install together on the GPU machine."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_gpu_wheels.sh"


def _pins() -> dict[str, str]:
    return dict(re.findall(r"\b([a-z][a-z0-9_-]*)==([0-9][0-9a-z.]*)", SCRIPT.read_text()))


def test_pydantic_and_its_exact_core_are_pinned_together():
    """pydantic requires one exact pydantic-core; unpinned, the GPU machine got a pair that does
    not import. The pins must be the pair installed here, and agree with pydantic's metadata."""
    pins = _pins()
    assert pins.get("pydantic") == metadata.version("pydantic")
    required = [r for r in metadata.requires("pydantic") if r.startswith("pydantic-core")]
    assert required == [f"pydantic-core=={pins.get('pydantic-core')}"]


def test_the_fetched_libraries_match_the_project_pins():
    text = (SCRIPT.parents[1] / "pyproject.toml").read_text()
    for name in ("bitsandbytes", "deepspeed", "torchao", "transformers", "peft", "liger-kernel"):
        assert f'"{name}=={_pins()[name]}"' in text
