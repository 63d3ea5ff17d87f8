"""Check estimator/fp8.py's cast moments against torchao's own Float8Linear (needs torch and torchao).

One nn.Linear (M tokens, K in, N out) in bf16, then converted by `convert_to_float8_training`
(tensorwise, eager), forward + backward under the tracer's live-bytes counter
(profiler/trace/tracker.py). Prints the forward and backward peaks' growth over bf16's beside the
modelled workspace (`linear_workspace_bytes`). Run on CPU (torch._scaled_mm runs there) or CUDA:

    PYTHONPATH=/path/to/torchao python scripts/check_fp8_casts.py [--device cuda]

2026-11-24, torch 2.13.0+cpu, torchao 0.18.0 (CPU): every cast holds 9 B per element (fp32 copy,
fp32 scaled, then the clamp replacing the copy, fp8 result) and each fp8 operand lives until the
backward returns, as modelled; the peaks grow by exactly the modelled moment less what bf16's own
peak holds (its output 2MN in the forward; its weight gradient 2KN in the backward) plus, on CPU,
a copy of grad_input (2MK, its reshape after _scaled_mm): for (512, 256, 1024) forward +1,442,816
(= MK + 9KN - 2MN + 1 KiB of scales), backward +5,244,416 (= 10MN + KN - 2KN + 2MK + 1.5 KiB);
(2048, 4096, 1024) backward +92,276,736 (= 2MN + KN + 9MK - 2KN + 2MK + 2 KiB); (512, 4096, 14336)
forward +515,900,416 (= MK + 9KN - 2MN + 1 KiB), backward +414,188,544 (= MN + 9KN - 2KN - 2MK + 1 KiB:
the weight cast comes before grad_input exists).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository root replaces scripts/ (whose profile.py would shadow the standard library's)
sys.path[0] = str(Path(__file__).resolve().parents[1])


def peaks(fp8: bool, m: int, k: int, n: int, device: str) -> tuple[int, int]:
    import torch
    from profiler.trace.tracker import LiveBytes

    class Phases(LiveBytes):
        def __init__(self):
            super().__init__()
            self.fwd = self.bwd = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.current_phase() == "backward":
                self.bwd = max(self.bwd, self.total)
            else:
                self.fwd = max(self.fwd, self.total)
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
    if fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    mode = Phases()
    with mode:
        model(x).backward(g)
    return mode.fwd, mode.bwd


def main() -> int:
    from estimator.fp8 import linear_workspace_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    for m, k, n in ((512, 256, 1024), (2048, 4096, 1024), (512, 4096, 14336)):
        (fa, ba), (fb, bb) = peaks(False, m, k, n, args.device), peaks(True, m, k, n, args.device)
        print(f"M={m} K={k} N={n}: forward +{fb - fa:,} B, backward +{bb - ba:,} B; modelled workspace "
              f"{int(linear_workspace_bytes(m, k, n)):,} B (2MN {2 * m * n:,}, 2KN {2 * k * n:,}, 2MK {2 * m * k:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
