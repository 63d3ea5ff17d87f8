"""The environment every record row carries: device name and memory, GPU table row, driver,
CUDA, library versions (estimator.versions), hostname.

What is absent is None (a package not installed, no driver on a CPU machine, no GPU table row,
no device memory), never "" or 0; a results file writes it as an empty cell. Library versions
come from package metadata, so nothing heavy (deepspeed, bitsandbytes) is imported just to name
its version.
"""

from __future__ import annotations

import platform
import re
import socket

from estimator import tables
from estimator.versions import library_versions

# Largest relative difference between the device's total memory and a table row's memory_bytes for
# the row to match: torch reports a little less than the nominal size (80 GiB A100: 79.3 GiB).
MEMORY_TOLERANCE = 0.10


def cpu_name() -> str:
    """The CPU model ("model name" of /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _name_tokens(name: str) -> set[str]:
    """Lower-case alphanumeric tokens of a device name plus each pair of neighbours joined
    ("NVIDIA GeForce RTX 4090" -> {..., "rtx", "4090", "rtx4090"})."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    return set(words) | {a + b for a, b in zip(words, words[1:])}


def match_gpu_slug(device_name: str, total_memory_bytes: int | None = None) -> str | None:
    """The gpus.csv slug of a device as torch names it, or None when no row matches.

    The family (slug before its first "-": a100, h100, rtx4090, ...) must be a token of the name;
    "PCIe" in the name picks the PCIe rows, its absence the others; among what remains, the row
    whose memory is nearest the device's total memory, within MEMORY_TOLERANCE (so a MIG slice
    or an unlisted variant such as the 24 GB Quadro RTX 6000 gets None rather than a wrong peak).
    Examples: "NVIDIA H100 80GB HBM3" -> h100-80gb, "NVIDIA A100-SXM4-40GB" -> a100-40gb,
    "NVIDIA A100 80GB PCIe" -> a100-80gb-pcie, "Tesla T4" -> t4-16gb.
    """
    tokens = _name_tokens(device_name)
    rows = [g for g in tables.gpus().values() if g.slug.split("-")[0] in tokens]
    pcie = "pcie" in tokens
    same_form = [g for g in rows if ("pcie" in g.slug) == pcie]
    rows = same_form or rows
    if not rows:
        return None
    if total_memory_bytes is None:
        return rows[0].slug if len(rows) == 1 else None
    best = min(rows, key=lambda g: abs(g.memory_bytes - total_memory_bytes))
    if abs(best.memory_bytes - total_memory_bytes) > MEMORY_TOLERANCE * best.memory_bytes:
        return None
    return best.slug


def _nvml_driver() -> str | None:
    """NVIDIA driver version from NVML, None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no library, no driver, no device: not measured
        return None


def device_fields(device: str) -> dict:
    """gpu_name, gpu_slug, gpu_memory_bytes, driver and cuda for `device` ("cuda:N" or "cpu").

    On cpu the name is the CPU model and the GPU-only fields are None."""
    import torch

    from profiler.device import cuda as cuda_device
    from profiler.device import simulated

    cuda = torch.version.cuda or None
    if not cuda_device.is_cuda(device):
        return {"gpu_name": cpu_name(), "gpu_slug": None, "gpu_memory_bytes": None,
                "driver": _nvml_driver() if cuda else None, "cuda": cuda}
    name, total = cuda_device.properties(device)
    if simulated.active():  # cuda-only
        real = name.removesuffix(" (simulated)")
        return {"gpu_name": name, "gpu_slug": match_gpu_slug(real, total), "gpu_memory_bytes": total,
                "driver": "simulated", "cuda": cuda}
    else:  # hardware-only: a real GPU's driver version
        return {"gpu_name": name, "gpu_slug": match_gpu_slug(name, total),
                "gpu_memory_bytes": total, "driver": _nvml_driver(), "cuda": cuda}


def host_environment() -> dict:
    """The environment columns without asking any device (after a device fault): the CPU's
    fields, the libraries and the host."""
    import torch

    row = {"gpu_name": cpu_name(), "gpu_slug": None, "gpu_memory_bytes": None, "driver": None,
           "cuda": torch.version.cuda or None}
    row.update(library_versions())
    row["hostname"] = socket.gethostname()
    return row


def environment(device: str) -> dict:
    """Every environment column of a record row (profiler.record `_ENV`) for `device`."""
    row = device_fields(device)
    row.update(library_versions())
    row["hostname"] = socket.gethostname()
    return row
