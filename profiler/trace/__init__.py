"""The tracer: the exact tensor memory of a real step on fake tensors, without a GPU.

Rooms: `step` (build the Workload's model on fake tensors and run the real step: `trace`,
`trace_row`), `tracker` (the dispatch mode counting live storages by category and phase),
`patches` (CUDA behaviour reproduced on cpu), `qlora` (the bitsandbytes 4-bit stand-in),
`layers` (which layers to trace and how to extrapolate), `grid` (the estimator beside the trace
over a grid of configurations).

Importing this package imports no torch; `trace` and `trace_row` import it when called.
"""

from profiler.trace.step import INFERENCE_PHASES, TRAIN_PHASES, TraceResult, trace, trace_row

__all__ = ["INFERENCE_PHASES", "TRAIN_PHASES", "TraceResult", "trace", "trace_row"]
