"""Where a sweep's configurations run: on this machine (profiler.runner: one child process each,
several at once with --parallel), or submitted to a cluster through submitit (--executor submitit).

submitit (facebookincubator/submitit) submits each configuration as one job: SLURM's `sbatch`
on a cluster (`AutoExecutor`), or a local subprocess with `cluster="local"` (what the tests use).
The job runs `Runner.run` on the node it lands on, which starts the usual child process there
(so a node's GPUs are pinned and killed as on a workstation) and returns its rows; the parent
stores them in the sweep's order as the jobs end. Jobs ask for as many GPUs per node as the
configuration has processes. Interrupting the parent cancels the jobs not yet finished.
No scheduler of our own: queueing, placement and retries are SLURM's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from estimator.errors import InputError
from profiler.case import Case
from profiler.runner import Runner

EXECUTORS = ("local", "submitit")


@dataclass(frozen=True)
class ClusterOptions:
    """What a submitit job asks the cluster for (SLURM's own names)."""

    cluster: str | None = None        # None: submitit picks (slurm where sbatch exists); "local": subprocesses
    partition: str | None = None
    time_min: int = 60
    cpus_per_task: int = 8
    mem_gb: int | None = None


def check_executor(name: str) -> None:
    """InputError (one line) for an unknown executor or a missing submitit."""
    if name not in EXECUTORS:
        raise InputError(f"--executor must be one of {', '.join(EXECUTORS)}; got {name!r}")
    if name == "submitit" and importlib.util.find_spec("submitit") is None:
        raise InputError("--executor submitit needs submitit: pip install 'submitit==1.5.4' "
                         "(or pip install '.[cluster]')")


def _job(backend: str, timeout_s: float, gpu_slug: str | None, case_json: str) -> list[dict]:
    """What one job runs on its node: the configuration in a child process, its rows."""
    return Runner(backend=backend, timeout_s=timeout_s, gpu_slug=gpu_slug).run(Case.from_json(case_json))


def _executor(folder: Path, options: ClusterOptions, gpus: int):
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder), cluster=options.cluster)
    params = dict(timeout_min=options.time_min, gpus_per_node=gpus, tasks_per_node=1, nodes=1,
                  cpus_per_task=options.cpus_per_task, name="gpu-budget")
    if options.mem_gb:
        params["mem_gb"] = options.mem_gb
    if options.partition:
        params["slurm_partition"] = options.partition
    executor.update_parameters(**params)
    return executor


def run_submitit(todo: list[Case], runner: Runner, folder: Path, options: ClusterOptions, record_case) -> None:
    """Submit every configuration as one job, then record their rows in the sweep's order. A job
    that fails outside the child (the node died, the job was cancelled) becomes an error row
    saying so; the configuration runs again on resume with --retry-errors."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = []
    try:
        for case in todo:
            executor = _executor(folder, options, case.workload().world_size)
            jobs.append((case, executor.submit(_job, runner.backend, runner.timeout_s, runner.gpu_slug,
                                               case.to_json())))
        for case, job in jobs:
            try:
                rows = job.result()
            except Exception as exc:  # the job, not the child, failed: one error row per rank
                first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                known = runner._known(case, "", 0.0)
                rows = [{**known, "status": "error", "rank": rank,
                         "message": f"submitit job {job.job_id} failed: {first[:300]}"}
                        for rank in range(case.workload().world_size)]
            record_case(case, rows)
    except BaseException:
        for _case, job in jobs:
            if not job.done():
                job.cancel(check=False)
        raise
