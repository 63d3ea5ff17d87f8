"""Variants of tests/data/tiny-llama.json written to a test's folder (one owner for the shapes the
multi-rank and build tests share)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = Path(__file__).with_name("data") / "tiny-llama.json"
# odd sizes (hidden 45, vocab 1001, MLP 99): most parameters and the total have an odd number of
# elements, so DeepSpeed's and FSDP's padding rules matter
ODD = dict(hidden_size=45, head_dim=10, num_attention_heads=5, num_key_value_heads=1, intermediate_size=99,
           vocab_size=1001)


def tiny_llama(folder: Path, name: str, **changes) -> Path:
    """tiny-llama with `changes` laid over it, written as folder/tiny-llama-<name>.json."""
    cfg = json.loads(TINY_LLAMA.read_text())
    cfg.update(changes)
    path = Path(folder) / f"tiny-llama-{name}.json"
    path.write_text(json.dumps(cfg))
    return path
