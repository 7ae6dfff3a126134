"""Tests for workers.memory: CPU behaviour, and the sampler loop driven by an injected fake reader."""

from __future__ import annotations

import itertools
import json
import math
import time

import pytest
import torch

from workers.memory import NO_DEVICE_NOTE, MemoryTracer, process_rss_bytes, reset_and_empty_cache
from workers.wire import KIND_CUDA, KIND_RSS, MemorySample, MemoryTrace

MiB = 1 << 20


class GrowingReader:
    """Fake per-device reader: numbers grow with each call; remembers the largest it returned."""

    def __init__(self) -> None:
        self.made = 0  # calls so far
        self.max_seen: dict[int, tuple[int, int, int]] = {}

    def __call__(self, device: int) -> tuple[int, int, int | None]:
        self.made += 1
        n = self.made
        value = (n * MiB * (device + 1), 2 * n * MiB * (device + 1), 3 * n * MiB)
        self.max_seen[device] = value  # values only grow, so the last is the max
        return value


def run_for(tracer: MemoryTracer, seconds: float, until=lambda: True) -> MemoryTrace:
    """The tracer run for ``seconds``, then on until ``until()`` holds (say, the reader called often enough:
    on a busy machine the sampler thread can be starved for longer than a test's interval), a minute at most."""
    with tracer:
        time.sleep(seconds)
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
    return tracer.trace


# --- CPU behaviour -----------------------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_no_cuda_without_rss_gives_empty_trace_with_note(no_cuda: None) -> None:
    tracer = MemoryTracer(interval_ms=10, rss=False)
    tracer.start()
    trace = tracer.stop()
    assert trace.samples == () and trace.devices == ()
    assert trace.note == NO_DEVICE_NOTE
    assert trace.peak_gib == 0.0 and trace.peak_gib_per_device() == {}
    assert trace.to_rows() == []
    assert tracer.stop() is trace  # stop is idempotent


def test_no_cuda_context_manager_and_explicit_devices(no_cuda: None) -> None:
    with MemoryTracer(devices=[0, 1], rss=False) as tracer:
        with pytest.raises(RuntimeError, match="after stop"):
            _ = tracer.trace
    assert tracer.trace.samples == ()
    assert "nothing to sample" in tracer.trace.note


def test_context_manager_does_not_swallow_exceptions(no_cuda: None) -> None:
    tracer = MemoryTracer(rss=False)
    with pytest.raises(KeyError):
        with tracer:
            raise KeyError("trial failed")
    assert tracer.trace.note == NO_DEVICE_NOTE


def test_no_cuda_traces_process_rss_and_its_peak(no_cuda: None) -> None:
    """On CPU the trace is the process's resident memory: samples, a peak that sees a spike that
    came and went between two samples (the kernel's reset high-water mark), and a JSON round trip."""
    before = process_rss_bytes()
    # one sample at start and one at stop, so none can fall inside the spike (with a 1 s interval, a sample of
    # one busy 2-core run held the spike: a tick in it, it seems, as freeing it returned the memory here)
    with MemoryTracer(interval_ms=600_000) as tracer:
        spike = bytearray(256 * MiB)  # zero-filled, so resident
        del spike
    trace = tracer.trace
    assert trace.kind == KIND_RSS and trace.devices == (0,)
    assert len(trace.samples) == 2 and all(s.allocated_bytes == s.reserved_bytes > 0 for s in trace.samples)
    assert abs(trace.samples[0].reserved_bytes - before) < 128 * MiB  # the sample is this process's RSS
    sampled_max = max(s.reserved_bytes for s in trace.samples)
    if "samples only" in trace.note:  # no resettable VmHWM (not Linux): peaks from the samples alone
        assert trace.peak_reserved_bytes[0] == sampled_max
    else:
        assert trace.peak_reserved_bytes[0] >= before + 200 * MiB > sampled_max
    assert trace.peak_gib == trace.peak_reserved_bytes[0] / (1 << 30)
    assert MemoryTrace.from_dict(json.loads(json.dumps(trace.to_dict()))) == trace


def test_cuda_kind_is_the_default_and_survives_old_dicts() -> None:
    trace = run_for(MemoryTracer(interval_ms=10, devices=[0], reader=GrowingReader()), 0.02)
    assert trace.kind == KIND_CUDA
    old = {k: v for k, v in trace.to_dict().items() if k != "kind"}  # results written before the field
    assert MemoryTrace.from_dict(old).kind == KIND_CUDA


@pytest.mark.parametrize("bad", [0, -5.0, math.nan])
def test_bad_interval_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="interval_ms must be > 0"):
        MemoryTracer(interval_ms=bad)


def test_start_twice_raises() -> None:
    tracer = MemoryTracer(devices=[0], reader=GrowingReader())
    tracer.start()
    with pytest.raises(RuntimeError, match="only once"):
        tracer.start()
    tracer.stop()


def test_reset_and_empty_cache_runs_without_cuda(no_cuda: None) -> None:
    reset_and_empty_cache()


def test_to_dict_from_dict_round_trip_through_json() -> None:
    trace = run_for(MemoryTracer(interval_ms=10, devices=[0, 1], reader=GrowingReader()), 0.05)
    assert trace.samples
    data = json.loads(json.dumps(trace.to_dict()))
    assert MemoryTrace.from_dict(data) == trace
    empty = MemoryTrace(note="x")
    assert MemoryTrace.from_dict(json.loads(json.dumps(empty.to_dict()))) == empty


def test_peak_gib_uses_reserved_bytes() -> None:
    trace = MemoryTrace(devices=(0, 1), peak_reserved_bytes={0: 2 << 30, 1: 3 << 30})
    assert trace.peak_gib == 3.0
    assert trace.peak_gib_per_device() == {0: 2.0, 1: 3.0}


# --- the sampler loop with real threads and a fake reader ---------------------------------------------


def test_samples_arrive_at_roughly_the_interval() -> None:
    reader = GrowingReader()
    trace = run_for(MemoryTracer(interval_ms=20, devices=[0, 1], reader=reader), 0.3, until=lambda: reader.made >= 4)
    for d in (0, 1):
        per_device = [s for s in trace.samples if s.device == d]
        assert len(per_device) >= 3  # loose: ~15 expected, but CI machines stall
        times = [s.t_s for s in per_device]
        assert times == sorted(times) and times[0] >= 0.0
    assert trace.devices == (0, 1) and trace.interval_ms == 20
    assert trace.note == ""
    rows = trace.to_rows()
    assert len(rows) == len(trace.samples)
    assert set(rows[0]) == {"t_s", "device", "allocated_bytes", "reserved_bytes", "nvml_used_bytes"}


def test_start_and_stop_each_take_a_sample() -> None:
    trace = run_for(MemoryTracer(interval_ms=60_000, devices=[3], reader=GrowingReader()), 0.0)
    assert [s.device for s in trace.samples] == [3, 3]


def test_peaks_are_the_max_seen_per_device() -> None:
    values = itertools.cycle([10, 50, 20])  # peak in the middle, so "last sample" would be wrong
    calls = []

    def reader(device: int) -> tuple[int, int, int | None]:
        calls.append(device)
        v = next(values) + device
        return v, 2 * v, (3 * v if device == 0 else None)

    trace = run_for(MemoryTracer(interval_ms=5, devices=[0, 1], reader=reader), 0.1, until=lambda: len(calls) >= 8)
    for d in (0, 1):
        mine = [s for s in trace.samples if s.device == d]
        assert trace.peak_allocated_bytes[d] == max(s.allocated_bytes for s in mine)
        assert trace.peak_reserved_bytes[d] == max(s.reserved_bytes for s in mine)
    assert trace.peak_nvml_used_bytes == {0: max(s.nvml_used_bytes or 0 for s in trace.samples)}
    assert trace.peak_gib == max(trace.peak_reserved_bytes.values()) / (1 << 30)


def test_decimation_bounds_samples_and_keeps_peaks() -> None:
    reader = GrowingReader()
    trace = run_for(MemoryTracer(interval_ms=1, devices=[0, 1], reader=reader, max_samples=10), 0.2,
                    until=lambda: reader.made >= 12)  # more than max_samples: decimated at least once
    assert 0 < len(trace.samples) <= 10
    assert trace.interval_ms > 1  # doubled at least once
    assert {s.device for s in trace.samples} == {0, 1}  # whole ticks kept, not every other device
    for d in (0, 1):  # the running max survives decimation
        alloc, reserved, nvml = reader.max_seen[d]
        assert trace.peak_allocated_bytes[d] == alloc and trace.peak_reserved_bytes[d] == reserved


def test_max_samples_below_device_count_raises() -> None:
    with pytest.raises(ValueError, match="max_samples"):
        MemoryTracer(devices=[0, 1], reader=GrowingReader(), max_samples=1).start()


def test_reader_error_is_recorded_not_fatal() -> None:
    calls = []

    def flaky(device: int) -> tuple[int, int, int | None]:
        calls.append(device)
        if len(calls) % 3 == 2:
            raise RuntimeError("driver hiccup")
        return 1, 2, None

    tracer = MemoryTracer(interval_ms=5, devices=[0], reader=flaky)
    trace = run_for(tracer, 0.1, until=lambda: len(calls) >= 3)  # ok, failed, ok; stop's own sample after
    assert "sampling failed on device 0: RuntimeError: driver hiccup" in trace.note
    assert "sampling error(s)" in trace.note
    assert len(trace.samples) >= 2  # the thread kept going after the error
    assert tracer._thread is not None and not tracer._thread.is_alive()


def test_reader_always_failing_gives_empty_trace_with_note() -> None:
    def broken(device: int) -> tuple[int, int, int | None]:
        raise OSError("no such device")

    trace = run_for(MemoryTracer(interval_ms=5, devices=[0], reader=broken), 0.05)
    assert trace.samples == () and trace.peak_gib == 0.0
    assert "OSError: no such device" in trace.note


def test_sample_is_frozen() -> None:
    s = MemorySample(0.0, 0, 1, 2, None)
    with pytest.raises(AttributeError):
        s.device = 1  # type: ignore[misc]


# --- real CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_rises_with_an_allocation() -> None:
    torch.cuda.init()
    with MemoryTracer(interval_ms=10) as tracer:
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
        time.sleep(0.05)
        del x
    trace = tracer.trace
    assert trace.devices == tuple(range(torch.cuda.device_count()))
    assert trace.peak_allocated_bytes[0] >= 512 * MiB
    assert trace.peak_reserved_bytes[0] >= 512 * MiB and trace.peak_gib >= 0.5
    assert len(trace.samples) >= 2 * len(trace.devices)
    # NVML either reports device-wide use (which includes our allocation) or says why not.
    assert trace.peak_nvml_used_bytes.get(0, 0) >= 512 * MiB or "NVML disabled" in trace.note
    reset_and_empty_cache()
