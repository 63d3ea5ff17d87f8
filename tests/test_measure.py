"""Measurement helpers on synthetic inputs: step statistics, phase timing, the Measurement `run`
returns (the cpu path: every CUDA quantity None, never 0), the device package (allocator peaks,
NVML absent or hiding this process, peak sampling), tokens/s and MFU, weights bytes, the
environment and the GPU table match."""

import ast
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch

from estimator import tables
from estimator.configs import load_spec
from estimator.flops import decode_flops_per_token, prefill_flops, training_flops
from estimator.versions import package_version
from estimator.workload import Workload
from profiler import device, env, measure, record
from profiler.device import cuda, host, nvml

TINY = "tests/data/tiny-llama.json"


def _w(**kw) -> Workload:
    return Workload(model=load_spec(TINY), **kw).validate()


# ---------------------------------------------------------------- statistics and timing


def test_step_stats_median_min_max_spread():
    s = measure.step_stats([0.30, 0.10, 0.20, 0.25])
    assert (s.median_s, s.min_s, s.max_s) == (pytest.approx(0.225), 0.10, 0.30)
    assert s.spread == pytest.approx((0.30 - 0.10) / 0.225)
    one = measure.step_stats([0.5])
    assert (one.median_s, one.spread) == (0.5, 0.0)


@pytest.mark.parametrize("bad", [[], [0.1, 0.0], [0.1, -1.0], [float("nan")]])
def test_step_stats_refuses_no_or_non_positive_durations(bad):
    with pytest.raises(ValueError):
        measure.step_stats(bad)


class FakeClock:
    """A clock whose time only moves when a phase advances it; counts syncs."""

    def __init__(self):
        self.now, self.syncs = 0.0, 0

    def mark(self):
        return self.now

    def sync(self):
        self.syncs += 1

    def elapsed_s(self, a, b):
        return b - a


def test_time_phases_times_each_phase_of_each_step_and_syncs_once():
    clock = FakeClock()
    calls = []

    def phase(name, seconds):
        def run():
            calls.append(name)
            clock.now += seconds
        return run

    out = measure.time_phases([phase("prefill", 0.5), phase("decode", 0.25)], 3, clock)
    assert out == [[0.5, 0.25]] * 3
    assert calls == ["prefill", "decode"] * 3
    assert clock.syncs == 1


def test_the_garbage_collector_is_off_while_timing_and_restored():
    import gc

    seen = []
    assert gc.isenabled()
    measure.time_phases([lambda: seen.append(gc.isenabled())], 3, FakeClock())
    assert seen == [False] * 3 and gc.isenabled()

    def boom():
        raise RuntimeError("phase failed")
    with pytest.raises(RuntimeError):
        measure.time_phases([boom], 1, FakeClock())
    assert gc.isenabled()      # restored when a phase raises (an OOM is a result, the run goes on)


def test_cpu_clock_measures_real_time():
    out = measure.time_phases([lambda: time.sleep(0.02)], 2, host.CpuClock())
    assert all(0.015 < d[0] < 1.0 for d in out)
    assert isinstance(device.clock_for("cpu"), host.CpuClock)
    assert device.is_cuda("cuda:1") and device.is_cuda("cuda") and not device.is_cuda("cpu")


def test_run_on_cpu_warms_up_times_and_leaves_cuda_quantities_unmeasured():
    counter = {"n": 0}

    def step():
        counter["n"] += 1
        time.sleep(0.005)

    out = measure.run([step], warmup=2, steps=4, device="cpu")
    assert isinstance(out, measure.Measurement)
    assert counter["n"] == 6 and out.steps == 4
    for name in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "context_bytes"):
        assert getattr(out, name) is None, name
    assert isinstance(out.host_rss_bytes, int) and out.host_rss_bytes > 10_000_000
    assert out.step_s_min <= out.step_s <= out.step_s_max
    assert out.step_s >= 0.004
    assert len(out.phase_s) == 1


def test_run_records_each_phase_and_the_context_it_is_given():
    out = measure.run([lambda: time.sleep(0.002), lambda: time.sleep(0.02)], warmup=0, steps=3,
                      device="cpu", device_used=lambda: 5 * 2**30, context_bytes=500 * 2**20)
    assert len(out.phase_s) == 2 and out.phase_s[1] > out.phase_s[0]
    assert out.device_used_bytes == 5 * 2**30 and out.context_bytes == 500 * 2**20


def _measurement(**kw) -> measure.Measurement:
    base = dict(step_s=0.2, step_s_min=0.19, step_s_max=0.21, steps=5, phase_s=(0.2,))
    return measure.Measurement(**{**base, **kw})


def test_measurement_columns_are_the_record_columns_it_fills():
    m = _measurement(peak_allocated_bytes=3 * 2**30, host_rss_bytes=2**30)
    cols = m.columns()
    assert set(cols) < set(record.COLUMN_NAMES)
    assert cols["step_spread"] == pytest.approx(0.02 / 0.2) == m.step_spread
    assert cols["peak_allocated_bytes"] == 3 * 2**30 and cols["host_rss_bytes"] == 2**30
    assert cols["peak_reserved_bytes"] is None and cols["device_used_bytes"] is None
    assert cols["context_bytes"] is None
    assert "phase_s" not in cols and "warnings" not in cols


def test_timing_warnings_flag_few_steps_and_a_wide_spread():
    steady = measure.step_stats([0.20, 0.21, 0.19, 0.20])
    assert measure.timing_warnings(steady, 4) == ()
    noisy = measure.step_stats([0.20, 0.30, 0.19, 0.20])
    (warning,) = measure.timing_warnings(noisy, 4)
    assert "noisy" in warning and "55%" in warning
    assert "2 timed step" in measure.timing_warnings(measure.step_stats([0.2, 0.2]), 2)[0]


def test_run_warns_about_noisy_timings():
    pauses = iter([0.001, 0.001, 0.001, 0.03] + [0.001] * 100)
    out = measure.run([lambda: time.sleep(next(pauses))], warmup=0, steps=4, device="cpu")
    assert any("noisy" in w for w in out.warnings), out


def test_cpu_peaks_are_none_not_zero():
    # Without a GPU torch.cuda.max_memory_allocated() silently returns 0: never report it.
    assert cuda.peaks("cpu") == cuda.AllocatorPeaks(allocated_bytes=None, reserved_bytes=None)
    cuda.reset_peaks("cpu")  # no-op; the CUDA call would raise AttributeError here


def test_rss_bytes_sees_a_large_allocation():
    before = host.rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    assert host.rss_bytes() - before > 48 * 2**20
    del block


def test_measure_reads_the_device_only_through_profiler_device():
    """profiler.device is the one home of the code that talks to the device."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "profiler" / "measure.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"pynvml", "psutil", "time"}, imported
    uses = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not [u for u in uses if u.startswith("torch.cuda")], uses


# ---------------------------------------------------------------- NVML and sampling


def test_nvml_absent_gives_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert nvml.open_device(0) is None
    assert nvml.used_probe(None) == (None, "")
    ran = []
    assert nvml.context_bytes(None, lambda: ran.append(1), lambda: 0) is None
    assert ran == [1]  # CUDA init runs even when it cannot be measured
    assert env._nvml_driver() is None


def test_nvml_library_missing_on_this_machine_gives_none():
    # The real pynvml on a machine without a driver: NVMLError_LibraryNotFound -> None.
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present")
    assert nvml.open_device(0) is None


class FakeDevice:
    def __init__(self, used, process=None):
        self.used, self.process = list(used), process

    def used_bytes(self):
        return self.used.pop(0) if len(self.used) > 1 else self.used[0]

    def process_used_bytes(self, pid):
        return self.process


def test_context_bytes_is_the_nvml_delta_minus_what_the_allocator_holds():
    mib = 2**20
    dev = FakeDevice([1000 * mib, 1500 * mib])
    assert nvml.context_bytes(dev, lambda: None, lambda: 2 * mib) == 498 * mib
    # another process freed memory meanwhile: not measured, not negative, not 0
    assert nvml.context_bytes(FakeDevice([1000 * mib, 900 * mib]), lambda: None, lambda: 0) is None


def test_used_probe_prefers_this_process_else_the_device():
    probe, source = nvml.used_probe(FakeDevice([7 * 2**30], process=3 * 2**30))
    assert (probe(), source) == (3 * 2**30, nvml.SOURCE_PROCESS)
    # no per-process memory (containers): the device's used memory less the before-CUDA baseline
    probe, source = nvml.used_probe(FakeDevice([7 * 2**30], process=None), baseline_bytes=2**30)
    assert (probe(), source) == (6 * 2**30, nvml.SOURCE_DEVICE_DELTA)
    # without a baseline the whole device would be another quantity: not measured
    assert nvml.used_probe(FakeDevice([7 * 2**30], process=None)) == (None, "")


def test_init_reading_keeps_the_baseline_before_cuda():
    mib = 2**20
    reading = nvml.init_reading(FakeDevice([1000 * mib, 1500 * mib]), lambda: None, lambda: 2 * mib)
    assert reading == nvml.InitReading(1000 * mib, 498 * mib)
    assert nvml.init_reading(None, lambda: None, lambda: 0) == nvml.InitReading(None, None)


@pytest.mark.parametrize("visible", ["MIG-4b0d2c7e-ffff-5d3b-9a8e-0123456789ab", "GPU-deadbeef", "0,1", ""])
def test_an_unmappable_cuda_index_is_not_measured(monkeypatch, visible):
    # issue 16 item 5: never fall back to reading physical GPU `cuda_index`
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 8, raising=False)
    assert nvml.nvml_index(2) is None
    assert nvml.open_device(2) is None


def test_visible_devices_map_to_nvml_indices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml.nvml_index(0) == 3 and nvml.nvml_index(1) == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml.nvml_index(1) == 1


def test_a_mig_enabled_gpu_is_not_measured(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: (1, 1))
    assert nvml.open_device(0) is None
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: (0, 0))
    assert nvml.open_device(0) == nvml.NvmlDevice("handle0", 0)


def test_a_library_mismatch_is_not_measured(monkeypatch):
    # NVMLLibraryMismatchError is not an NVMLError (old driver, new bindings): it must not escape
    def mismatch(handle):
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", mismatch)
    dev = nvml.NvmlDevice(handle=object(), index=0)
    assert dev.process_used_bytes(os.getpid()) is None and dev.processes() is None
    assert nvml.busy_processes(dev) is None


def test_the_sampler_is_gentle_and_its_join_is_bounded(monkeypatch):
    assert nvml.SAMPLE_INTERVAL_S >= 0.02  # NVML calls must not compete with launch-bound steps
    monkeypatch.setattr(nvml, "JOIN_TIMEOUT_S", 0.2)
    release = __import__("threading").Event()
    calls = []

    def stuck():
        calls.append(1)
        if len(calls) > 1:  # the thread's first sample hangs in "NVML"
            release.wait(30)
        return 5

    t0 = time.monotonic()
    with nvml.PeakSampler({"stuck": stuck}, interval_s=0.001) as s:
        time.sleep(0.05)
    release.set()
    assert time.monotonic() - t0 < 5 and s.peaks["stuck"] == 5


def test_run_empties_the_cache_before_warm_up_and_counts_retries_over_the_timed_steps(monkeypatch):
    events, counter = [], iter([7, 10])
    monkeypatch.setattr(measure.cuda, "empty_cache", lambda d: events.append("empty_cache"))
    monkeypatch.setattr(measure.cuda, "reset_peaks", lambda d: events.append("reset"))
    monkeypatch.setattr(measure.cuda, "alloc_retries", lambda d: next(counter))
    m = measure.run([lambda: events.append("phase")], warmup=1, steps=3, device="cpu")
    assert events[:3] == ["empty_cache", "phase", "reset"]
    assert m.alloc_retries == 3 and m.columns()["alloc_retries"] == 3
    assert "allocator retried 3 time(s)" in m.retry_warning() and m.retry_warning() in m.warnings


def test_no_retries_no_warning_and_cpu_retries_are_not_measured():
    m = measure.run([lambda: None], warmup=0, steps=3, device="cpu")
    assert m.alloc_retries is None and m.retry_warning() == ""
    assert cuda.alloc_retries("cpu") is None
    cuda.empty_cache("cpu")  # a no-op off cuda
    assert measure.retry_warning(0) == ""


def test_alloc_retries_reads_the_allocator_counter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {"num_alloc_retries": 4})
    assert cuda.alloc_retries("cuda:0") == 4


def test_process_used_bytes_matches_our_pid_only(monkeypatch):
    procs = [SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=5 * 2**30),
             SimpleNamespace(pid=os.getpid(), usedGpuMemory=2 * 2**30)]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: procs)
    dev = nvml.NvmlDevice(handle=object(), index=0)
    assert dev.process_used_bytes(os.getpid()) == 2 * 2**30
    assert dev.process_used_bytes(12345678) is None  # another pid namespace (containers)
    procs[1].usedGpuMemory = None  # NVML_VALUE_NOT_AVAILABLE
    assert dev.process_used_bytes(os.getpid()) is None


def test_peak_sampler_keeps_maxima_and_ignores_failures():
    values = iter([5, 9, 3] + [1] * 10_000)

    def failing():
        raise RuntimeError("NVML gone")

    with nvml.PeakSampler({"a": lambda: next(values), "zero": lambda: 0, "bad": failing,
                           "absent": None}, interval_s=0.001) as s:
        time.sleep(0.05)
    assert s.peaks == {"a": 9, "zero": None, "bad": None, "absent": None}
    assert s.samples >= 3


# ---------------------------------------------------------------- rates, MFU, weights


def test_tokens_per_s_training_and_inference():
    w = _w(batch=2, seq=32, grad_accum=3)
    assert measure.rates(w, 0.5, "")["tokens_per_s"] == pytest.approx(2 * 32 * 3 / 0.5)
    inf = _w(method="inference", batch=2, seq=16, new_tokens=4)
    assert measure.rates(inf, 0.25, "")["tokens_per_s"] == pytest.approx(2 * (16 + 4) / 0.25)


def test_mfu_against_the_gpu_table_dense_peak():
    w = _w(batch=2, seq=32, grad_accum=2)
    flops = 2 * training_flops(w).model_flops
    got = measure.rates(w, 0.01, "h100-80gb")["mfu"]
    assert got == pytest.approx(flops / 0.01 / (tables.gpu("h100-80gb").bf16_dense_tflops * 1e12))
    fp32 = _w(precision="fp32")
    assert measure.peak_flops_per_s(fp32, "a100-80gb") == tables.gpu("a100-80gb").fp32_tflops * 1e12
    assert measure.rates(w, 0.01, "")["mfu"] is None          # cpu: no table row
    assert measure.peak_flops_per_s(w, "v100-16gb") is None   # V100 has no bf16 tensor cores


def test_inference_flops_are_prefill_plus_each_decode_step():
    w = _w(method="inference", batch=2, seq=16, new_tokens=4)
    expected = prefill_flops(w) + sum(decode_flops_per_token(w, 16 + i) for i in (1, 2, 3))
    assert measure.model_flops_per_step(w) == pytest.approx(expected)


def test_inference_split_divides_decode_by_generated_tokens_after_the_first():
    w = _w(method="inference", seq=16, new_tokens=5)
    assert measure.inference_split(w, [0.2, 0.8]) == {"prefill_s": 0.2, "decode_token_s": 0.2}
    one = _w(method="inference", seq=16, new_tokens=1)
    assert measure.inference_split(one, [0.2]) == {"prefill_s": 0.2, "decode_token_s": None}


def test_weights_bytes_counts_tied_storage_once_and_filters_devices():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleList([emb, head, torch.nn.LayerNorm(4)])
    assert measure.weights_bytes(model) == (40 + 4 + 4) * 4
    assert measure.weights_bytes(model, "cpu") == 192
    assert measure.weights_bytes(model, "cuda:0") is None
    with torch.device("meta"):
        assert measure.weights_bytes(torch.nn.Linear(4, 4)) is None


# ---------------------------------------------------------------- environment


@pytest.mark.parametrize("name,memory,slug", [
    ("NVIDIA H100 80GB HBM3", 85_520_809_984, "h100-80gb"),
    ("NVIDIA H100 PCIe", 85_520_809_984, "h100-80gb-pcie"),
    ("NVIDIA H200", 150_754_820_096, "h200-141gb"),
    ("NVIDIA A100-SXM4-80GB", 85_097_971_712, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 42_505_273_344, "a100-40gb-pcie"),
    ("NVIDIA A100 80GB PCIe", 85_097_971_712, "a100-80gb-pcie"),
    ("NVIDIA A10G", 23_836_033_024, "a10g-24gb"),
    ("NVIDIA A10", 23_836_033_024, "a10-24gb"),
    ("NVIDIA L4", 23_580_639_232, "l4-24gb"),
    ("NVIDIA L40S", 47_697_362_944, "l40s-48gb"),
    ("NVIDIA GeForce RTX 4090", 25_393_692_672, "rtx4090-24gb"),
    ("NVIDIA GeForce RTX 3090", 25_438_126_080, "rtx3090-24gb"),
    ("Tesla V100-SXM2-16GB", 16_945_512_448, "v100-16gb"),
    ("Tesla V100-SXM2-32GB", 34_089_730_048, "v100-32gb"),
    ("Tesla T4", 15_828_320_256, "t4-16gb"),
    ("NVIDIA H100 NVL", 99_857_989_632, "h100-nvl-94gb"),
    ("NVIDIA B200", 191_503_884_288, "b200-180gb"),
    ("NVIDIA RTX 6000 Ada Generation", 50_911_379_456, "rtx6000-ada-48gb"),
    ("NVIDIA RTX A6000", 50_925_535_232, "rtxa6000-48gb"),
    ("Quadro RTX 6000", 25_393_692_672, ""),               # the 24 GB Turing card: not in the table
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10_468_982_784, ""),  # a MIG slice
    ("NVIDIA L40", 47_697_362_944, "l40-48gb"),
    ("AMD Instinct MI300X", 205_822_885_888, ""),
])
def test_match_gpu_slug(name, memory, slug):
    assert env.match_gpu_slug(name, memory) == (slug or None)  # None: no row matches


def test_match_gpu_slug_without_memory_needs_a_single_candidate():
    assert env.match_gpu_slug("Tesla T4") == "t4-16gb"
    assert env.match_gpu_slug("Tesla V100-SXM2-16GB") is None  # 16 or 32 GB: cannot tell


def test_environment_on_cpu_fills_every_environment_column():
    got = env.environment("cpu")
    env_columns = [n for n, _ in record._ENV]
    assert sorted(got) == sorted(env_columns)
    assert got["torch"] == torch.__version__
    assert got["transformers"] and got["peft"] and got["hostname"] == socket.gethostname()
    assert got["gpu_name"]  # the CPU model
    assert got["gpu_slug"] is None and got["gpu_memory_bytes"] is None
    assert package_version("no-such-package-xyz") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retries_and_the_emptied_cache_on_a_real_gpu():
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda:0")
    del x
    assert torch.cuda.memory_reserved(0) >= 256 * 2**20
    cuda.empty_cache("cuda:0")
    assert torch.cuda.memory_reserved(0) < 256 * 2**20
    assert isinstance(cuda.alloc_retries("cuda:0"), int) and cuda.alloc_retries("cuda:0") >= 0


@pytest.mark.parametrize("value,expected", [
    ("9.0a", "9.0"),                      # the first H100 image's value: DeepSpeed's int('0a') failed
    ("8.0;9.0a;9.0", "8.0;9.0"),
    ("8.0 8.6 9.0a+PTX", "8.0;8.6;9.0+PTX"),
    ("10.0f;12.0a", "10.0;12.0"),
    ("9.0", None), ("8.0;9.0+PTX", None), ("", None), (None, None),
])
def test_deepspeed_reads_the_arch_list_it_is_given(value, expected):
    assert cuda.deepspeed_arch_list(value) == expected


def test_a_zero_child_on_a_gpu_gets_an_arch_list_deepspeed_can_parse(monkeypatch):
    from profiler.device import simulated

    monkeypatch.setattr(simulated, "active", lambda: False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert cuda.deepspeed_environment("cuda") == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cuda.deepspeed_environment("cuda") == {}
    assert cuda.deepspeed_environment("cpu") == {"DS_ACCELERATOR": "cpu"}
