"""Find the largest micro-batch (or the longest sequence) that fits, one child process per probe.

The search doubles from a start value until a probe runs out of memory, then bisects between the
largest value that ran and the smallest that did not, down to the step size (1 for the batch, a
multiple of 64 tokens for the sequence). It stops early on an `error` or `skipped` probe (no
boundary can be trusted then) and at the limit without an OOM. The boundary (largest ok, smallest
oom) and every probe are kept: `Boundary.to_dict()` is what max_batch.json holds.

Every probe is an ordinary configuration (its own Workload id), so its rows land in the run's
results like any other and a resumed search reuses finished probes instead of running them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from profiler.case import Case
from profiler.record import case_status
from profiler.runner import Runner
from profiler.store import RunStore

BATCH_LIMIT = 1024
SEQ_LIMIT = 131072
SEQ_START = 256
SEQ_STEP = 64


@dataclass
class Boundary:
    """Result of one search over `field_name` (batch or seq) for the configuration `base_id`."""

    base_id: str
    field_name: str
    largest_ok: int | None = None      # None: not even the start value (or 1) fits
    smallest_oom: int | None = None    # None: the limit was reached without an OOM
    stopped: str = ""                  # why the search ended early ("error at batch=8"), else ""
    probes: list[tuple[int, str]] = field(default_factory=list)  # (value, status) in probe order

    def to_dict(self) -> dict:
        return {"id": self.base_id, "field": self.field_name, "largest_ok": self.largest_ok,
                "smallest_oom": self.smallest_oom, "stopped": self.stopped,
                "probes": [{"value": v, "status": s} for v, s in self.probes]}

    def line(self) -> str:
        """One line for the terminal."""
        fits = "nothing fits" if self.largest_ok is None else f"largest {self.field_name} that fits: {self.largest_ok}"
        oom = (f"; {self.field_name} {self.smallest_oom} runs out of memory" if self.smallest_oom is not None
               else "; no OOM up to the limit")
        stop = f"; stopped: {self.stopped}" if self.stopped else ""
        return f"{self.base_id}: {fits}{oom}{stop} ({len(self.probes)} probes)"


def search(probe: Callable[[int], str], start: int = 1, limit: int = BATCH_LIMIT, step: int = 1,
           boundary: Boundary | None = None) -> Boundary:
    """Largest value in step multiples (start, 2 start, ... <= limit) for which `probe(value)`
    returns 'ok'; 'oom' means too large; anything else stops the search. `start` should be a
    multiple of `step`; a start that OOMs is bisected down towards `step`."""
    b = boundary or Boundary("", "")
    ok, oom = 0, None  # 0: nothing known to fit yet

    def run(value: int) -> str:
        status = probe(value)
        b.probes.append((value, status))
        return status

    value = min(start, limit)
    while True:  # doubling
        status = run(value)
        if status == "ok":
            ok = value
            if value >= limit:
                break
            value = min(value * 2, limit)
        elif status == "oom":
            oom = value
            break
        else:
            b.stopped = f"{status} at {b.field_name or 'value'}={value}"
            break
    while oom is not None and not b.stopped and oom - ok > step:  # bisection
        mid = max(ok + step, (ok + oom) // 2 // step * step)
        status = run(mid)
        if status == "ok":
            ok = mid
        elif status == "oom":
            oom = mid
        else:
            b.stopped = f"{status} at {b.field_name or 'value'}={mid}"
    b.largest_ok, b.smallest_oom = (ok or None), oom
    return b


def _probe(case: Case, field_name: str, runner: Runner, store: RunStore, force: bool,
           on_probe: Callable[[Case, str], None] | None):
    """probe(value): run `case` with field_name=value (or reuse its finished rows) -> status."""
    def probe(value: int) -> str:
        trial = case.with_(**{field_name: value})
        if not force and store.is_finished(trial.id):
            status = case_status(store.rows_of(trial.id))
        else:
            rows = runner.run(trial)
            store.put(trial.id, rows)
            status = case_status(rows)
        if on_probe:
            on_probe(trial, status)
        return status
    return probe


def max_value(case: Case, field_name: str, runner: Runner, store: RunStore, force: bool = False,
              on_probe: Callable[[Case, str], None] | None = None) -> Boundary:
    """The largest `batch` (from 1, up to 1024) or `seq` (from 256 in steps of 64, up to the
    model's position limit less new_tokens) of `case` that runs; the other fields stay as the
    case has them."""
    if field_name == "batch":
        start, limit, step = 1, BATCH_LIMIT, 1
    elif field_name == "seq":
        w = case.workload()  # prompt + generated tokens must fit the position table
        room = min(SEQ_LIMIT, w.model.max_position_embeddings or SEQ_LIMIT) - w.new_tokens
        limit = max(SEQ_STEP, room // SEQ_STEP * SEQ_STEP)
        start, step = min(SEQ_START, limit), SEQ_STEP
    else:
        raise ValueError(f"can search batch or seq, not {field_name!r}")
    base = case.with_(**{field_name: start})
    boundary = Boundary(base.id, field_name)
    return search(_probe(case, field_name, runner, store, force, on_probe), start, limit, step, boundary)
