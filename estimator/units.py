"""Unit constants. Bytes stay int and seconds float everywhere; convert only when printing."""

GiB = 2**30
MiB = 2**20
TFLOPS = 1e12


def gib(n_bytes: int) -> float:
    """Bytes -> GiB (2**30), for printing only."""
    return n_bytes / GiB
