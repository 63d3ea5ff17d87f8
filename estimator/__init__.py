"""gpu-budget's estimator: pure Python (never imports torch), from a HF config.json to memory, time
and cost. The Python API (names are imported on first use, so `import estimator.x` stays light):

    from estimator import estimate, load_spec, Workload
    w = Workload(load_spec("llama-3.1-8b"), method="qlora", quant="nf4", batch=1, seq=4096,
                 grad_ckpt=True).validate()
    e = estimate(w, "a10g-24gb")
    e.verdict, e.memory.device_used_bytes, e.safe["device_used_bytes"], e.to_dict()
"""

from __future__ import annotations

import importlib

_API = {"estimate": "estimator.api", "Estimate": "estimator.api", "JobSpec": "estimator.api",
        "Workload": "estimator.workload", "load_spec": "estimator.configs", "load_config": "estimator.configs",
        "spec_from_config": "estimator.model", "ModelSpec": "estimator.model", "InputError": "estimator.errors"}
__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'estimator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
