"""Memory tracer wrapped around each trial inside a generation worker.

A daemon thread samples allocator (and optionally NVML) memory every `interval_ms`, because a Ray
actor runs one method at a time and cannot poll memory itself while a trial runs. Peaks come from
`torch.cuda.max_memory_*` read at stop, which also catches spikes that fall between two samples.
Where there is no CUDA device the tracer samples the process's resident set size instead (kind
``process_rss``, one pseudo-device 0), so CPU runs get a real trace and peak too; the kernel's
high-water mark (VmHWM, reset at start through /proc/self/clear_refs) catches spikes between samples.
Nothing here touches CUDA at import time, so importing it on a CPU-only driver is free.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any, Callable

import torch

from workers.wire import KIND_CUDA, KIND_RSS, PEAK_KEYS, MemorySample, MemoryTrace

NO_DEVICE_NOTE = "no CUDA device: nothing to sample"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# device index -> (allocated_bytes, reserved_bytes, nvml_used_bytes or None)
Reader = Callable[[int], tuple[int, int, int | None]]


def reset_and_empty_cache() -> None:
    """After an OOM (outside the `except` block, whose traceback pins tensors): free what we can."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def process_rss_bytes() -> int:
    """Resident set size of this process (what a CPU trial really holds in memory)."""
    try:
        with open("/proc/self/statm") as handle:  # Linux: pages; no extra dependency on the hot path
            return int(handle.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import psutil  # other systems

        return int(psutil.Process().memory_info().rss)


def _read_hwm_bytes() -> int | None:
    """The kernel's peak RSS of this process since the last reset (Linux VmHWM), or None."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS so the peak covers this trial only (Linux; False elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _nvml_handle(pynvml: Any, device: int) -> Any:
    """NVML ignores CUDA_VISIBLE_DEVICES, so match torch's device by PCI bus id, else by UUID."""
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        if not isinstance(bus, str):  # torch gives the integer parts; NVML wants "dddddddd:bb:dd.0"
            dom, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            bus = f"{dom:08X}:{bus:02X}:{dev:02X}.0"
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except pynvml.NVMLError:
            pass
    uuid = str(props.uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


class MemoryTracer:
    """`with MemoryTracer() as t: run_trial(); trace = t.trace` or `start()` ... `stop()`.

    `devices` defaults to every visible CUDA device. `reader` replaces the torch/NVML reader (for
    tests); with it, CUDA is not needed and peaks come from the samples alone. Without CUDA (and
    without a reader) `rss=True` traces the process's resident memory as device 0; `rss=False`
    leaves the trace empty with a note.
    """

    def __init__(
        self,
        interval_ms: float = 50.0,
        devices: list[int] | None = None,
        use_nvml: bool = True,
        max_samples: int = 100_000,
        reader: Reader | None = None,
        rss: bool = True,
    ) -> None:
        if not interval_ms > 0:  # also rejects NaN
            raise ValueError(f"interval_ms must be > 0, got {interval_ms!r}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples!r}")
        self._interval_s = interval_ms / 1000.0
        self._requested_devices = devices
        self._use_nvml = use_nvml
        self._max_samples = max_samples
        self._reader = reader
        self._rss = rss
        self._kind = KIND_CUDA
        self._hwm_reset = False
        self._devices: tuple[int, ...] = ()
        self._ticks: list[tuple[MemorySample, ...]] = []  # per tick, so decimation keeps devices together
        self._peaks: dict[str, dict[int, int]] = {k: {} for k in PEAK_KEYS}  # running maxima
        self._notes: list[str] = []
        self._errors = 0
        self._n_samples = 0
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._started = False
        self._trace: MemoryTrace | None = None

    def __enter__(self) -> MemoryTracer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()  # never swallows the trial's exception (an OOM, say)

    @property
    def trace(self) -> MemoryTrace:
        if self._trace is None:
            raise RuntimeError("MemoryTracer.trace is available only after stop()")
        return self._trace

    def start(self) -> MemoryTracer:
        if self._started:
            raise RuntimeError("MemoryTracer can be started only once")
        self._started = True
        self._t0 = time.perf_counter()
        visible = torch.cuda.is_available()
        req = self._requested_devices
        wanted = range(torch.cuda.device_count()) if req is None else req
        # Without CUDA only an injected reader, or the process's RSS, has anything to read.
        self._devices = tuple(wanted) if visible or self._reader is not None else ()
        if not self._devices and self._rss and self._reader is None:
            self._kind, self._devices = KIND_RSS, (0,)
            self._reader = self._rss_reader
            self._hwm_reset = _reset_hwm()
        if not self._devices:
            self._notes.append(NO_DEVICE_NOTE)
            return self
        if len(self._devices) > self._max_samples:
            raise ValueError(f"max_samples={self._max_samples} is below one sample per device")
        if self._kind == KIND_CUDA and self._reader is None:  # with an injected reader, torch.cuda is left alone
            for d in self._devices:  # peaks then cover this trial only
                torch.cuda.reset_peak_memory_stats(d)
            if self._use_nvml:
                self._init_nvml()
        self._tick()
        self._thread = threading.Thread(target=self._loop, name="memory-tracer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemoryTrace:
        if self._trace is not None:
            return self._trace
        if not self._started:
            raise RuntimeError("MemoryTracer.stop() called before start()")
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._tick()
        if self._reader is None and self._devices:
            try:  # allocator peaks catch spikes between samples
                for d in self._devices:
                    self._raise_peak("peak_allocated_bytes", d, torch.cuda.max_memory_allocated(d))
                    self._raise_peak("peak_reserved_bytes", d, torch.cuda.max_memory_reserved(d))
            except Exception as e:  # noqa: BLE001 - e.g. a dead CUDA context; don't mask the trial's error
                self._notes.append(f"allocator peaks unavailable: {type(e).__name__}: {e}")
        if self._kind == KIND_RSS:
            hwm = _read_hwm_bytes() if self._hwm_reset else None
            if hwm is not None:  # the kernel's peak also covers spikes between two samples
                self._raise_peak("peak_allocated_bytes", 0, hwm)
                self._raise_peak("peak_reserved_bytes", 0, hwm)
            else:
                self._notes.append("peak RSS from the samples only (no resettable VmHWM here)")
        self._shutdown_nvml()
        if self._errors:
            self._notes.append(f"{self._errors} sampling error(s)")
        self._trace = MemoryTrace(
            samples=tuple(s for tick in self._ticks for s in tick),
            devices=self._devices,
            interval_ms=self._interval_s * 1000.0,
            note="; ".join(self._notes),
            kind=self._kind,
            **{k: dict(v) for k, v in self._peaks.items()},
        )
        return self._trace

    # Internals. No lock needed: start() and stop() sample only before the thread starts / after join.

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - record, never die silently
                self._notes.append(f"sampler stopped: {type(e).__name__}: {e}")
                return

    def _tick(self) -> None:
        t = time.perf_counter() - self._t0
        tick: list[MemorySample] = []
        for d in self._devices:
            try:
                alloc, reserved, nvml = (self._reader or self._torch_reader)(d)
                nvml = None if nvml is None else int(nvml)
                tick.append(MemorySample(t, d, int(alloc), int(reserved), nvml))
            except Exception as e:  # noqa: BLE001 - a broken reader must not end the trial or vanish
                self._errors += 1
                if self._errors == 1:
                    self._notes.append(f"sampling failed on device {d}: {type(e).__name__}: {e}")
                continue
            self._raise_peak("peak_allocated_bytes", d, tick[-1].allocated_bytes)
            self._raise_peak("peak_reserved_bytes", d, tick[-1].reserved_bytes)
            if tick[-1].nvml_used_bytes is not None:
                self._raise_peak("peak_nvml_used_bytes", d, tick[-1].nvml_used_bytes)
        if not tick:
            return
        self._ticks.append(tuple(tick))
        self._n_samples += len(tick)
        # Bound memory on long trials: halve the time resolution rather than drop the tail.
        # Peaks are running maxima, so decimation never loses them.
        while self._n_samples > self._max_samples and len(self._ticks) > 1:
            self._ticks = self._ticks[::2]
            self._n_samples = sum(len(k) for k in self._ticks)
            self._interval_s *= 2

    def _raise_peak(self, kind: str, device: int, value: int) -> None:
        peaks = self._peaks[kind]
        peaks[device] = max(peaks.get(device, 0), int(value))

    @staticmethod
    def _rss_reader(device: int) -> tuple[int, int, int | None]:
        rss = process_rss_bytes()
        return rss, rss, None

    def _torch_reader(self, device: int) -> tuple[int, int, int | None]:
        nvml_used = None
        if self._nvml is not None:
            try:
                nvml_used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles[device]).used)
            except Exception as e:  # noqa: BLE001 - NVML is optional; keep the allocator numbers
                self._shutdown_nvml(e)
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), nvml_used

    def _init_nvml(self) -> None:
        try:
            import pynvml  # lazy: nvidia-ml-py is only needed on GPU machines

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = {d: _nvml_handle(pynvml, d) for d in self._devices}
        except Exception as e:  # noqa: BLE001 - no driver, no library, unmappable device: go on without
            self._shutdown_nvml(e)

    def _shutdown_nvml(self, err: BaseException | None = None) -> None:
        if err is not None:
            self._notes.append(f"NVML disabled: {type(err).__name__}: {err}")
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - a failed shutdown changes nothing we report
                pass
