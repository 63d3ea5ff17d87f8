"""The profiler: real steps of a Workload on CUDA (measured) or fake tensors on CPU (traced).

Built by the profiler and tracer issues; the estimator's Workload (estimator.workload) is the
noun it takes.
"""
