"""cuBLAS workspaces in the allocated peak (issue 12): torch 2.13 takes one workspace per (cuBLAS
handle, stream) from its caching allocator and keeps it; handles are per thread, so a training step
holds two (the forward's thread and the autograd engine's device thread) and inference one. The
size is CUBLAS_WORKSPACE_CONFIG's default for the GPU's compute capability."""

from __future__ import annotations

import re

import pytest

from estimator.api import estimate
from estimator.configs import load_spec
from estimator.memory import estimate_memory
from estimator.workload import Workload


def _config_bytes(config: str) -> int:
    """CUBLAS_WORKSPACE_CONFIG ':SIZE_KiB:COUNT...' in bytes, as PyTorch sums it."""
    return sum(int(k) * 1024 * int(n) for k, n in re.findall(r":(\d+):(\d+)", config))


HOPPER_AND_LATER = _config_bytes(":4096:8")          # compute capability 9.x, 10.x, 12.x
OTHERS = _config_bytes(":4096:2:16:8")               # Volta, Turing, Ampere, Ada


@pytest.mark.parametrize("gpu,per_thread", [
    ("h100-80gb", HOPPER_AND_LATER), ("h200-141gb", HOPPER_AND_LATER), ("h20-96gb", HOPPER_AND_LATER),
    ("b200-180gb", HOPPER_AND_LATER), ("a100-80gb", OTHERS), ("l4-24gb", OTHERS), ("rtx3090-24gb", OTHERS),
    ("v100-16gb", OTHERS), ("t4-16gb", OTHERS),
])
def test_two_workspaces_in_training_one_in_inference(gpu, per_thread):
    spec = load_spec("llama-3.2-1b")
    for method, threads in (("lora", 2), ("full", 2), ("inference", 1)):
        precision = "fp16" if gpu in ("v100-16gb", "t4-16gb") else "bf16"   # no bf16 tensor cores
        w = Workload(spec, method=method, batch=1, seq=512, precision=precision).validate()
        with_gpu = estimate(w, gpu, "none").memory
        assert with_gpu.blas_workspace_bytes == threads * per_thread, (gpu, method)
        # persistent for the whole step: the peak grows by exactly the workspaces
        assert with_gpu.peak_allocated_bytes - estimate_memory(w, 0.0, 0).peak_allocated_bytes == threads * per_thread


def test_the_workspaces_count_as_exact_in_the_bound():
    from estimator.bounds import exact_bytes

    w = Workload(load_spec("llama-3.2-1b"), method="inference", batch=1, seq=1).validate()
    m = estimate(w, "h100-80gb", "none").memory
    assert exact_bytes(m) == m.weights_bytes + m.kv_cache_bytes + HOPPER_AND_LATER
